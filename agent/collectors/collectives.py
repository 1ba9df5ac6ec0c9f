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
  counted twice (``pipeline_p2p`` keeps its ops between issue and wait).

State (``collective_state``): a ``RecorderState`` per flight recorder, a ``PgState`` per process group,
``OpStats`` for what the ops add up to, and the step ``Boundaries`` that place each op in its step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent import gcpause, gil
from hpar_agent.collectors.collective_state import Boundaries, OpStats, PgState, RecorderState
from hpar_agent.collectors.fr_ledger import PP_PG, Groups, Ledger, Op, Update
from hpar_agent.collectors.nccl_timing import NcclTiming
from hpar_agent.collectors.pipeline_p2p import P2PTracker
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.spans import LazySpan, SpanRecord
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat import parallel
from hpar_agent.torch_compat.fr_decode import busbw, pg_label
from hpar_agent.torch_compat.p2p import P2PRecord
from hpar_agent.traceids import trace_id_hex

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

#: Entries a flight recorder keeps when its size env var is unset (torch's default).
FR_DEFAULT_ENTRIES = 2000


class CollectiveCollector(Component):
    """Collective and p2p telemetry per process group (see the module docstring for the sources)."""

    name = "collectives"

    def __init__(self, recent: int = 2048, max_pgs: int = 16, max_pending: int = 4096) -> None:
        super().__init__()
        self.max_pgs = max_pgs
        self.max_pending = max_pending
        self.pg_timeout_s: float | None = None
        self.recent_entries: deque[dict[str, Any]] = deque(maxlen=recent)  # for the detectors
        self.stats = OpStats(recent)
        self.pgs: dict[str, PgState] = {}  # pg label -> its state
        self.recorders: list[str] = []
        self.readers: dict[str, RecorderState] = {}  # recorder -> how it was read
        self.groups = Groups(max_pgs=max_pgs)  # labels, sizes and ranks of the process groups
        self._ledger = Ledger(attach_ns=0, recent=recent, max_pending=max_pending, groups=self.groups)
        self.bounds = Boundaries()
        self.p2p = P2PTracker(self.groups, max_pending, self._p2p_error)
        self.nccl = NcclTiming()
        self.buffers = (self.p2p.buffer, self.bounds.buffer)
        self._groups_seen: set[int] = set()  # id() of process groups whose size and ranks are known
        self._poll_ns = 0
        self._attach_ns = 0
        self._ring = FR_DEFAULT_ENTRIES
        self._said_lost = False
        self._active = False

    # ------------------------------------------------------------------------------------ install
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.p2p.buffer.capacity = ctx.config.buffer_size
        self._attach_ns = self._ledger.attach_ns = time.time_ns()
        self._ring = fr.ring_entries() or FR_DEFAULT_ENTRIES
        self.recorders = fr.available_recorders()
        self.up = bool(self.recorders)
        self._seed_empty_rings()
        self._label_mesh_groups(ctx)
        self.nccl.install(ctx.config.nccl_timing and "nccl" in self.recorders)
        self._sync_groups()
        self._active = True
        self.p2p.wrapper.steps = ctx.find(StepCollector)
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
        self.p2p.wrapper.active = self._active
        self.p2p.wrapper.patch()

    def _p2p_error(self, exc: BaseException) -> None:
        self.record_error(exc)

    def pg(self, label: str) -> PgState:
        """The state of the group labelled ``label``, made on first sight."""
        st = self.pgs.get(label)
        if st is None:
            st = self.pgs[label] = PgState()
        return st

    def reader(self, rec: str) -> RecorderState:
        """How ``rec`` has been read, made on first sight."""
        st = self.readers.get(rec)
        if st is None:
            st = self.readers[rec] = RecorderState()
        return st

    @property
    def read_reasons(self) -> Counter[str]:
        """Full reads of every recorder by what called for them (the summary's)."""
        return sum((r.reasons for r in self.readers.values()), Counter())

    def _label_mesh_groups(self, agent: Any) -> None:
        """A mesh dim spanning the whole world reuses the default group (FR desc ``default_pg``): label
        that group by its dim (dp for a dp-only job; a flattened dim such as HSDP's ``dp`` when no atomic
        dim spans the world), as the other dims' ``mesh_<dim>`` groups are. Not pp: that label's in-flight view is the p2p wrapper's, and would hide a stalled world collective."""
        from hpar_agent.topology import mesh_dim_names, mesh_from_model

        mesh = getattr(agent, "mesh", None)
        if mesh is None:
            mesh = mesh_from_model(getattr(agent, "model", None))
        for i, dim in enumerate(
            mesh_dim_names(mesh, getattr(agent, "model", None))
        ):  # unnamed FSDP: dp_shard
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
        ledger, torch-free, cannot ask torch itself. And the default group's timeout, as it appears:
        a program that only sends and receives on gloo leaves no flight-recorder entry to read it from
        (gloo records no send/recv), and Hang must fire before that timeout ends the ranks."""
        groups = fr.process_groups()
        if groups and not self._groups_seen and (t := fr.group_timeout_s(None)) is not None:
            self.pg_timeout_s = t if self.pg_timeout_s is None else min(self.pg_timeout_s, t)
        for pg in groups:
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
        reader = self.reader(rec)
        since_s = ((reader.read_ns or 0) - (reader.prev_read_ns or self._attach_ns)) / 1e9
        rate = new_ids / since_s if since_s > 0 else 0.0
        size = int(math.ceil(rate * 2 * self.require_ctx().config.fr_interval / 1000) * 1000)
        log.warning(
            "hpar_agent: the %s flight recorder overwrote %d entries before they were read (a ring of %d "
            "at ~%.0f collectives a second); hpar_collective_unobserved_total counts them. A larger ring "
            "keeps them: TORCH_FR_BUFFER_SIZE=%d before init_process_group",
            rec,
            n,
            self._ring,
            rate,
            max(size, 2 * self._ring),
        )

    def timing_enabled(self) -> dict[str, bool]:
        """pg label -> whether its ops carry durations (the ``hpar_collective_timing_enabled`` series).
        Agent thread (``groups.label`` may assign a label); the scrape reads ``PgState.timing``."""
        timed_labels = {self.groups.label(*k) for k in self.nccl.timed}
        untimed = {self.groups.label(*k) for k in self.nccl.untimed}
        env = self.nccl.env or self.nccl.env_set
        hists = self.stats.hists
        out: dict[str, bool] = {}
        for pg, _op in self.stats.counts:
            out[pg] = (
                pg in timed_labels
                or (pg == PP_PG)
                or any(h.count for (hpg, _o, _s), h in hists.items() if hpg == pg)
                or (env and pg not in untimed and self.pg(pg).backend == "nccl")
            )
        return out

    def uninstall(self) -> None:
        self._active = False
        self.p2p.wrapper.restore()

    def step_hook(self, step: int, t_ns: int) -> None:
        self.bounds.buffer.put((t_ns, step))

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        self._poll_ns = int(now * 1e9)
        agent = self.require_ctx()
        if agent.config.nccl_timing and "nccl" in self.recorders:
            self.nccl.enable()
        self._sync_groups()
        self._patch_p2p()
        p2p = self.p2p.buffer.drain()
        now_ns = int(now * 1e9)
        self._read_and_process(now, now_ns, p2p)
        if self.p2p.timeout_s is not None:  # a pipeline on gloo: no FR entry says its groups' timeout
            self.pg_timeout_s = min(self.pg_timeout_s or self.p2p.timeout_s, self.p2p.timeout_s)
        oldest = self.p2p.oldest_ns()
        if oldest is not None:
            st = self.pg(PP_PG)
            st.inflight = self.p2p.in_flight()
            st.oldest_age = max(0.0, (now_ns - oldest) / 1e9)
        elif any(pg == PP_PG for pg, _ in self.stats.counts):
            st = self.pg(PP_PG)
            st.inflight, st.oldest_age = 0, 0.0
        timing = self.timing_enabled()
        for pg in timing.keys() | self.pgs.keys():
            self.pg(pg).timing = timing.get(pg)

    def _drain_boundaries(self) -> None:
        new = self.bounds.drain()
        if new:
            self._ledger.add_boundaries(new)

    def _read_and_process(self, now: float, now_ns: int, p2p: list[P2PRecord]) -> None:
        self._drain_boundaries()  # every step that ended by now: the p2p ops' steps, and the ledger's placing
        self._process_p2p(
            p2p
        )  # before the reads: it names the NCCL groups pipelining runs on (their FR entries are pp)
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
        now), or the final tick (``RecorderState.read_reason``). What the ring overwrote in between is
        counted as unobserved. Between reads a ``pg_status``-only probe (µs) keeps in-flight state fresh."""
        status = fr.dump(rec, include_collectives=False).get("pg_status") or {}
        agent = self.require_ctx()
        reader = self.reader(rec)
        slot = int(now // agent.config.fr_interval)
        reason = reader.read_reason(status, slot, agent.stopping)
        if reason is None:
            return status, None
        now_ns = int(now * 1e9)
        reader.mark_read(reason, status, slot, now_ns)
        dump = fr.dump(rec, include_collectives=True)
        return status, self._ledger.process(rec, dump, nccl_timing=self.nccl.on, now_ns=now_ns)

    def span_watermark_ns(self) -> int | None:
        """Spans come from timed FR entries (NCCL with timing: up to the last full read, less those
        still awaiting their duration) and from the p2p wrapper (each poll, less the ops in flight)."""
        marks = [self._poll_ns]
        nccl = self.readers.get("nccl")
        if self.nccl.on and nccl is not None and nccl.read_ns is not None:
            marks.append(nccl.read_ns)
        marks.extend(r.pending_min_ns for r in self.readers.values() if r.pending_min_ns is not None)
        oldest = self.p2p.oldest_ns()
        if oldest is not None:
            marks.append(oldest)
        return min(marks)

    def step_of(self, t_ns: int) -> int:
        """The step whose window (previous boundary, boundary] contains ``t_ns``."""
        return self.bounds.step_of(t_ns)

    def comm_intervals(self, step: int) -> list[tuple[int, int]]:
        """Takes the (start ns, end ns) of the step's timed collectives (NCCL: enqueue + duration; not
        pipeline p2p); complete once ``span_watermark_ns`` passed the step's end."""
        return self.stats.take_intervals(step)

    def read_through_ns(self) -> int:
        """Epoch ns up to which every collective was read: the last poll when no recorder's
        ``pg_status`` moved since its last full read, else the oldest full read (0 before the first)."""
        readers = [self.readers.get(rec) for rec in self.recorders]
        if not readers or any(r is None or r.read_ns is None for r in readers):
            return 0
        if all(r.settled for r in readers if r is not None):
            return self._poll_ns
        return min(r.read_ns or 0 for r in readers if r is not None)

    def boundaries(self) -> list[tuple[int, int]]:
        """(boundary epoch ns, step) of the recent step boundaries, oldest first."""
        return self.bounds.recent()

    def _apply(self, upd: Update) -> None:
        """What one full read yielded, into this collector's state (agent thread)."""
        rec, stats, reader = upd.rec, self.stats, self.reader(upd.rec)
        stats.counts.update(upd.counts)
        stats.bytes.update(upd.nbytes)
        stats.unobserved.update(upd.unobserved)
        if upd.unobserved and not self._said_lost:
            self._say_lost(rec, sum(upd.unobserved.values()), upd.new_ids)
        for step, by_pg in upd.reduced.items():
            stats.reduced_of(step).update(by_pg)
        for created, pg, numel in upd.unplaced:
            stats.reduced_of(self.step_of(created))[pg] += numel
        self.recent_entries.extend(upd.kept)
        for pg, seq, created in upd.opened:
            opened = self.pg(pg).open
            if len(opened) < self.max_pending:
                opened[seq] = created
        reader.pg_ids.update(upd.pg_ids)
        for pg, backend in upd.backends.items():
            st = self.pg(pg)
            st.backend = st.backend or backend
        if upd.labels:
            self.groups.labels.update(upd.labels)
        if upd.pg_timeout_s is not None:
            self.pg_timeout_s = (
                upd.pg_timeout_s if self.pg_timeout_s is None else min(self.pg_timeout_s, upd.pg_timeout_s)
            )
        if upd.p2p:
            reader.p2p = True
        reader.pending, reader.pending_min_ns = upd.pending, upd.pending_min_ns
        reader.p2p_open = upd.p2p_open
        for i, (op, seconds) in enumerate(upd.timed):
            self._finish(op, seconds)
            if i % 256 == 255:
                gil.pause_point()

    def _process_p2p(self, records: list[P2PRecord]) -> None:
        self.p2p.process(records, self.stats, "nccl" in self.recorders, self._finish)

    def _finish(self, item: Op, seconds: float) -> None:
        """A timed op: histogram (with the step's trace id as exemplar), busbw and a span starting at
        enqueue (``item.start_ns``), in the step it was enqueued in. NCCL's ``time_discovered_started_ns``
        is when the watchdog noticed, which lagged by whole steps on the H200, so it is not used."""
        start_ns = item.start_ns
        agent = self.require_ctx()
        step = self.step_of(item.start_ns)
        every = agent.config.trace_every
        exemplar = trace_id_hex(agent.topology.job_id, step) if every > 0 and step % every == 0 else None
        stats = self.stats
        stats.observe(item.pg, item.op, item.stream, item.seq, start_ns, seconds, exemplar)
        if item.pg != PP_PG:  # a pipeline's p2p waits are its bubble (hpar_pp_bubble_ratio), not exposed comm
            stats.keep_interval(step, start_ns, start_ns + int(seconds * 1e9))
        bw = busbw(item.op, item.data_bytes, seconds, item.size)
        if bw is not None:
            stats.last_busbw[(item.pg, item.op)] = bw
        if agent.tracing_on:
            agent.add_span(LazySpan(step, _op_span, (item, start_ns + int(seconds * 1e9), step, bw)))

    def _update_status(self, rec: str, status: dict[str, Any], now_ns: int) -> None:
        pg_ids = self.reader(rec).pg_ids
        for pg_id, st in status.items():
            pg = pg_ids.get(str(pg_id))
            if pg is not None:
                enq = int(st.get("last_enqueued_collective", -1))
                self.pg(pg).update(enq, int(st.get("last_completed_collective", -1)), now_ns)

    # ------------------------------------------------------------------------------------ scrape
    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        stats = self.stats
        total = f.counter("hpar_collectives_total")
        nbytes = f.counter("hpar_collective_bytes_total")
        for (pg, op), n in sorted(stats.counts.items()):
            f.add(total, [pg, op], n)
            f.add(nbytes, [pg, op], stats.bytes[(pg, op)])
        yield total
        yield nbytes
        yield f.histograms("hpar_collective_duration_seconds", stats.hists)
        bw = f.gauge("hpar_collective_busbw_bytes_per_second")
        for (pg, op), v in sorted(stats.last_busbw.items()):
            f.add(bw, [pg, op], v)
        yield bw
        pgs = sorted(self.pgs.items())
        for name, field in (
            ("hpar_collective_inflight", "inflight"),
            ("hpar_collective_oldest_inflight_age_seconds", "oldest_age"),
            ("hpar_collective_last_completed_seq", "last_completed"),
            ("hpar_collective_last_enqueued_seq", "last_enqueued"),
        ):
            g = f.gauge(name)
            for pg, st in pgs:
                v = getattr(st, field)
                if v is not None:
                    f.add(g, [pg], v)
            yield g
        un = f.counter("hpar_collective_unobserved_total")
        for pg, n in sorted(stats.unobserved.items()):
            f.add(un, [pg], n)
        yield un
        timing = f.gauge("hpar_collective_timing_enabled")
        for pg, st in pgs:
            if st.timing is not None:
                f.add(timing, [pg], 1.0 if st.timing else 0.0)
        yield timing

    def summary(self) -> dict[str, Any]:
        stats = self.stats
        table = []
        for (pg, op), n in sorted(stats.counts.items()):
            merged = [h for (hpg, hop, _stream), h in stats.hists.items() if (hpg, hop) == (pg, op)]
            hist = merged[0] if len(merged) == 1 else None
            table.append(
                {
                    "pg": pg,
                    "op": op,
                    "count": n,
                    "bytes": stats.bytes[(pg, op)],
                    "timed": sum(h.count for h in merged),
                    "p50_s": hist.quantile(0.5) if hist and hist.count else None,
                    "p99_s": hist.quantile(0.99) if hist and hist.count else None,
                    "busbw_bytes_per_s": stats.last_busbw.get((pg, op)),
                }
            )
        reasons = self.read_reasons
        return {
            "recorders": self.recorders,
            "table": table,
            "ops": {f"{pg}/{op}": n for (pg, op), n in sorted(stats.counts.items())},
            "timed": stats.timed,
            "unobserved": dict(stats.unobserved),
            "p2p_wrapped": self.p2p.wrapper.patched,
            "timing": self.timing_enabled(),
            "full_reads": sum(reasons.values()),
            "full_reads_by": dict(reasons),
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
