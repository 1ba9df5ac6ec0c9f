"""The step anatomy's arithmetic: one step's phases from the timestamps its hooks recorded.

An event is ``(code, t0 ns, t1 ns, CUDA event or None)``; the codes are below. Everything here is a pure
function of the events (no agent state), so the anatomy collector and the tests share it.

The time from the step's start (the last step boundary) to its first forward is split in two:
``data_wait``, the part spent inside the data loader's ``__next__`` (the only wait the agent can tell
is for input), and ``host``, the rest (logging, checkpoints, host syncs, batch preparation outside a
DataLoader, collectives the loop calls between steps). Calling all of it a data wait named a loop
that logs for 50 ms after each step input-bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

FWD0, FWD1, BWD0, BWD1, OPT0, LOAD, OPT1, SYNC1, EVAL = range(9)  # EVAL: the step held an evaluation

Event = tuple[int, int, int, Any]
Interval = tuple[int, int]
Span = tuple[str, int, int]
MAX_GAP_SPANS = 8  # data_wait/host spans of one step (a loader called many times between steps)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def exposed_ns(comm: Iterable[Interval], busy: Iterable[Interval], lo: int, hi: int) -> list[Interval]:
    """The parts of the ``comm`` intervals inside [lo, hi] that no ``busy`` interval covers: the union of
    ``comm`` clipped to [lo, hi], minus the union of ``busy``."""
    out: list[Interval] = []
    cover = union(busy)
    for a, b in union((max(a, lo), min(b, hi)) for a, b in comm):
        for c, d in cover:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def seconds(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals) / 1e9


def split_gap(lo: int, hi: int, loads: Sequence[Interval]) -> tuple[list[Interval], list[Interval]]:
    """[lo, hi] (before the first forward) split into the data loader's part and the rest (host)."""
    data = exposed_ns(loads, [], lo, hi)
    return data, exposed_ns([(lo, hi)], data, lo, hi)


def _gap(
    out: dict[str, float], spans: list[Span], lo: int, hi: int, loads: Sequence[Interval], shift: int = 0
) -> None:
    data, host = split_gap(lo, hi, loads)
    out["data_wait"], out["host"] = seconds(data), seconds(host)
    parts = sorted(
        [("data_wait", a, b) for a, b in data] + [("host", a, b) for a, b in host], key=lambda s: s[1]
    )
    spans[:0] = [(p, a + shift, b + shift) for p, a, b in parts[:MAX_GAP_SPANS]]


def loads_of(events: Iterable[Event]) -> list[Interval]:
    return [(t0, t1) for code, t0, t1, _ev in events if code == LOAD]


def cpu_phases(
    start_ns: int,
    end_ns: int,
    events: Sequence[Event],
    chunks: tuple[dict[str, float], int | None] | None = None,
) -> tuple[dict[str, float], list[Span], float]:
    """Phase seconds of one step from CPU wall-clock times, the spans behind them and the seconds spent in
    the data loader. ``chunks``: under a pipeline schedule, the stage's forward/backward chunk seconds
    and its first stage-0 forward chunk's start (None on other stages: they load no data)."""
    out: dict[str, float] = {}
    spans: list[Span] = []
    opened: dict[int, int] = {}
    first_fwd: int | None = None
    opt0: int | None = None
    last_busy = 0  # end of the last forward or backward: a closure optimizer runs them inside its step
    for code, t0, _t1, _ev in sorted(events, key=lambda e: e[1]):
        if code in (FWD0, BWD0):
            opened.setdefault(code, t0)
            if code == FWD0 and first_fwd is None:
                first_fwd = t0
        elif code in (FWD1, BWD1):
            start = opened.pop(code - 1, None)
            if start is not None:
                phase = "forward" if code == FWD1 else "backward"
                out[phase] = out.get(phase, 0.0) + (t0 - start) / 1e9
                spans.append((phase, start, t0))
                last_busy = t0
        elif code == OPT0:
            opt0 = t0
    if opt0 is not None:
        opt0 = max(opt0, last_busy)
    loads = loads_of(events)
    if chunks is not None:
        spans = []  # pp.forward / pp.backward spans already show the chunks
        by_phase, first_fwd = chunks
        for phase in ("forward", "backward"):
            if phase in by_phase:
                out[phase] = by_phase[phase]
            else:
                out.pop(phase, None)
    if first_fwd is not None and first_fwd >= start_ns:
        _gap(out, spans, start_ns, first_fwd, loads)
    if opt0 is not None and start_ns <= opt0 <= end_ns:
        out["optimizer"] = (end_ns - opt0) / 1e9
        spans.append(("optimizer", opt0, end_ns))
    return out, spans, seconds(loads)


def gpu_phases(
    start_ns: int, events: Sequence[Event], prev_end: Any, end: Any
) -> tuple[dict[str, float], list[Span], float, float]:
    """Phases on the GPU stream from CUDA events (all complete: ``end`` is the last one), the spans, the
    loader seconds and the step's stream seconds. Offsets are measured from the previous step's end
    event; spans are placed at the step's start plus those offsets.

    The GPU waited before its first forward only while both held: the stream sat idle AND the host was
    not yet at the forward (stream idle alone is launch overhead in a host-bound loop: a clean H200 run
    read as input-bound; host time alone includes syncs such as a loss ``.item()``). That wait is the
    end of the host's way to the forward (the GPU caught up with the host first); its data loader part
    is ``data_wait``, the rest ``host``."""
    out: dict[str, float] = {}
    spans: list[Span] = []
    opened: dict[int, Any] = {}
    first_fwd: Any = None
    first_fwd_host = 0
    opt0: Any = None
    last_busy: Any = None  # the event ending the last forward or backward (see cpu_phases)

    def off(ev: Any) -> float:
        return float(prev_end.elapsed_time(ev)) / 1e3

    def at(ev: Any) -> int:
        return start_ns + int(off(ev) * 1e9)

    for code, t0, _t1, ev in sorted(events, key=lambda e: e[1]):
        if ev is None:
            continue
        if code in (FWD0, BWD0):
            opened.setdefault(code, ev)
            if code == FWD0 and first_fwd is None:
                first_fwd, first_fwd_host = ev, t0
        elif code in (FWD1, BWD1):
            start = opened.pop(code - 1, None)
            if start is not None:
                phase = "forward" if code == FWD1 else "backward"
                out[phase] = out.get(phase, 0.0) + float(start.elapsed_time(ev)) / 1e3
                spans.append((phase, at(start), at(ev)))
                last_busy = ev
        elif code == OPT0:
            opt0, last_busy = ev, None
    if opt0 is not None and last_busy is not None:
        opt0 = last_busy  # a forward or backward ran inside the optimizer's step (a closure)
    loads = loads_of(events)
    if first_fwd is not None:
        host_way = max(0, first_fwd_host - start_ns)
        waited = min(int(off(first_fwd) * 1e9), host_way)
        _gap(out, spans, first_fwd_host - waited, first_fwd_host, loads, shift=at(first_fwd) - first_fwd_host)
    if opt0 is not None:
        out["optimizer"] = float(opt0.elapsed_time(end)) / 1e3
        spans.append(("optimizer", at(opt0), at(end)))
    return out, spans, seconds(loads), off(end)


def host_waits(events: Iterable[Event]) -> list[Interval]:
    """CPU clock: each backward's end to the engine callback queued after DDP's (its bucket wait)."""
    out, bwd_end = [], None
    for code, t0, _t1, _ev in sorted(events, key=lambda e: e[1]):
        if code == BWD1:
            bwd_end = t0
        elif code == SYNC1 and bwd_end is not None:
            out.append((bwd_end, t0))
            bwd_end = None
    return out
