"""Readers of the collectors' state for the detectors' feed: the one place that knows their fields.

Each reader finds its collector once (through the context, by class) and returns what the detectors use
of it as an immutable record, which the pass's snapshot holds (``snapshot.Snapshot``). Every read is of
a typed attribute of a collector class: a renamed field fails mypy and ``tests/unit/detectors/
test_sources.py``, rather than reading as "no data". A collector that is not installed (detectors
without it) reads as no data (None/empty).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.gpu_health import GpuHealthCollector
from hpar_agent.collectors.gradsync import GradSyncCollector
from hpar_agent.collectors.memory import MemoryCollector, NvmlCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.detectors.signals import FrEntry
from hpar_agent.detectors.waits import GroupState, P2PWait, p2p_waits
from hpar_agent.topology import ATOMIC_DIMS, FLATTENED_DIMS

if TYPE_CHECKING:
    from hpar_agent.affinity import Binding
    from hpar_agent.context import AgentContext

#: (pg label, op, seq, enqueue ns, seconds) of a timed collective
TimedOp = tuple[str, str, int, int, float]


# ------------------------------------------------------------------------------------------ steps
#: Step durations the detectors read (a median over them; the step collector keeps 512)
RECENT_STEPS = 64


def step_state(ctx: AgentContext) -> tuple[int, float, list[float]]:
    """(steps completed, unix time of the last step, the last ``RECENT_STEPS`` durations). The count is the
    training thread's own (``count``), not the drained one: a pass reaches the detectors a while after
    the step collector's poll (a full flight-recorder read in between), and what the other collectors
    read since (a graph break of the step in progress) must not look older than it is."""
    c = ctx.find(StepCollector)
    if c is None:
        return 0, 0.0, []
    return max(c.count, c.total), c.last_step_ts, c.durations[-RECENT_STEPS:]


def progress(ctx: AgentContext) -> tuple[float, float | None]:
    """(unix time of the last progress, the training thread's share of a CPU over the last pass): the
    step collector's ``last_progress_ts`` and ``cpu_share``."""
    c = ctx.find(StepCollector)
    return (c.last_progress_ts, c.cpu_share) if c is not None else (0.0, None)


# ------------------------------------------------------------------------------------------ compile
class CompileState(NamedTuple):
    """The compile collector's counters so far."""

    recompiles: float  # recompiles plus recompile-limit hits (a limit hit is a recompile that was refused)
    limit_hits: float  # frames that hit Dynamo's recompile limit
    cache_lookups: tuple[float, float]  # (hits, misses) summed over the compile caches
    graph_breaks: Mapping[str, int]  # reason key -> graph breaks
    break_info: Mapping[str, Any]  # reason key -> what the collector logged (``break_detail``)
    graph_log: Sequence[tuple[int, str]]  # (step, code location) of every graph compiled (bounded)
    fingerprint: int
    #: changes whenever compile work was seen (compiles started or ended, graphs, compile time); the
    #: last element: compiles in progress
    activity: tuple[float, ...]

    def break_detail(self, reason: str) -> str:
        """The user stack / message logged for graph breaks of ``reason`` (for the alert details)."""
        return break_detail(self.break_info.get(reason))

    def break_c10d(self, reason: str) -> str:
        """The c10d function (e.g. broadcast) that caused graph breaks of ``reason``; '' for other breaks."""
        return break_c10d(self.break_info.get(reason))


def compile_state(ctx: AgentContext) -> CompileState | None:
    c = ctx.find(CompileCollector)
    if c is None:
        return None
    hits = misses = 0.0
    for (_cache, result), n in list(c.cache.items()):
        if result == "hit":
            hits += n
        elif result == "miss":
            misses += n
    activity = (
        float(sum(c.compiles.values())),
        float(c.compile_seconds),
        float(len(c.graphs)),
        float(c.open_compiles),
    )
    return CompileState(
        recompiles=float(sum(c.recompiles.values()) + c.limit_hits),
        limit_hits=float(c.limit_hits),
        cache_lookups=(hits, misses),
        graph_breaks=dict(c.graph_breaks),
        break_info=dict(c.break_info),
        graph_log=list(c.graph_log),
        fingerprint=int(c.fingerprint),
        activity=activity,
    )


def graph_break_detail(ctx: AgentContext, reason: str) -> str:
    """The user stack / message the compile collector logged for ``reason``."""
    c = ctx.find(CompileCollector)
    return break_detail(c.break_info.get(reason) if c is not None else None)


def break_detail(entry: Any) -> str:
    """The text of one ``break_info`` entry: the c10d hint, the message, the first user frames."""
    if not isinstance(entry, Mapping):
        return ""
    frames = sorted(str(f) for f in entry.get("user_frames") or ())[:4]
    c10d = str(entry.get("c10d") or "")
    head = (
        [f"c10d call `{c10d}` inside compiled code; use torch.distributed._functional_collectives"]
        if c10d
        else []
    )
    return "; ".join([*head, str(entry.get("reason", ""))[:500], *frames])


def break_c10d(entry: Any) -> str:
    """The c10d function of one ``break_info`` entry; '' for other breaks."""
    return str(entry.get("c10d") or "") if isinstance(entry, Mapping) else ""


# ------------------------------------------------------------------------------------------ memory
class MemoryState(NamedTuple):
    series: Mapping[str, Sequence[tuple[int, float]]]  # source -> [(step, bytes)] sampled after each step
    room: Mapping[str, int]  # source -> bytes left before the device is full


NO_MEMORY = MemoryState({}, {})


def memory_state(ctx: AgentContext, last: int = 0) -> MemoryState:
    """The post-step samples (the ``last`` ones of each source only, when set: a window over the latest
    steps needs no more, and the history holds hundreds a source) and the room left: allocated bytes
    can grow by the headroom (free device memory + the allocator's cache), reserved and NVML bytes by
    the free device memory (none off CUDA or before the first read)."""
    c = ctx.find(MemoryCollector)
    if c is None:
        return NO_MEMORY
    series = {}
    for k, d in list(c.post_step.items()):
        tail = list(d)[-last:] if last > 0 else list(d)
        series[str(k)] = [(int(s), float(b)) for s, b in tail]
    room = {}
    if c.headroom is not None and c.device_free is not None:
        room = {"allocator": c.headroom, "reserved": c.device_free, "nvml": c.device_free}
    return MemoryState(series, room)


# ------------------------------------------------------------------------------------------ collectives
class CollectiveState(NamedTuple):
    timed: int  # ops timed so far
    timed_ops: Sequence[TimedOp]  # the most recent ones
    oldest_inflight: Mapping[str, float]  # pg -> age in seconds of its oldest op not yet completed
    groups: Mapping[str, GroupState]  # pg id -> this rank's last seqs (``group_states``)
    pg_timeout_s: float | None
    fr_entries: Sequence[FrEntry]  # the last flight-recorder entries (``fr_entries``)
    p2p_waits: Sequence[P2PWait] = ()  # the p2p ops the training thread waits in now, one per peer
    #: (exit ns, ns waited in p2p so far) of its last waits (``signals.waited_by`` reads it)
    p2p_waited: Sequence[tuple[int, int]] = ()


NO_COLLECTIVES = CollectiveState(0, [], {}, {}, None, [])


def collective_state(
    ctx: AgentContext,
    window: FrWindow | None = None,
    limit: int = 256,
    coords: Mapping[str, Any] | None = None,
    span_ns: int = 0,
) -> CollectiveState:
    """The collective collector's state; its last ``limit`` entries through ``window`` (converted from
    pass to pass), else converted afresh, more where those span less than ``span_ns`` (``FrWindow``).
    ``coords``: the topology's, when the caller has them."""
    c = ctx.find(CollectiveCollector)
    if c is None:
        return NO_COLLECTIVES
    coords = coords if coords is not None else ctx.topology.coords()
    timeout = c.pg_timeout_s
    return CollectiveState(
        timed=c.stats.timed,
        timed_ops=list(c.stats.timed_ops),
        oldest_inflight={
            str(k): float(st.oldest_age) for k, st in list(c.pgs.items()) if st.oldest_age is not None
        },
        groups=group_states(c, coords),
        pg_timeout_s=float(timeout) if timeout is not None and timeout > 0 else None,
        fr_entries=(window or FrWindow()).entries(c, coords, limit, span_ns),
        p2p_waits=waiting_in(c),
        p2p_waited=list(c.p2p.waited),
    )


def waiting_in(c: CollectiveCollector) -> list[P2PWait]:
    """The p2p ops this rank waits in, one per peer: the ones its training thread blocks in now (the
    pipelining wrapper's, gloo), else those the flight recorder's last full read showed open (NCCL,
    whose wait does not block the thread), aged as of that read."""
    got = c.p2p.waiting_in()
    if got is not None:
        t_enter, ops = got
        return p2p_waits([(o.op, o.peer, o.pg) for o in ops], max(0.0, (time.time_ns() - t_enter) / 1e9))
    out: list[P2PWait] = []
    for reader in list(c.readers.values()):
        opened = reader.p2p_open
        if opened:
            out += p2p_waits([(op, peer, pg) for op, peer, pg, _ in opened], min(a for *_, a in opened))
    return out


def latency_histograms(ctx: AgentContext) -> dict[tuple[str, str], tuple[tuple[float, ...], list[int]]]:
    """(pg, op) -> (bucket bounds, per-bucket counts) of collective latency, summed over streams."""
    c = ctx.find(CollectiveCollector)
    if c is None:
        return {}
    out: dict[tuple[str, str], tuple[tuple[float, ...], list[int]]] = {}
    for (pg, op, _stream), h in list(c.stats.hists.items()):
        key = (str(pg), str(op))
        if key in out:
            out[key] = (out[key][0], [a + b for a, b in zip(out[key][1], h.counts, strict=True)])
        else:
            out[key] = (tuple(h.bounds), list(h.counts))
    return out


def group_states(c: CollectiveCollector, coords: Mapping[str, Any]) -> dict[str, GroupState]:
    """pg id (unique per group, as ``fr_entries`` makes it) -> this rank's last enqueued and completed
    collective, the op of the last enqueued one while it is in flight, and the oldest in-flight age."""
    out = {}
    for pg, st in list(c.pgs.items()):
        enq = st.last_enqueued
        if enq is None:
            continue
        done = -1 if st.last_completed is None else st.last_completed
        op = _op_at(c.recent_entries, pg, enq) if enq > done else ""
        out[_group_key(pg, coords)] = GroupState(enq, done, op, float(st.oldest_age or 0.0))
    return out


def _op_at(entries: Any, pg: str, seq: int, look: int = 512) -> str:
    """The op of the collective ``seq`` of ``pg`` among the last ``look`` entries read ("" unread)."""
    for e in itertools.islice(reversed(entries), look):
        if isinstance(e, Mapping) and e.get("pg") == pg and e.get("seq") == seq and not e.get("is_p2p"):
            return str(e.get("op", "")).split(":")[-1]
    return ""


class FrWindow:
    """``fr_entries`` kept from pass to pass: the answer is computed again only when the kept entries
    changed (at a full FR read, seconds apart), and then only the entries the window gained are
    converted (a read adds a few dozen to a 256-entry window; converting the whole window again was the
    detectors' largest cost between exchanges)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._out: list[FrEntry] = []
        #: entries converted, by id (with the entry, so a reused id never matches), for the coordinates
        #: they were made with
        self._done: tuple[Any, dict[int, tuple[Any, FrEntry | None]]] = (None, {})

    def read(self, ctx: AgentContext, limit: int = 256) -> list[FrEntry]:
        """``fr_entries(ctx, limit)``; the list is the last one until the kept entries change: read it,
        never change it."""
        c = ctx.find(CollectiveCollector)
        return [] if c is None else self.entries(c, ctx.topology.coords(), limit)

    def entries(
        self, c: CollectiveCollector, coords: Mapping[str, Any], limit: int, span_ns: int = 0
    ) -> list[FrEntry]:
        """The last ``limit`` entries, or more where those span less than ``span_ns`` (a job with
        hundreds of collectives a step: Straggler measures whole steps), up to ``WIDEST`` x ``limit``."""
        v = c.recent_entries
        last = v[-1] if v else None
        record = last.get("record_id") if isinstance(last, Mapping) else None
        key = (id(v), len(v), id(last), record, limit, span_ns, tuple(coords.items()))
        if key == self._key:
            return self._out
        uids: dict[str, str] = {}
        done = self._done[1] if self._done[0] == key[-1] else {}  # conversions made with these coordinates
        now_done: dict[int, tuple[Any, FrEntry | None]] = {}
        out: list[FrEntry] = []
        if span_ns > 0 and len(v) > limit and last is not None:
            limit = _spanning(v, span_ns, limit, WIDEST * limit)
        for e in itertools.islice(v, max(0, len(v) - limit), None):
            was = done.get(id(e))  # converted at an earlier read (the window slides by a few entries)?
            entry = was[1] if was is not None and was[0] is e else _fr_entry(e, coords, uids)
            now_done[id(e)] = (e, entry)
            if entry is not None:
                out.append(entry)
        self._done = (key[-1], now_done)
        self._key, self._out = key, out
        return out


#: The most ``FrWindow`` widens its window to span its ``span_ns``, in multiples of its entry limit.
WIDEST = 4


def _spanning(v: Sequence[Any] | Any, span_ns: int, least: int, most: int) -> int:
    """How many of the last entries of ``v`` reach back ``span_ns`` from the newest (at least ``least``,
    at most ``most``)."""
    n = 0
    newest = None
    for e in itertools.islice(reversed(v), most):
        t = _time_ns(e)
        newest = t if newest is None else newest
        n += 1
        if n >= least and t < newest - span_ns:
            break
    return max(least, n)


def _time_ns(e: Any) -> int:
    t = e.get("time_created_ns", e.get("time", 0)) if isinstance(e, Mapping) else 0
    return int(t * 1e9) if isinstance(t, float) and t < 1e12 else int(t or 0)


def fr_entries(ctx: AgentContext, limit: int = 256) -> list[FrEntry]:
    """Recent collectives (p2p excluded: its sequence numbers are per peer pair) as compact tuples
    (pg id, seq, op, sizes, dtypes, time_created_ns); the pg id is made unique per group. Converted
    afresh: ``FrWindow`` keeps a window converted from pass to pass."""
    return FrWindow().read(ctx, limit)


def _fr_entry(e: Any, coords: Mapping[str, Any], uids: dict[str, str]) -> FrEntry | None:
    """One FR entry as a compact tuple; None for p2p and malformed entries."""
    if not isinstance(e, Mapping) or e.get("is_p2p"):
        return None
    pg, seq = e.get("pg"), e.get("seq")
    if pg is None or seq is None:
        return None
    uid = uids.get(pg)
    if uid is None:
        uid = uids[pg] = _group_key(str(pg), coords)
    sizes = e.get("input_sizes", e.get("sizes", ""))
    dtypes = e.get("input_dtypes", e.get("dtypes", ""))
    t_ns = _time_ns(e)
    return (
        uid,
        int(seq),
        str(e.get("op", "")),
        sizes if isinstance(sizes, str) else str(sizes),
        _flat(dtypes),
        t_ns,
    )


def _flat(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return ",".join(_flat(x) if isinstance(x, (list, tuple)) else str(x) for x in v)
    return str(v)


def group_key_of(label: str, coords: Mapping[str, Any]) -> str:
    """The pg id ``fr_entries`` gives the group of ``label`` on a rank with these (atomic) coordinates."""
    return _group_key(label, coords)


def _group_key(label: str, coords: Mapping[str, Any]) -> str:
    """A pg id equal on every member of one group and different between groups: the label (``dp``
    is the label of every dp group) plus the coordinates the group's members share. ``coords`` holds
    the atomic dims (dp_replicate, dp_shard, cp, tp, pp); a label that is a mesh dim, flattened or not
    (``dp_shard``, ``dp`` = dp_replicate x dp_shard, ``dp_shard_cp``), spans its atomic dims."""
    low = label.lower()
    spans = FLATTENED_DIMS.get(low) or ((low,) if low in ATOMIC_DIMS else None)
    if spans is None:  # a label that only contains a dim name (e.g. a user's "dp_grads")
        for dim in ("dp", "tp", "pp"):
            if dim in low:
                spans = FLATTENED_DIMS.get(dim, (dim,))
                break
    if spans is None:
        return label
    return f"{label}@" + ",".join(str(coords.get(k)) for k in ATOMIC_DIMS if k not in spans)


def pg_label(uid: str) -> str:
    """The pg label back from an id made by ``_group_key``."""
    return uid.split("@", 1)[0]


# ------------------------------------------------------------------------------------------ others
class GradSyncState(NamedTuple):
    coverage: float | None  # dp coverage of the last judged step
    tp_coverage: float | None
    judged: int  # the last step judged
    required: int  # gradient elements a step must reduce
    tp_samples: Mapping[str, Any]  # this rank's tp gradient samples, for its tp peers


def grad_sync(ctx: AgentContext) -> GradSyncState | None:
    c = ctx.find(GradSyncCollector)
    return (
        None
        if c is None
        else GradSyncState(c.coverage, c.tp_coverage, c.judged, c.required, c.published_tp())
    )


def judge_tp(ctx: AgentContext, step: int, samples: dict[int, Any]) -> None:
    """Hand the tp group's gradient samples of one step (this rank's own included) to the gradient-sync
    collector, which judges its tp coverage: the exchange carries its samples both ways (the one write)."""
    c = ctx.find(GradSyncCollector)
    if c is not None:
        c.judge_tp(step, samples)


def cpu_binding(ctx: AgentContext) -> Binding | None:
    """The rank's CPU binding against its GPU's ideal CPUs (NVML, read once at attach); None without."""
    c = ctx.find(NvmlCollector)
    return c.binding if c is not None else None


# ------------------------------------------------------------------------------------------ gpu health
class GpuHealth(NamedTuple):
    """This rank's GPU as its peers compare it when a verdict names it (``gpu_culprit``): a handful of
    numbers, carried in the exchange's ``s`` as ``packed()`` (short keys: ~0.1 KB). None: not known."""

    gpu: str  # the NVML index
    sm_mhz: float | None
    sm_max_mhz: float | None
    throttles: Mapping[str, float]  # slowing throttle reason -> unix time it became active
    temp_c: float | None
    power_w: float | None
    power_limit_w: float | None
    ecc_uncorrected: int  # volatile uncorrected ECC errors
    xid_events: int  # Xid critical errors seen since attach
    last_xid: int | None  # the last one's code

    def packed(self) -> dict[str, Any]:
        """The payload's form: None fields left out, numbers rounded (a few dozen bytes of JSON)."""
        out: dict[str, Any] = {"g": self.gpu}
        for key, v in (
            ("sm", self.sm_mhz),
            ("smx", self.sm_max_mhz),
            ("tc", self.temp_c),
            ("w", self.power_w),
            ("wl", self.power_limit_w),
        ):
            if v is not None:
                out[key] = round(float(v))
        if self.throttles:
            out["th"] = {r: round(t) for r, t in sorted(self.throttles.items())}
        if self.ecc_uncorrected:
            out["ecc"] = self.ecc_uncorrected
        if self.xid_events:
            out["xid"] = [self.xid_events, self.last_xid]
        return out


def gpu_health(ctx: AgentContext) -> GpuHealth | None:
    """This rank's GPU health from the health and NVML collectors; None without a GPU (CPU hosts, no
    NVML): nothing is published, and a verdict naming this rank says nothing of its GPU."""
    c = ctx.find(GpuHealthCollector)
    if c is None or not c.up:
        return None
    nv = ctx.find(NvmlCollector)
    v = nv.values if nv is not None else {}
    sm = (v.get("clocks") or {}).get("sm")
    top = (c.values.get("clock_max") or {}).get("sm")
    last = c.last_xid
    return GpuHealth(
        gpu=c.gpu,
        sm_mhz=sm / 1e6 if sm else None,
        sm_max_mhz=top / 1e6 if top else None,
        throttles=dict(c.throttled_since),
        temp_c=v.get("temperature"),
        power_w=v.get("power"),
        power_limit_w=c.values.get("power_limit"),
        ecc_uncorrected=int((v.get("ecc") or {}).get("uncorrected") or 0),
        xid_events=sum(c.xids.values()),
        last_xid=last[0] if last is not None else None,
    )
