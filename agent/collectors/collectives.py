"""Every collective and p2p op of every process group: counts, bytes, latency, bus bandwidth, in-flight.

Sources, all read on the agent thread except two O(µs) wrappers:
- the c10d flight recorder (``torch_compat.flight_recorder``), read on the agent thread incrementally
  by record_id, at most once per ``fr_interval``; a ``pg_status``-only probe (µs) decides whether a
  full dump is needed at all. The ``fr_ledger.Ledger`` turns entries into an ``Update`` (counts,
  bytes, gaps counted as unobserved, timed ops, kept entries); this module decides when to read,
  applies the updates, places ops in steps, times them and exports them. NCCL entries carry
  ``duration_ms`` when TORCH_NCCL_ENABLE_TIMING=1; gloo entries carry no timing.
- the pipelining schedules' ``_batch_p2p``/``_wait_batch_p2p`` module functions, wrapped while
  installed (``torch_compat.p2p``): gloo's FR records no send/recv, and gloo p2p Works have no future, so the issue time and
  the observed completion (the Work was already complete when the schedule waited, else wait's return)
  give PP traffic its counts, bytes and an upper-bound latency (on a fast loop, of the steps with
  detail: ``StepCollector.stride``). On NCCL the FR records p2p itself, so the wrapper's ops are not
  counted twice.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent import gcpause, gil
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.catalogue import LATENCY_BUCKETS
from hpar_agent.collectors.fr_ledger import MAX_BOUNDARIES, PP_PG, Groups, Ledger, Op, Update
from hpar_agent.collectors.nccl_timing import NcclTiming
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import LazySpan, SpanRecord
from hpar_agent.streams import comm_stream_label
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat import parallel
from hpar_agent.torch_compat.fr_decode import busbw, pg_label, stuck
from hpar_agent.torch_compat.p2p import P2PWrapper, ops_of, waits_of
from hpar_agent.traceids import trace_id_hex

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

#: Entries a flight recorder keeps when its size env var is unset (torch's default).
FR_DEFAULT_ENTRIES = 2000
#: Steps whose reduced elements are kept for the gradient-sync coverage (see ``gradsync``).
MAX_REDUCE_STEPS = 256


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
        self.last_enqueued: dict[str, int] = {}
        self.timed = 0
        #: step -> pg -> input elements of its all_reduce/reduce_scatter entries (gradient-sync coverage)
        self.reduced_elems: dict[int, Counter[str]] = {}
        #: the last timed ops (pg, op, seq, enqueue ns, seconds): CollectiveLatencyHigh nets out arrival skew
        self.timed_ops: deque[tuple[str, str, int, int, float]] = deque(maxlen=recent)
        #: step -> (start ns, end ns) of its timed ops: the anatomy's exposed communication
        self.intervals: dict[int, list[tuple[int, int]]] = {}
        self.recorders: list[str] = []
        self.groups = Groups(max_pgs=max_pgs)  # labels, sizes and ranks of the process groups
        self._ledger = Ledger(attach_ns=0, recent=recent, max_pending=max_pending, groups=self.groups)
        self._pending: dict[str, tuple[int, int | None]] = {}  # recorder -> (entries awaiting a duration, oldest ns)
        self._groups_seen: set[int] = set()  # id() of process groups whose size and ranks are known
        self._status: dict[str, Any] = {}  # recorder -> pg_status at the last full dump
        self._probe: dict[str, Any] = {}  # recorder -> pg_status at the last probe
        self._slot: dict[str, int] = {}  # recorder -> ``fr_interval`` slot of the last full dump
        self._read_ns: dict[str, int] = {}  # recorder -> epoch ns of the last full dump
        self._poll_ns = 0
        self._p2p_in_fr: dict[str, bool] = {}  # recorder -> its entries include p2p ops
        self._prev_read_ns: dict[str, int] = {}  # recorder -> epoch ns of the full dump before the last
        self._said_lost = False
        self.full_reads = 0
        self.read_reasons: Counter[str] = Counter()  # full reads by what called for them (the summary's)
        self._ring = FR_DEFAULT_ENTRIES
        self._pg_ids: dict[tuple[str, str], str] = {}  # (recorder, pg_id) -> pg label
        self._open: dict[str, dict[int, int]] = {}  # pg -> {seq: created ns} not yet completed
        self._backend_of: dict[str, str] = {}  # pg label -> recorder its collectives came from
        self._pending_p2p: dict[int, list[Op]] = {}  # id(Work) -> ops awaiting a wait record
        self._p2p_untimed: set[int] = set()  # id(Work) of pending ops issued in a step without detail
        self._p2p_groups: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, backend)
        self._bound_t: list[int] = []
        self._bound_s: list[int] = []
        self._attach_ns = 0
        self.nccl = NcclTiming()
        self.timing: dict[str, bool] = {}  # timing_enabled() as of the last poll (read by the scrape)
        self.p2p = P2PWrapper(self.p2p_buffer.put, self._p2p_error)
        self._active = False

    # ------------------------------------------------------------------------------------ install
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.p2p_buffer.capacity = ctx.config.buffer_size
        self._attach_ns = self._ledger.attach_ns = time.time_ns()
        self._ring = fr.ring_entries() or FR_DEFAULT_ENTRIES
        self.recorders = fr.available_recorders()
        self.up = bool(self.recorders)
        self._seed_empty_rings()
        self._label_mesh_groups(ctx)
        self.nccl.install(ctx.config.nccl_timing and "nccl" in self.recorders)
        self._sync_groups()
        self._active = True
        self.p2p.steps = ctx.find(StepCollector)
        self._patch_p2p()

    def _seed_empty_rings(self) -> None:
        """Attached before the first collective (before ``init_process_group``, or at it, as users and
        the zero-code launch attach): the rings are empty and their record ids start at 0, so the
        first full read starts there and counts what a ring overwrote before it as unobserved (a fast
        first second on a small ring), instead of taking its oldest entry as the start. A ring is
        dumped only when ``pg_status`` shows no collective yet: an empty ring's dump is free, a full
        one's holds the GIL."""
        fresh = {}
        for rec in self.recorders:
            try:
                status = fr.dump(rec, include_collectives=False).get("pg_status") or {}
                ran = any(int(st.get("last_enqueued_collective", -1)) > 0 for st in status.values())
                empty = not ran and not fr.dump(rec, include_collectives=True).get("entries")
            except Exception:
                continue
            if empty:
                fresh[rec] = 0
        self._ledger.start_at(fresh)

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
        from hpar_agent.topology import mesh_dim_names, mesh_from_model

        mesh = getattr(agent, "mesh", None)
        if mesh is None:
            mesh = mesh_from_model(getattr(agent, "model", None))
        for i, dim in enumerate(mesh_dim_names(mesh, getattr(agent, "model", None))):  # unnamed FSDP: dp_shard
            try:
                if mesh.size(i) < 2:
                    continue
                name, desc = fr.group_name(mesh.get_group(i))
            except Exception:
                continue
            label = pg_label("", dim)
            if label == PP_PG:
                self.groups.pp.add((name, desc))
            elif not desc.startswith("mesh_"):
                self.groups.labels[(name, desc)] = label
        for dim, sub in parallel.flattened_meshes(mesh).items():  # torchtitan's dp, dp_shard_cp
            try:
                if sub.size() < 2:
                    continue
                name, desc = fr.group_name(sub.get_group())
            except Exception:
                continue
            if not desc.startswith("mesh_"):  # an atomic dim spanning the same ranks keeps its label
                self.groups.labels.setdefault((name, desc), pg_label("", dim))

    def _sync_groups(self) -> None:
        """Size and global ranks of every process group not seen yet (busbw, p2p peers): what the
        ledger, torch-free, cannot ask torch itself."""
        for pg in fr.process_groups():
            if id(pg) in self._groups_seen:
                continue
            self._groups_seen.add(id(pg))
            name, _desc = fr.group_name(pg)
            size, ranks = fr.group_size(name), fr.group_ranks(pg)
            if size is not None:
                self.groups.sizes[name] = size
            if ranks:
                self.groups.ranks[name] = ranks

    def _say_lost(self, rec: str, n: int, new_ids: int) -> None:
        """Once: a ring that turns over faster than the agent reads it (every ``fr_interval``) loses
        entries; a ring that holds twice the entries of one interval keeps them."""
        self._said_lost = True
        since_s = (self._read_ns[rec] - (self._prev_read_ns.get(rec) or self._attach_ns)) / 1e9
        rate = new_ids / since_s if since_s > 0 else 0.0
        size = int(math.ceil(rate * 2 * self.require_ctx().config.fr_interval / 1000) * 1000)
        log.warning(
            "hpar_agent: the %s flight recorder overwrote %d entries before they were read (a ring of %d "
            "at ~%.0f collectives a second); hpar_collective_unobserved_total counts them. A larger ring "
            "keeps them: TORCH_FR_BUFFER_SIZE=%d before init_process_group",
            rec, n, self._ring, rate, max(size, 2 * self._ring),
        )  # fmt: skip

    def timing_enabled(self) -> dict[str, bool]:
        """pg label -> whether its ops carry durations (the ``hpar_collective_timing_enabled`` series).
        Agent thread (``groups.label`` may assign a label); the scrape reads ``self.timing``."""
        timed_labels = {self.groups.label(*k) for k in self.nccl.timed}
        untimed = {self.groups.label(*k) for k in self.nccl.untimed}
        env = self.nccl.env or self.nccl.env_set
        out: dict[str, bool] = {}
        for pg, _op in self.counts:
            out[pg] = pg in timed_labels or (pg == PP_PG) or any(
                h.count for (hpg, _o, _s), h in self.hists.items() if hpg == pg
            ) or (env and pg not in untimed and self._backend_of.get(pg) == "nccl")
        return out

    def uninstall(self) -> None:
        self._active = False
        self.p2p.restore()

    def step_hook(self, step: int, t_ns: int) -> None:
        self.step_buffer.put((t_ns, step))

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        self._poll_ns = int(now * 1e9)
        agent = self.require_ctx()
        if agent.config.nccl_timing and "nccl" in self.recorders:
            self.nccl.enable()
        self._sync_groups()
        self._patch_p2p()
        p2p = self.p2p_buffer.drain()
        now_ns = int(now * 1e9)
        self._read_and_process(now, now_ns, p2p)
        if self._pending_p2p:
            oldest = min(o.start_ns for ops in self._pending_p2p.values() for o in ops)
            self.inflight[PP_PG] = sum(len(v) for v in self._pending_p2p.values())
            self.oldest_age[PP_PG] = max(0.0, (now_ns - oldest) / 1e9)
        elif any(pg == PP_PG for pg, _ in self.counts):
            self.inflight[PP_PG] = 0
            self.oldest_age[PP_PG] = 0.0
        self.timing = self.timing_enabled()

    def _drain_boundaries(self) -> None:
        new = self.step_buffer.drain()
        if not new:
            return
        for t_ns, step in new:
            self._bound_t.append(t_ns)
            self._bound_s.append(step)
        del self._bound_t[:-MAX_BOUNDARIES], self._bound_s[:-MAX_BOUNDARIES]
        self._ledger.add_boundaries(new)

    def _read_and_process(self, now: float, now_ns: int, p2p: list[Any]) -> None:
        self._drain_boundaries()  # every step that ended by now: the p2p ops' steps, and the ledger's placing
        self._process_p2p(p2p)  # before the reads: it names the NCCL groups pipelining runs on (their FR entries are pp)
        for rec in self.recorders:
            with gcpause.paused():  # a full read's objects die inside the block (see gcpause)
                status, upd = self._read(rec, now)
                self._drain_boundaries()  # every boundary before the read, for what the ledger could not place
                if upd is not None:
                    gil.pause_point()  # the dump and its decoding were one hold; applying it is another
                    self._apply(upd)
                    status = upd.status or status
                self._update_status(rec, status, now_ns)
                del upd
            gil.pause_point()

    def _read(self, rec: str, now: float) -> tuple[dict[str, Any], Update | None]:
        """The recorder's ``pg_status`` and, when they are worth a full read, its new entries.

        A full read dumps the whole ring with the GIL held (tens of ms for 2,000 entries), and a
        synchronous job stalls with its slowest rank. So it happens at most once per ``fr_interval``
        wall-clock slot, the same instants on every rank (their stalls overlap instead of adding up
        across ranks), when something moved (``pg_status``, or p2p / untimed entries it cannot show);
        earlier only when it must: the first read (one, even of a ring that holds nothing yet: a CUDA
        build has a gloo and an NCCL recorder, and a job uses one), a group whose in-flight op has not
        completed since the last probe (a hang or a straggler in the making: its entry must be seen
        now), or the final tick. What the ring overwrote in between is counted as unobserved. Between
        reads a ``pg_status``-only probe (µs) keeps in-flight state fresh."""
        status = fr.dump(rec, include_collectives=False).get("pg_status") or {}
        last_probe, self._probe[rec] = self._probe.get(rec), status
        agent = self.require_ctx()
        slot = int(now // agent.config.fr_interval)
        unread = status != self._status.get(rec)
        moved = unread or self._p2p_in_fr.get(rec) or self._pending.get(rec, (0, None))[0] > 0
        # pg_status does not track p2p: ``moved`` counts those entries as new
        reason = (
            "first" if rec not in self._read_ns
            else "final" if agent.stopping
            else "slot" if moved and slot != self._slot.get(rec)
            else "in flight" if unread and stuck(status, last_probe)
            else None
        )  # fmt: skip
        if reason is None:
            return status, None
        self.read_reasons[reason] += 1
        self.full_reads += 1
        self._status[rec] = status
        self._slot[rec] = slot
        self._prev_read_ns[rec] = self._read_ns.get(rec, 0)
        self._read_ns[rec] = now_ns = int(now * 1e9)
        dump = fr.dump(rec, include_collectives=True)
        return status, self._ledger.process(rec, dump, nccl_timing=self.nccl.on, now_ns=now_ns)

    def span_watermark_ns(self) -> int | None:
        """Spans come from timed FR entries (NCCL with timing: up to the last full read, less those
        still awaiting their duration) and from the p2p wrapper (each poll, less the ops in flight)."""
        marks = [self._poll_ns]
        if self.nccl.on and "nccl" in self._read_ns:
            marks.append(self._read_ns["nccl"])
        marks.extend(oldest for _n, oldest in self._pending.values() if oldest is not None)
        marks.extend(o.start_ns for ops in self._pending_p2p.values() for o in ops)
        return min(marks)

    def step_of(self, t_ns: int) -> int:
        """The step whose window (previous boundary, boundary] contains ``t_ns``."""
        i = bisect.bisect_left(self._bound_t, t_ns)
        if i < len(self._bound_s):
            return self._bound_s[i]
        return self._bound_s[-1] + 1 if self._bound_s else 0

    def _reduced_of(self, step: int) -> Counter[str]:
        """pg -> input elements of the step's all_reduce/reduce_scatter entries (bounded in steps)."""
        by_pg = self.reduced_elems.get(step)
        if by_pg is None:
            if len(self.reduced_elems) >= MAX_REDUCE_STEPS:
                del self.reduced_elems[min(self.reduced_elems)]
            by_pg = self.reduced_elems[step] = Counter()
        return by_pg

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

    def _apply(self, upd: Update) -> None:
        """What one full read yielded, into this collector's state (agent thread)."""
        rec = upd.rec
        self.counts.update(upd.counts)
        self.bytes.update(upd.nbytes)
        self.unobserved.update(upd.unobserved)
        if upd.unobserved and not self._said_lost:
            self._say_lost(rec, sum(upd.unobserved.values()), upd.new_ids)
        for step, by_pg in upd.reduced.items():
            self._reduced_of(step).update(by_pg)
        for created, pg, numel in upd.unplaced:
            self._reduced_of(self.step_of(created))[pg] += numel
        self.recent_entries.extend(upd.kept)
        for pg, seq, created in upd.opened:
            opened = self._open.setdefault(pg, {})
            if len(opened) < self.max_pending:
                opened[seq] = created
        for pg_id, pg in upd.pg_ids.items():
            self._pg_ids[(rec, pg_id)] = pg
        for pg, backend in upd.backends.items():
            self._backend_of.setdefault(pg, backend)
        if upd.labels:
            self.groups.labels.update(upd.labels)
        if upd.pg_timeout_s is not None:
            self.pg_timeout_s = upd.pg_timeout_s if self.pg_timeout_s is None else min(self.pg_timeout_s, upd.pg_timeout_s)
        if upd.p2p:
            self._p2p_in_fr[rec] = True
        self._pending[rec] = (upd.pending, upd.pending_min_ns)
        for i, (op, seconds) in enumerate(upd.timed):
            self._finish(op, seconds)
            if i % 256 == 255:
                gil.pause_point()

    def _process_p2p(self, records: list[tuple[Any, ...]]) -> None:
        for i, rec in enumerate(records):
            if i % 128 == 127:
                gil.pause_point()
            if rec[0] == "issue":
                _, t0, infos, work_ids, timed = rec
                ops = []
                for op, peer, nbytes, group in ops_of(infos):
                    backend = self._p2p_backend(group)
                    item = Op(PP_PG, op, -1, nbytes, nbytes, t0, comm_stream_label(PP_PG, backend), 1, peer)
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
                untimed = self._p2p_untimed
                for wid, wops in pairs:
                    self._pending_p2p[wid] = wops
                    if timed:
                        untimed.discard(wid)  # an id a freed Work had
                    else:
                        untimed.add(wid)
                while len(self._pending_p2p) > self.max_pending:
                    untimed.discard(wid := next(iter(self._pending_p2p)))
                    del self._pending_p2p[wid]
            else:
                _, t_enter, done, t_exit = rec
                for wid, was_done in waits_of(done):
                    ops = self._pending_p2p.pop(wid, [])
                    if wid in self._p2p_untimed:  # counted at issue; in flight until now
                        self._p2p_untimed.discard(wid)
                        continue
                    for item in ops:
                        end = t_enter if was_done else t_exit
                        self._finish(item, max(0, end - item.start_ns) / 1e9)

    def _p2p_backend(self, group: Any) -> str:
        """The backend of a pipeline p2p op's group, asked of torch once per group (an NCCL one is
        registered as pipelining's: its FR entries are pp)."""
        hit = self._p2p_groups.get(id(group))
        if hit is None or hit[0] is not group:  # the group object is held: its id is not reused
            if len(self._p2p_groups) >= 64:
                self._p2p_groups.clear()
            backend = fr.group_backend(group)
            if backend == "nccl":
                self.groups.pp.add(fr.group_name(group))
            hit = self._p2p_groups[id(group)] = (group, backend)
        return hit[1]

    def _finish(self, item: Op, seconds: float) -> None:
        """A timed op: histogram (with the step's trace id as exemplar), busbw and a span starting at
        enqueue (``item.start_ns``), in the step it was enqueued in. NCCL's ``time_discovered_started_ns``
        is when the watchdog noticed, which lagged by whole steps on the H200, so it is not used."""
        start_ns = item.start_ns
        agent = self.require_ctx()
        step = self.step_of(item.start_ns)
        every = agent.config.trace_every
        exemplar = trace_id_hex(agent.topology.job_id, step) if every > 0 and step % every == 0 else None
        key = (item.pg, item.op, item.stream)
        hist = self.hists.get(key)
        if hist is None:  # not setdefault: that builds a histogram for every op
            hist = self.hists[key] = Histogram(LATENCY_BUCKETS)
        hist.observe(seconds, exemplar, (start_ns + seconds * 1e9) / 1e9)
        self.timed_ops.append((item.pg, item.op, item.seq, start_ns, seconds))
        self.timed += 1
        if item.pg != PP_PG:  # a pipeline's p2p waits are its bubble (hpar_pp_bubble_ratio), not exposed comm
            self._keep_interval(step, start_ns, start_ns + int(seconds * 1e9))
        bw = busbw(item.op, item.data_bytes, seconds, item.size)
        if bw is not None:
            self.last_busbw[(item.pg, item.op)] = bw
        if agent.tracing_on:
            agent.add_span(LazySpan(step, _op_span, (item, start_ns + int(seconds * 1e9), step, bw)))

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
            if enq >= 0:
                self.last_enqueued[pg] = enq
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
            ("hpar_collective_last_enqueued_seq", self.last_enqueued),
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
            "full_reads": self.full_reads,
            "full_reads_by": dict(self.read_reasons),
        }

def _op_span(args: tuple[Op, int, int, float | None]) -> SpanRecord:
    """The span of a timed op (``LazySpan``: made only when its step's trace is kept)."""
    item, end_ns, step, bw = args
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
    return SpanRecord(cat.SPAN_COLLECTIVE_PREFIX + item.op, item.start_ns, end_ns, step, attrs)
