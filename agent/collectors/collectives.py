"""Every collective and p2p op of every process group: counts, bytes, latency, bus bandwidth, in-flight.

Sources, all read on the agent thread except two O(µs) wrappers:
- the c10d flight recorder (``torch_compat.flight_recorder``), read incrementally by record_id; a
  ``pg_status``-only probe (µs) decides whether a full dump is needed at all. Entries overwritten before
  a read are counted as unobserved (record_id gaps, attributed to groups by their seq gaps).
  NCCL entries carry ``duration_ms`` when TORCH_NCCL_ENABLE_TIMING=1; gloo entries carry no timing.
  What an entry means (op and group labels, bytes, busbw) is ``torch_compat.fr_decode``'s; this module
  decides when to read, places entries in steps, times them and exports them.
- the pipelining schedules' ``_batch_p2p``/``_wait_batch_p2p`` module functions, wrapped while
  installed (``torch_compat.p2p``): gloo's FR records no send/recv, and gloo p2p Works have no future, so the issue time and
  the observed completion (the Work was already complete when the schedule waited, else wait's return)
  give PP traffic its counts, bytes and an upper-bound latency. On NCCL the FR records p2p itself, so
  the wrapper's ops are not counted twice.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent import gcpause
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.catalogue import LATENCY_BUCKETS
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import SpanRecord
from hpar_agent.streams import comm_stream_label
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat.fr_decode import (
    OTHER,
    REDUCE_OPS,
    UNKNOWN_PG,
    busbw,
    duration_s,
    enqueued_since,
    entry_backend,
    entry_bytes,
    entry_group,
    entry_numel,
    entry_seq,
    is_epoch_ns,
    op_label,
    p2p_peer,
    pg_label,
    stuck,
)
from hpar_agent.torch_compat.fr_server import DumpServer
from hpar_agent.torch_compat.p2p import P2PWrapper
from hpar_agent.traceids import trace_id_hex

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

#: How long a completed NCCL entry may wait for its duration before it is counted untimed.
PENDING_TIMEOUT_NS = 30 * 10**9
#: Entries a flight recorder keeps when its size env var is unset (torch's default).
FR_DEFAULT_ENTRIES = 2000
#: Step boundaries kept to place FR entries in their step: covers an ``fr_interval`` of fast steps.
MAX_BOUNDARIES = 4096
PP_PG = "pp"
#: Steps whose reduced elements are kept for the gradient-sync coverage (see ``gradsync``).
MAX_REDUCE_STEPS = 256
#: Distinct entry shapes whose decoding is kept (a loop repeats a few; cleared when full).
MAX_DECODED = 4096


@dataclass(slots=True, frozen=True)
class _Decoded:
    """An FR entry's name and shapes decoded (``CollectiveCollector._decode``)."""

    pname: str
    op: str
    backend: str
    nbytes: int
    data_bytes: int  # nccl-tests' size: the larger of input and output bytes
    numel: int
    sizes: str
    dtypes: str


@dataclass(slots=True)
class _Op:
    pg: str
    op: str
    seq: int
    nbytes: int
    data_bytes: int
    start_ns: int
    stream: str
    size: int | None = None
    peer: int = -1


class CollectiveCollector(Component):
    """Collective and p2p telemetry per process group (see the module docstring for the sources)."""

    name = "collectives"

    def __init__(self, recent: int = 2048, max_pgs: int = 16, max_pending: int = 4096) -> None:
        super().__init__()
        self.p2p_buffer: BoundedBuffer[tuple[Any, ...]] = BoundedBuffer("collectives_p2p", 1 << 16)
        self.step_buffer: BoundedBuffer[tuple[int, int]] = BoundedBuffer("collectives_steps", 4096)
        self.buffers = (self.p2p_buffer, self.step_buffer)
        self.max_pgs = max_pgs
        self.max_pending = max_pending
        self.pg_timeout_s: float | None = None
        self.recent_entries: deque[dict[str, Any]] = deque(maxlen=recent)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.hists: dict[tuple[str, str, str], Histogram] = {}
        self.last_busbw: dict[tuple[str, str], float] = {}
        self.unobserved: Counter[str] = Counter()
        self.inflight: dict[str, int] = {}
        self.oldest_age: dict[str, float] = {}
        self.last_completed: dict[str, int] = {}
        self.timed = 0
        #: step -> pg -> input elements of its all_reduce/reduce_scatter entries (gradient-sync coverage)
        self.reduced_elems: dict[int, Counter[str]] = {}
        #: the last timed ops (pg, op, seq, enqueue ns, seconds): CollectiveLatencyHigh nets out arrival skew
        self.timed_ops: deque[tuple[str, str, int, int, float]] = deque(maxlen=recent)
        #: step -> (start ns, end ns) of its timed ops: the anatomy's exposed communication
        self.intervals: dict[int, list[tuple[int, int]]] = {}
        self.recorders: list[str] = []
        self._server: DumpServer | None = None  # HPAR_FR_SERVER: full dumps through torch's worker server
        self._cursor: dict[str, int] = {}  # recorder -> next record_id to read
        self._status: dict[str, Any] = {}  # recorder -> pg_status at the last full dump
        self._probe: dict[str, Any] = {}  # recorder -> pg_status at the last probe
        self._slot: dict[str, int] = {}  # recorder -> wall-clock slot of the last full dump
        self._read_ns: dict[str, int] = {}  # recorder -> epoch ns of the last full dump
        self._poll_ns = 0
        self._p2p_in_fr: dict[str, bool] = {}  # recorder -> its entries include p2p ops
        self._prev_read_ns: dict[str, int] = {}  # recorder -> epoch ns of the full dump before the last
        self._rate: dict[str, float] = {}  # recorder -> entries per second between the last two reads
        self.full_reads = 0
        self._ring = FR_DEFAULT_ENTRIES
        self._seq: dict[tuple[str, str, bool], int] = {}  # (recorder, pg, is_p2p) -> last seq
        self._pg_ids: dict[tuple[str, str], str] = {}  # (recorder, pg_id) -> pg label
        self._open: dict[str, dict[int, int]] = {}  # pg -> {seq: created ns} not yet completed
        self._labels: dict[tuple[str, str], str] = {}
        self._backend_of: dict[str, str] = {}  # pg label -> recorder its collectives came from
        self._sizes: dict[str, int | None] = {}
        self._decoded: dict[tuple[str, ...], _Decoded] = {}  # an entry's shape text -> what it means
        self._pending_fr: dict[tuple[str, int], _Op] = {}  # NCCL entries awaiting completion
        self._pending_p2p: dict[int, list[_Op]] = {}  # id(Work) -> ops awaiting a wait record
        self._bound_t: list[int] = []
        self._bound_s: list[int] = []
        self._attach_ns = 0
        self._nccl_timing = False
        self._timing_seen: set[int] = set()  # id() of groups already offered timing
        self._timed_groups: set[tuple[str, str]] = set()  # (name, desc) of NCCL groups timed by us
        self._untimed: set[tuple[str, str]] = set()  # groups that existed untimed at attach and stay so
        self._preexisting: set[tuple[str, str]] = set()
        self._env_timing = False
        self._env_set = False
        self.timing: dict[str, bool] = {}  # timing_enabled() as of the last poll (read by the scrape)
        self._pp_groups: set[tuple[str, str]] = set()  # groups pipelining p2p runs on: p2p there is "pp"
        self._open_batch: dict[tuple[str, str], list[tuple[str, int]]] = {}  # p2p since the last coalesced
        self._batches: dict[tuple[str, int], list[_Op]] = {}  # coalesced entry -> the p2p ops it completes
        self.p2p = P2PWrapper(self.p2p_buffer.put, self._p2p_error)
        self._active = False

    # ------------------------------------------------------------------------------------ install
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.p2p_buffer.capacity = ctx.config.buffer_size
        self._attach_ns = time.time_ns()
        self._nccl_timing = self._env_timing = fr.nccl_timing()  # the user's setting, before ours
        self._ring = fr.ring_entries() or FR_DEFAULT_ENTRIES
        self.recorders = fr.available_recorders()
        self.up = bool(self.recorders)
        self._label_mesh_groups(ctx)
        if ctx.config.nccl_timing and "nccl" in self.recorders:
            # ProcessGroupNCCL reads the variable when it is built: NCCL groups made after attach are
            # timed from their first op; the existing ones are switched on by _enable_timing. Set here,
            # on the attaching thread, never from the agent thread (setenv races getenv in C++ threads).
            self._preexisting = {fr.group_name(pg) for pg in fr.process_groups()}
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
            self._env_set = True
            self._enable_timing()
        self._active = True
        self._patch_p2p()
        if ctx.config.fr_server and self.recorders:
            try:
                self._server = DumpServer(self.recorders)
            except Exception as exc:  # no _WorkerServer or handler in this torch: in-process dumps
                self.record_error(exc)

    def _close_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            try:
                server.close()
            except Exception as exc:
                self.record_error(exc)

    def _full_dump(self, rec: str) -> dict[str, Any]:
        """A full read: through the worker server when it runs (a failure closes it for good), else
        in-process."""
        server = self._server
        if server is not None and rec in server.handlers:
            try:
                return server.dump(rec)
            except Exception as exc:
                self.record_error(exc)
                self._close_server()
        return fr.dump(rec, include_collectives=True)

    def _patch_p2p(self) -> None:
        """Wrap pipelining's p2p helpers once the program imported them (``torch_compat.p2p``)."""
        self.p2p.active = self._active
        self.p2p.patch()

    def _p2p_error(self, exc: BaseException) -> None:
        self.record_error(exc)

    def _label_mesh_groups(self, agent: Any) -> None:
        """A mesh dim spanning the whole world reuses the default group (FR desc ``default_pg``): label
        that group by its dim (dp for a dp-only job; a flattened dim such as HSDP's ``dp`` when no atomic
        dim spans the world), as the other dims' ``mesh_<dim>`` groups are. Not pp: that label's in-flight view is the p2p wrapper's, and would hide a stalled world collective."""
        from hpar_agent.topology import _mesh_from_model, mesh_dim_names

        mesh = getattr(agent, "mesh", None)
        if mesh is None:
            mesh = _mesh_from_model(getattr(agent, "model", None))
        for i, dim in enumerate(mesh_dim_names(mesh, getattr(agent, "model", None))):  # unnamed FSDP: dp_shard
            try:
                if mesh.size(i) < 2:
                    continue
                name, desc = fr.group_name(mesh.get_group(i))
            except Exception:
                continue
            label = pg_label("", dim)
            if label == PP_PG:
                self._pp_groups.add((name, desc))
            elif not desc.startswith("mesh_"):
                self._labels[(name, desc)] = label
        flattened = getattr(mesh, "_flatten_mapping", None) or {}  # torchtitan's dp, dp_shard_cp (private)
        for dim, sub in list(flattened.items()):
            try:
                if sub.size() < 2:
                    continue
                name, desc = fr.group_name(sub.get_group())
            except Exception:
                continue
            if not desc.startswith("mesh_"):  # an atomic dim spanning the same ranks keeps its label
                self._labels.setdefault((name, desc), pg_label("", dim))

    def _enable_timing(self) -> None:
        """Switch timing on for every NCCL group not offered it yet (agent thread, each poll: groups
        appear after attach too). One log line, with the fix, if a group cannot be timed."""
        for pg in fr.process_groups():
            if id(pg) in self._timing_seen:
                continue
            self._timing_seen.add(id(pg))
            if fr.group_backend(pg) != "nccl":
                continue
            key = fr.group_name(pg)
            try:
                ok = fr.enable_timing(pg)
            except Exception:
                ok = False
            if ok:
                self._timed_groups.add(key)
                self._nccl_timing = True
            elif self._env_timing or key not in self._preexisting:
                self._nccl_timing = True  # built with the variable set (the user's or ours): timed
            elif key not in self._untimed:
                self._untimed.add(key)
                if len(self._untimed) > 1:
                    continue  # one log line
                log.warning(
                    "hpar_agent: NCCL group %s is not timed (no latency, busbw or spans): set "
                    "TORCH_NCCL_ENABLE_TIMING=1 before init_process_group", key[1] or key[0]
                )

    def timing_enabled(self) -> dict[str, bool]:
        """pg label -> whether its ops carry durations (the ``hpar_collective_timing_enabled`` series).
        Agent thread (``_label`` may assign a label); the scrape reads ``self.timing``."""
        timed_labels = {self._label(*k) for k in self._timed_groups}
        untimed = {self._label(*k) for k in self._untimed}
        env = self._env_timing or self._env_set
        out: dict[str, bool] = {}
        for pg, _op in self.counts:
            out[pg] = pg in timed_labels or (pg == PP_PG) or any(
                h.count for (hpg, _o, _s), h in self.hists.items() if hpg == pg
            ) or (env and pg not in untimed and self._backend_of.get(pg) == "nccl")
        return out

    def uninstall(self) -> None:
        self._active = False
        self.p2p.restore()
        self._close_server()

    def step_hook(self, step: int, t_ns: int) -> None:
        self.step_buffer.put((t_ns, step))

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        self._poll_ns = int(now * 1e9)
        agent = self.require_ctx()
        if agent.config.nccl_timing and "nccl" in self.recorders:
            self._enable_timing()
        self._patch_p2p()
        p2p = self.p2p_buffer.drain()
        now_ns = int(now * 1e9)
        with gcpause.paused():  # a full read's objects die with this call's locals (see gcpause)
            self._read_and_process(now, now_ns, p2p)
        if self._pending_p2p:
            oldest = min(o.start_ns for ops in self._pending_p2p.values() for o in ops)
            self.inflight[PP_PG] = sum(len(v) for v in self._pending_p2p.values())
            self.oldest_age[PP_PG] = max(0.0, (now_ns - oldest) / 1e9)
        elif any(pg == PP_PG for pg, _ in self.counts):
            self.inflight[PP_PG] = 0
            self.oldest_age[PP_PG] = 0.0
        self.timing = self.timing_enabled()

    def _read_and_process(self, now: float, now_ns: int, p2p: list[Any]) -> None:
        dumps = [(rec, d) for rec in self.recorders if (d := self._read(rec, now)) is not None]
        for t_ns, step in self.step_buffer.drain():  # after the reads: every boundary before them
            self._bound_t.append(t_ns)
            self._bound_s.append(step)
        del self._bound_t[:-MAX_BOUNDARIES], self._bound_s[:-MAX_BOUNDARIES]
        self._process_p2p(p2p)
        for rec, data in dumps:
            self._process_dump(rec, data)
            self._update_status(rec, data.get("pg_status") or {}, now_ns)

    def _read(self, rec: str, now: float) -> dict[str, Any] | None:
        """The recorder's new entries, when they are worth a full dump.

        A full dump pickles the whole ring (about 35 ms for 2,000 entries on a loaded 2-core VM) with
        the GIL held, stalling the training thread, and a synchronous job stalls with its slowest rank.
        So the full read happens at most once per ``fr_interval`` wall-clock slot, the same instants
        on every rank (their stalls overlap instead of adding up across ranks), when something moved
        (``pg_status``, or p2p / untimed entries it cannot show); earlier only when it must: the first
        read, a group whose in-flight op has not completed since the last probe (a hang or a straggler
        in the making: its entry must be seen now), a ring half refilled since the last full read (by
        ``pg_status``, or by the entry rate for the p2p it does not count), or the final tick. Between reads a ``pg_status``-only probe (µs) keeps in-flight state fresh."""
        status = fr.dump(rec, include_collectives=False).get("pg_status") or {}
        last_probe, self._probe[rec] = self._probe.get(rec), status
        agent = self.require_ctx()
        slot = int(now // agent.config.fr_interval)
        unread = status != self._status.get(rec)
        moved = unread or self._p2p_in_fr.get(rec) or any(k[0] == rec for k in self._pending_fr)
        must = (  # pg_status does not track p2p: ``moved`` counts those entries as new
            rec not in self._cursor
            or agent.stopping
            or (moved and slot != self._slot.get(rec))
            or (unread and stuck(status, last_probe))
            or self._new_entries(rec, status, now) >= self._ring // 2
        )
        if not must:
            return {"entries": [], "pg_status": status}
        self._status[rec] = status
        self._slot[rec] = slot
        self._prev_read_ns[rec] = self._read_ns.get(rec, 0)
        self._read_ns[rec] = int(now * 1e9)
        self.full_reads += 1
        return self._full_dump(rec)

    def _new_entries(self, rec: str, status: dict[str, Any], now: float) -> float:
        """Entries the ring took since the last full read: the collectives ``pg_status`` counts, or the
        record-id rate of the last two reads (p2p included) times the time since, the larger."""
        since_s = now - self._read_ns.get(rec, 0) / 1e9
        return max(enqueued_since(status, self._status.get(rec)), self._rate.get(rec, 0.0) * since_s)

    def span_watermark_ns(self) -> int | None:
        """Spans come from timed FR entries (NCCL with timing: up to the last full read, less those
        still awaiting their duration) and from the p2p wrapper (each poll, less the ops in flight)."""
        marks = [self._poll_ns]
        if self._nccl_timing and "nccl" in self._read_ns:
            marks.append(self._read_ns["nccl"])
        marks.extend(o.start_ns for o in self._pending_fr.values())
        marks.extend(o.start_ns for ops in self._pending_p2p.values() for o in ops)
        return min(marks)

    def step_of(self, t_ns: int) -> int:
        """The step whose window (previous boundary, boundary] contains ``t_ns``."""
        i = bisect.bisect_left(self._bound_t, t_ns)
        if i < len(self._bound_s):
            return self._bound_s[i]
        return self._bound_s[-1] + 1 if self._bound_s else 0

    def _count_reduced(self, created_ns: int, pg: str, numel: int) -> None:
        step = self.step_of(created_ns)
        by_pg = self.reduced_elems.get(step)
        if by_pg is None:
            if len(self.reduced_elems) >= MAX_REDUCE_STEPS:
                del self.reduced_elems[min(self.reduced_elems)]
            by_pg = self.reduced_elems[step] = Counter()
        by_pg[pg] += numel

    def _keep_interval(self, step: int, start_ns: int, end_ns: int) -> None:
        spans = self.intervals.get(step)
        if spans is None:
            if len(self.intervals) >= MAX_REDUCE_STEPS:
                del self.intervals[min(self.intervals)]
            spans = self.intervals[step] = []
        if len(spans) < 4096:
            spans.append((start_ns, end_ns))

    def comm_intervals(self, step: int) -> list[tuple[int, int]]:
        """Takes the (start ns, end ns) of the step's timed collectives (NCCL: enqueue + duration; not
        pipeline p2p); complete once ``span_watermark_ns`` passed the step's end."""
        return self.intervals.pop(step, [])

    def read_through_ns(self) -> int:
        """Epoch ns up to which every collective was read: the last poll when no recorder's
        ``pg_status`` moved since its last full read, else the oldest full read (0 before the first)."""
        if not self.recorders or any(rec not in self._read_ns for rec in self.recorders):
            return 0
        if all(self._probe.get(rec) == self._status.get(rec) for rec in self.recorders):
            return self._poll_ns
        return min(self._read_ns[rec] for rec in self.recorders)

    def boundaries(self) -> list[tuple[int, int]]:
        """(boundary epoch ns, step) of the recent step boundaries, oldest first."""
        return list(zip(self._bound_t, self._bound_s, strict=True))

    def _label(self, name: str, desc: str) -> str:
        key = (str(name), str(desc))
        label = self._labels.get(key)
        if label is None:
            label = pg_label(*key)
            if label not in self._labels.values() and len(set(self._labels.values())) >= self.max_pgs:
                label = OTHER
            self._labels[key] = label
        return label

    def _size(self, name: str) -> int | None:
        if name not in self._sizes:
            self._sizes[name] = fr.group_size(name)
        return self._sizes[name]

    def _process_dump(self, rec: str, data: dict[str, Any]) -> None:
        entries = data.get("entries") or []
        if any(a["record_id"] > b["record_id"] for a, b in itertools.pairwise(entries)):  # FR: oldest first
            entries = sorted(entries, key=lambda e: e.get("record_id", 0))
        if self._pending_fr:
            self._complete_pending(rec, entries)
        if not entries:
            return
        first_read = rec not in self._cursor
        start = nxt = self._cursor.get(rec, entries[0]["record_id"])
        gap = 0
        seq_gaps: Counter[str] = Counter()
        first_new = bisect.bisect_left(entries, nxt, key=lambda e: e["record_id"])  # the ring's older half was read
        for e in itertools.islice(entries, first_new, None):
            rid = int(e["record_id"])
            gap += rid - nxt
            nxt = rid + 1
            name, desc = entry_group(e)
            is_p2p = bool(e.get("is_p2p", False))
            pg = PP_PG if is_p2p and (name, desc) in self._pp_groups else self._label(name, desc)
            if not is_p2p:
                self._pg_ids[(rec, str(e.get("pg_id", "")))] = pg
                self._backend_of.setdefault(pg, rec)
            if is_p2p:
                self._p2p_in_fr[rec] = True
            seq = entry_seq(e, is_p2p)
            last = self._seq.get((rec, pg, is_p2p))
            if last is not None and seq > last + 1:
                seq_gaps[pg] += seq - last - 1
            self._seq[(rec, pg, is_p2p)] = max(seq, last if last is not None else seq)
            created = int(e.get("time_created_ns") or 0)
            if e.get("timeout_ms"):  # the Hang detector must fire before the watchdog aborts
                t = float(e["timeout_ms"]) / 1e3
                self.pg_timeout_s = t if self.pg_timeout_s is None else min(self.pg_timeout_s, t)
            opened = self._open.setdefault(pg, {})
            if not is_p2p and len(opened) < self.max_pending:
                opened[seq] = created  # in-flight age counts ops from before attach too
            if first_read and is_epoch_ns(created) and created < self._attach_ns:
                continue  # before attach: baseline only (epoch clocks only; a monotonic stamp can't tell)
            self._observe_entry(rec, e, pg, name, seq, is_p2p, created)
        self._cursor[rec] = nxt
        prev_ns = self._prev_read_ns.get(rec, 0)
        if not first_read and self._read_ns.get(rec, 0) > prev_ns > 0:
            self._rate[rec] = (nxt - start) / ((self._read_ns[rec] - prev_ns) / 1e9)
        if gap:  # attribute to groups by their seq gaps, the rest to "unknown"
            for pg, n in seq_gaps.items():
                take = min(n, gap)
                self.unobserved[pg] += take
                gap -= take
            if gap:
                self.unobserved[UNKNOWN_PG] += gap

    def _decode(self, rec: str, e: dict[str, Any]) -> _Decoded:
        """What an entry's name and shapes mean, computed once per distinct (name, sizes, dtypes) text:
        a training loop repeats the same few collectives, so a read of ~1,000 entries decodes a handful
        (``benchmarks/rank_timeline.py`` reports a read's processing as ``collectives:process``)."""
        pname = str(e.get("profiling_name", ""))
        sizes, dtypes = e.get("input_sizes"), e.get("input_dtypes")
        # Text, not the dump's nested lists: a dict of atomic values is not tracked by the garbage
        # collector, while 2,048 kept entries of 7 lists each, renewed every read, pushed the
        # interpreter into a full collection (~230 ms) every ~30 s of a 4-rank CPU run.
        sizes_text = sizes if isinstance(sizes, str) else str(sizes)
        dtypes_text = dtypes if isinstance(dtypes, str) else ",".join(map(str, dtypes or ()))
        key = (rec, pname, sizes_text, dtypes_text, str(e.get("output_sizes")), str(e.get("output_dtypes")))
        dec = self._decoded.get(key)
        if dec is None:
            if len(self._decoded) >= MAX_DECODED:
                self._decoded.clear()
            nbytes = entry_bytes(sizes, dtypes)
            out_bytes = entry_bytes(e.get("output_sizes"), e.get("output_dtypes"))
            dec = self._decoded[key] = _Decoded(
                pname, op_label(pname), entry_backend(pname, rec), nbytes, max(nbytes, out_bytes),
                entry_numel(sizes), sys.intern(sizes_text), sys.intern(dtypes_text),
            )  # fmt: skip
        return dec

    def _observe_entry(
        self, rec: str, e: dict[str, Any], pg: str, name: str, seq: int, is_p2p: bool, created: int
    ) -> None:
        dec = self._decode(rec, e)
        op, nbytes = dec.op, dec.nbytes
        batch_key = (rec, str(name))
        batch = self._open_batch.pop(batch_key, None) if op == "coalesced" else None
        if not batch:  # a coalesced entry that closes a p2p batch is its ops' completion, not an op
            self.counts[(pg, op)] += 1
            self.bytes[(pg, op)] += nbytes
        if op in REDUCE_OPS and not is_p2p:
            self._count_reduced(created, pg, dec.numel)
        self.recent_entries.append(
            {
                "pg": pg,
                "seq": seq,
                "is_p2p": is_p2p,
                "op": op,
                "input_sizes": dec.sizes,
                "input_dtypes": dec.dtypes,
                "time": created / 1e9,
                "record_id": e.get("record_id"),
            }
        )
        stream = comm_stream_label(pg, dec.backend)
        item = _Op(pg, op, seq, nbytes, dec.data_bytes, created, stream)
        item.size = self._size(name)
        key = (rec, int(e["record_id"]))
        if is_p2p and (peer := p2p_peer(dec.pname)) is not None:
            item.peer = fr.global_rank(name, peer)
        if batch:  # the p2p ops of a batch_isend_irecv: timed by the coalesced entry that ends it
            ops = [self._pending_fr.pop(k) for k in batch if k in self._pending_fr]
            if (dur := duration_s(e)) is not None:
                for o in ops:
                    self._finish(o, dur)
            elif rec == "nccl" and len(self._pending_fr) < self.max_pending:
                self._batches[key] = ops
                self._pending_fr[key] = item
            return
        if (dur := duration_s(e)) is not None:
            self._finish(item, dur)
        elif (
            rec == "nccl"
            and (e.get("state") != "completed" or self._nccl_timing)
            and len(self._pending_fr) < self.max_pending
        ):  # the watchdog can mark an entry completed a poll before it retires it with its duration
            self._pending_fr[key] = item
            if is_p2p:  # inside a coalesced batch NCCL records p2p ops without events of their own
                batch_ops = self._open_batch.setdefault(batch_key, [])
                batch_ops.append(key)
                del batch_ops[: -self.max_pending]  # plain isend/irecv never close a batch: bounded

    def _complete_pending(self, rec: str, entries: list[dict[str, Any]]) -> None:
        live = {int(e["record_id"]): e for e in entries}
        for key in [k for k in self._pending_fr if k[0] == rec]:
            e = live.get(key[1])
            if e is None:  # overwritten before it completed: stays counted, untimed
                del self._pending_fr[key]
                self._batches.pop(key, None)
            elif (dur := duration_s(e)) is not None:
                item = self._pending_fr.pop(key)
                for o in self._batches.pop(key, None) or [item]:
                    self._finish(o, dur)
            elif time.time_ns() - self._pending_fr[key].start_ns > PENDING_TIMEOUT_NS and (
                e.get("is_p2p") or e.get("state") == "completed"
            ):  # completed untimed (timing off), or a p2p entry no coalesced entry ever closed
                del self._pending_fr[key]
                self._batches.pop(key, None)
            elif e.get("state") == "completed" and not self._nccl_timing:
                del self._pending_fr[key]  # completed without timing (TORCH_NCCL_ENABLE_TIMING off)
                self._batches.pop(key, None)

    def _process_p2p(self, records: list[tuple[Any, ...]]) -> None:
        for rec in records:
            if rec[0] == "issue":
                _, t0, infos, work_ids = rec
                ops = []
                for op, peer, nbytes, group in infos:
                    backend = fr.group_backend(group)
                    if backend == "nccl":
                        self._pp_groups.add(fr.group_name(group))
                    item = _Op(PP_PG, op, -1, nbytes, nbytes, t0, comm_stream_label(PP_PG, backend), 1, peer)
                    if not (backend == "nccl" and "nccl" in self.recorders):  # else the FR counts it
                        self.counts[(PP_PG, op)] += 1
                        self.bytes[(PP_PG, op)] += nbytes
                        ops.append(item)
                if not work_ids or not ops:
                    continue
                if len(work_ids) == len(ops):
                    pairs = [(w, [o]) for w, o in zip(work_ids, ops, strict=True)]
                else:  # coalesced: the last Work completes the batch
                    pairs = [(work_ids[-1], ops)]
                for wid, wops in pairs:
                    self._pending_p2p[wid] = wops
                while len(self._pending_p2p) > self.max_pending:
                    del self._pending_p2p[next(iter(self._pending_p2p))]
            else:
                _, t_enter, done, t_exit = rec
                for wid, was_done in done:
                    for item in self._pending_p2p.pop(wid, ()):
                        end = t_enter if was_done else t_exit
                        self._finish(item, max(0, end - item.start_ns) / 1e9)

    def _finish(self, item: _Op, seconds: float) -> None:
        """A timed op: histogram (with the step's trace id as exemplar), busbw and a span starting at
        enqueue (``item.start_ns``), in the step it was enqueued in. NCCL's ``time_discovered_started_ns``
        is when the watchdog noticed, which lagged by whole steps on the H200, so it is not used."""
        start_ns = item.start_ns
        agent = self.require_ctx()
        step = self.step_of(item.start_ns)
        every = agent.config.trace_every
        exemplar = trace_id_hex(agent.topology.job_id, step) if every > 0 and step % every == 0 else None
        hist = self.hists.setdefault((item.pg, item.op, item.stream), Histogram(LATENCY_BUCKETS))
        hist.observe(seconds, exemplar, (start_ns + seconds * 1e9) / 1e9)
        self.timed_ops.append((item.pg, item.op, item.seq, start_ns, seconds))
        self.timed += 1
        if item.pg != PP_PG:  # a pipeline's p2p waits are its bubble (hpar_pp_bubble_ratio), not exposed comm
            self._keep_interval(step, start_ns, start_ns + int(seconds * 1e9))
        bw = busbw(item.op, item.data_bytes, seconds, item.size)
        if bw is not None:
            self.last_busbw[(item.pg, item.op)] = bw
        if not agent.tracing_on:
            return
        attrs: dict[str, Any] = {
            cat.ATTR_PG: item.pg,
            cat.ATTR_OP: item.op,
            cat.ATTR_SEQ: item.seq,
            cat.ATTR_BYTES: item.nbytes,
            cat.ATTR_STREAM: item.stream,
        }
        if item.peer >= 0:
            attrs[cat.ATTR_PEER] = item.peer
        if bw is not None:
            attrs[cat.ATTR_BUSBW] = bw
        end_ns = start_ns + int(seconds * 1e9)
        agent.add_span(SpanRecord(cat.SPAN_COLLECTIVE_PREFIX + item.op, start_ns, end_ns, step, attrs))

    def _update_status(self, rec: str, status: dict[str, Any], now_ns: int) -> None:
        for pg_id, st in status.items():
            pg = self._pg_ids.get((rec, str(pg_id)))
            if pg is None:
                continue
            enq = int(st.get("last_enqueued_collective", -1))
            done = int(st.get("last_completed_collective", -1))
            self.inflight[pg] = max(0, enq - done)
            if done >= 0:
                self.last_completed[pg] = done
            opened = self._open.get(pg, {})
            for seq in [s for s in opened if s <= done]:
                del opened[seq]
            live = [t for s, t in opened.items() if s <= enq]
            self.oldest_age[pg] = max(0.0, (now_ns - min(live)) / 1e9) if live and enq > done else 0.0

    # ------------------------------------------------------------------------------------ scrape
    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        total = f.counter("hpar_collectives_total")
        nbytes = f.counter("hpar_collective_bytes_total")
        for (pg, op), n in sorted(self.counts.items()):
            f.add(total, [pg, op], n)
            f.add(nbytes, [pg, op], self.bytes[(pg, op)])
        yield total
        yield nbytes
        yield f.histograms("hpar_collective_duration_seconds", self.hists)
        bw = f.gauge("hpar_collective_busbw_bytes_per_second")
        for (pg, op), v in sorted(self.last_busbw.items()):
            f.add(bw, [pg, op], v)
        yield bw
        for name, values in (
            ("hpar_collective_inflight", self.inflight),
            ("hpar_collective_oldest_inflight_age_seconds", self.oldest_age),
            ("hpar_collective_last_completed_seq", self.last_completed),
        ):
            g = f.gauge(name)
            for pg, v in sorted(values.items()):
                f.add(g, [pg], v)
            yield g
        un = f.counter("hpar_collective_unobserved_total")
        for pg, n in sorted(self.unobserved.items()):
            f.add(un, [pg], n)
        yield un
        timing = f.gauge("hpar_collective_timing_enabled")
        for pg, on in sorted(self.timing.items()):
            f.add(timing, [pg], 1.0 if on else 0.0)
        yield timing

    def summary(self) -> dict[str, Any]:
        table = []
        for (pg, op), n in sorted(self.counts.items()):
            merged = [h for (hpg, hop, _stream), h in self.hists.items() if (hpg, hop) == (pg, op)]
            hist = merged[0] if len(merged) == 1 else None
            table.append({
                "pg": pg, "op": op, "count": n, "bytes": self.bytes[(pg, op)],
                "timed": sum(h.count for h in merged),
                "p50_s": hist.quantile(0.5) if hist and hist.count else None,
                "p99_s": hist.quantile(0.99) if hist and hist.count else None,
                "busbw_bytes_per_s": self.last_busbw.get((pg, op)),
            })  # fmt: skip
        return {
            "recorders": self.recorders,
            "table": table,
            "ops": {f"{pg}/{op}": n for (pg, op), n in sorted(self.counts.items())},
            "timed": self.timed,
            "unobserved": dict(self.unobserved),
            "p2p_wrapped": self.p2p.patched,
            "timing": self.timing_enabled(),
        }
