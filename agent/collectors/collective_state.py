"""What the collectives collector keeps: one state per flight recorder and per process group, what the
ops add up to, and the step boundaries that place an op in its step.

Plain state, written on the agent thread; the scrape reads it (a dict it iterates is copied first).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from hpar_agent.buffer import BoundedBuffer
from hpar_agent.catalogue import LATENCY_BUCKETS
from hpar_agent.collectors.fr_ledger import MAX_BOUNDARIES
from hpar_agent.histogram import Histogram
from hpar_agent.torch_compat.fr_decode import stuck

#: Steps whose reduced elements and timed intervals are kept (gradient-sync coverage, step anatomy).
MAX_REDUCE_STEPS = 256
#: Timed intervals kept per step.
MAX_INTERVALS = 4096


@dataclass(slots=True)
class RecorderState:
    """One flight recorder as the collector reads it: its full reads (when, why, what ``pg_status``
    said then and at the last probe) and what its entries leave pending."""

    status: dict[str, Any] | None = None  # pg_status at the last full read (None: never read)
    probe: dict[str, Any] | None = None  # pg_status at the last probe
    slot: int | None = None  # ``fr_interval`` slot of the last full read
    read_ns: int | None = None  # epoch ns of the last full read
    prev_read_ns: int = 0  # epoch ns of the full read before the last (0: none)
    p2p: bool = False  # its entries include p2p ops, which pg_status does not count
    pending: int = 0  # entries awaiting their duration
    pending_min_ns: int | None = None  # the oldest of them (the span watermark)
    #: (op, peer, pg, seconds open) of the p2p ops its last full read showed not completed (NCCL)
    p2p_open: list[tuple[str, int, str, float]] = field(default_factory=list)
    pg_ids: dict[str, str] = field(default_factory=dict)  # the recorder's pg_id -> pg label
    reasons: Counter[str] = field(default_factory=Counter)  # full reads by what called for them

    def read_reason(self, status: dict[str, Any], slot: int, stopping: bool) -> str | None:
        """Why ``status``, a probe's taken now, calls for a full read (``CollectiveCollector._read``), or
        None; the probe becomes the last one."""
        last_probe, self.probe = self.probe, status
        unread = status != self.status
        moved = unread or self.p2p or self.pending > 0  # pg_status does not track p2p: counted as new
        if self.read_ns is None:
            return "first"
        if stopping:
            return "final"
        if moved and slot != self.slot:
            return "slot"
        if unread and stuck(status, last_probe):
            return "in flight"
        return None

    def mark_read(self, reason: str, status: dict[str, Any], slot: int, now_ns: int) -> None:
        self.reasons[reason] += 1
        self.status, self.slot = status, slot
        self.prev_read_ns, self.read_ns = self.read_ns or 0, now_ns

    @property
    def settled(self) -> bool:
        """Read, and nothing moved in ``pg_status`` since that read."""
        return self.read_ns is not None and self.probe == self.status


@dataclass(slots=True)
class PgState:
    """One process group (by its ``pg`` label) on this rank: its ops in flight (``pg_status``; the p2p
    wrapper's for ``pp``), the collectives read but not yet completed, and where they come from."""

    inflight: int | None = None  # ops enqueued and not completed
    oldest_age: float | None = None  # seconds since the oldest of them was enqueued
    last_enqueued: int | None = None  # seq of the last collective enqueued
    last_completed: int | None = None  # seq of the last collective completed
    open: dict[int, int] = field(default_factory=dict)  # seq -> enqueue ns, not yet completed
    backend: str = ""  # the recorder its collectives came from ("": none read yet)
    timing: bool | None = None  # its ops carry durations (None: no op counted as of the last poll)

    def update(self, enq: int, done: int, now_ns: int) -> None:
        """The group's ``pg_status`` (last enqueued and completed seq; -1: none)."""
        self.inflight = max(0, enq - done)
        if done >= 0:
            self.last_completed = done
        if enq >= 0:
            self.last_enqueued = enq
        opened = self.open
        for seq in [s for s in opened if s <= done]:
            del opened[seq]
        live = [t for s, t in opened.items() if s <= enq]
        self.oldest_age = max(0.0, (now_ns - min(live)) / 1e9) if live and enq > done else 0.0


#: A timed op as the detectors read it (CollectiveLatencyHigh nets out arrival skew): (pg label, op, seq,
#: enqueue ns, seconds). A plain tuple of atomic values, which the garbage collector stops tracking: a
#: NamedTuple it tracks for as long as the 2,048 recent ones are kept (see ``buffer``).
TimedOp = tuple[str, str, int, int, float]


class OpStats:
    """What the counted and timed ops add up to: the collector's metrics, and what the detectors, the
    gradient-sync coverage and the step anatomy read."""

    def __init__(self, recent: int) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()  # (pg, op) -> ops
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.hists: dict[tuple[str, str, str], Histogram] = {}  # (pg, op, stream) -> latency
        self.last_busbw: dict[tuple[str, str], float] = {}
        self.unobserved: Counter[str] = Counter()  # pg -> entries the ring overwrote before a read
        self.timed = 0
        self.timed_ops: deque[TimedOp] = deque(maxlen=recent)
        #: step -> pg -> input elements of its all_reduce/reduce_scatter entries (gradient-sync coverage)
        self.reduced_elems: dict[int, Counter[str]] = {}
        #: step -> (start ns, end ns) of its timed ops: the anatomy's exposed communication
        self.intervals: dict[int, list[tuple[int, int]]] = {}

    def count(self, pg: str, op: str, nbytes: int) -> None:
        self.counts[(pg, op)] += 1
        self.bytes[(pg, op)] += nbytes

    def observe(
        self, pg: str, op: str, stream: str, seq: int, start_ns: int, seconds: float, exemplar: str | None
    ) -> None:
        """A timed op: its histogram (with the step's trace id as exemplar) and the recent timed ops."""
        key = (pg, op, stream)
        hist = self.hists.get(key)
        if hist is None:  # not setdefault: that builds a histogram for every op
            hist = self.hists[key] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds, exemplar, (start_ns + seconds * 1e9) / 1e9)
        self.timed_ops.append((pg, op, seq, start_ns, seconds))
        self.timed += 1

    def reduced_of(self, step: int) -> Counter[str]:
        """pg -> input elements of the step's all_reduce/reduce_scatter entries (bounded in steps)."""
        by_pg = self.reduced_elems.get(step)
        if by_pg is None:
            if len(self.reduced_elems) >= MAX_REDUCE_STEPS:
                del self.reduced_elems[min(self.reduced_elems)]
            by_pg = self.reduced_elems[step] = Counter()
        return by_pg

    def take_reduced(self, step: int) -> Counter[str]:
        """Takes pg -> elements reduced in ``step`` (empty: none read)."""
        return self.reduced_elems.pop(step, Counter())

    def keep_interval(self, step: int, start_ns: int, end_ns: int) -> None:
        spans = self.intervals.get(step)
        if spans is None:
            if len(self.intervals) >= MAX_REDUCE_STEPS:
                del self.intervals[min(self.intervals)]
            spans = self.intervals[step] = []
        if len(spans) < MAX_INTERVALS:
            spans.append((start_ns, end_ns))

    def take_intervals(self, step: int) -> list[tuple[int, int]]:
        return self.intervals.pop(step, [])


class Boundaries:
    """The recent step boundaries, from the step hook: which step an op's time falls in."""

    def __init__(self) -> None:
        #: (epoch ns, step) of each boundary, put by the step hook (training thread)
        self.buffer: BoundedBuffer[tuple[int, int]] = BoundedBuffer("collectives_steps", 4096)
        self._t: list[int] = []
        self._s: list[int] = []

    def drain(self) -> list[tuple[int, int]]:
        """The boundaries put since the last drain, now kept (oldest first)."""
        new = self.buffer.drain()
        if new:
            for t_ns, step in new:
                self._t.append(t_ns)
                self._s.append(step)
            del self._t[:-MAX_BOUNDARIES], self._s[:-MAX_BOUNDARIES]
        return new

    def step_of(self, t_ns: int) -> int:
        """The step whose window (previous boundary, boundary] contains ``t_ns``."""
        i = bisect.bisect_left(self._t, t_ns)
        if i < len(self._s):
            return self._s[i]
        return self._s[-1] + 1 if self._s else 0

    def recent(self) -> list[tuple[int, int]]:
        """(boundary epoch ns, step) of the recent step boundaries, oldest first."""
        return list(zip(self._t, self._s, strict=True))
