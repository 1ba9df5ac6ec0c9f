"""DetectorsComponent: evaluates every detector on the agent thread and turns verdicts into alerts.

One pass: the feed reads the collectors into a snapshot (``feed``), the cross-rank exchange captures,
reads and publishes what is due (``exchange``), the snapshot is completed with what it read (in a pass
that read), every detector evaluates it, and the alert book turns the verdicts into alerts (``alerts``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import Metric

from hpar_agent import gil
from hpar_agent.alert_callbacks import Alert
from hpar_agent.component import Component
from hpar_agent.crossrank import PURPOSES, Exchange
from hpar_agent.detectors.alerts import AlertBook, AlertState
from hpar_agent.detectors.base import Detector
from hpar_agent.detectors.cluster import CollectiveMismatch, CompileDivergence, ReplicaDivergence, Straggler
from hpar_agent.detectors.exchange import CrossRankExchange, Payload
from hpar_agent.detectors.feed import DetectorFeed
from hpar_agent.detectors.gradsync import GradSyncIncomplete
from hpar_agent.detectors.host import NumaMisbinding
from hpar_agent.detectors.liveness import Hang, RankGone
from hpar_agent.detectors.local import (
    CollectiveLatencyHigh,
    CompiledGraphsGrowing,
    GraphBreaks,
    MemoryLeak,
    RecompileStorm,
)
from hpar_agent.detectors.snapshot import Snapshot
from hpar_agent.thresholds import COMPONENT_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.evidence import Evidence
    from hpar_agent.spans import StepRecord
    from hpar_agent.topology import Topology

D = TypeVar("D", bound=Detector)

ALL_DETECTORS: tuple[type[Detector], ...] = (
    RecompileStorm,
    GraphBreaks,
    CompileDivergence,
    ReplicaDivergence,
    CollectiveMismatch,
    MemoryLeak,
    CompiledGraphsGrowing,
    CollectiveLatencyHigh,
    Straggler,
    Hang,
    GradSyncIncomplete,
    NumaMisbinding,
    RankGone,
)
#: What a rank reaching the detectors' warm-up step changes in its payload (see ``_change_token``).
WARMUP_STEP = 3


def payload(snap: Snapshot, detectors: Iterable[Detector]) -> Payload:
    """This rank's payload by purpose (``crossrank``'s table): its coordinates and step in ``s``, and
    what each cross-rank detector publishes."""
    topo = snap.topology
    parts: Payload = {p: {} for p in PURPOSES}
    parts["s"] = {"c": {**snap.coords, "dp": topo.dp_rank, "stage": topo.pp_stage}, "step": snap.steps_done}
    for d in detectors:
        if d.cross_rank:
            gil.pause_point()  # each publish is up to a few ms (FR entries packed, checksums summed)
            for purpose, fields in d.publish(snap).items():
                parts[purpose].update(fields)
    return parts


class DetectorsComponent(Component):
    """Runs last in poll order, after the collectors whose state it reads. Its parameters
    (``detectors.<param>``) are ``thresholds.COMPONENT_PARAMS``."""

    name = "detectors"

    def __init__(self, exchange: Exchange | None = None, evidence: Evidence | None = None) -> None:
        super().__init__()
        self.detectors: list[Detector] = []
        self._step_detectors: tuple[ReplicaDivergence | None, Straggler | None] = (None, None)
        self._compile_divergence: CompileDivergence | None = None
        self.book = AlertBook(evidence)
        self.crossrank = CrossRankExchange(exchange)
        self.feed = DetectorFeed()
        self.snapshot: Snapshot | None = None  # the last pass's

    # ------------------------------------------------------------------------------------ lifecycle
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        th = dict(ctx.config.thresholds)
        params = {k: float(th.get(f"detectors.{k}", v)) for k, v in COMPONENT_DEFAULTS.items()}
        self.detectors = [cls(th) for cls in ALL_DETECTORS]
        self._step_detectors = (self.detector(ReplicaDivergence), self.detector(Straggler))  # looked up once
        self._compile_divergence = self.detector(CompileDivergence)
        self.book.install(ctx, params["log_interval_s"], self.record_error)
        self.crossrank.install(ctx, params["exchange_s"], params["exchange_min_s"], params["stale_s"])
        leak, mismatch = self.detector(MemoryLeak), self.detector(CollectiveMismatch)
        self.feed = DetectorFeed(
            memory_window=int(leak.p("window")) if leak is not None else 0,
            fr_limit=int(mismatch.p("max_entries")) if mismatch is not None else 0,
            on_error=self.record_error,
        )

    def on_topology(self, old: Topology, new: Topology) -> None:
        """A rank that attached before its process group existed learns its rank (and may now have
        peers to exchange with through the store)."""
        evidence = self.book.evidence
        if evidence is not None:
            evidence.rank, evidence.device = new.rank, self.require_ctx().device
        self.crossrank.on_topology(new.world_size, old.world_size)

    def uninstall(self) -> None:
        """Say goodbye to the peers, then drop the store client the agent opened itself and stop any
        allocator history recording."""
        try:
            self.crossrank.goodbye()
        except Exception as exc:
            self.record_error(exc)
        self.crossrank.close()
        if self.book.evidence is not None:
            self.book.evidence.stop_memory_history()
        super().uninstall()

    def detector(self, cls: type[D]) -> D | None:
        for d in self.detectors:
            if isinstance(d, cls):
                return d
        return None

    @property
    def states(self) -> dict[str, AlertState]:
        """Every alert's state (the alert book's)."""
        return self.book.states

    @property
    def exchange(self) -> Exchange | None:
        """The store exchange: None until the first exchange opens the store (never in a job of one rank)."""
        return self.crossrank.exchange

    @property
    def evidence(self) -> Evidence | None:
        return self.book.evidence

    # ------------------------------------------------------------------------------------ training thread
    def step_hook(self, step: int, t_ns: int) -> None:
        rep, straggler = self._step_detectors
        if rep is not None and self.ctx is not None and self.ctx.topology.world_size > 1:
            try:
                rep.step_hook(self.ctx.model, step)
            except Exception as exc:
                self.ctx.record_error(self.name, exc)
        if straggler is not None:
            straggler.step_hook(step, t_ns)

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        ctx = self.require_ctx()
        if not ctx.config.detectors:
            return
        ex = self.crossrank
        ex.begin(now)
        evidence_on = self.book.evidence is not None and ctx.config.evidence
        before = ex.view()
        snap = self.feed.snapshot(ctx, now, before, evidence_on)
        if ex.up():
            try:
                ex.run(
                    self._change_token(snap),
                    confirming=lambda: self.book.confirming(self.detectors),
                    payload=lambda: payload(snap, self.detectors),
                )
            except Exception as exc:
                ex.back_off()
                ctx.record_error(self.name, exc)
        after = ex.view()
        if after is not before or ctx.stopping != snap.stopping:  # the turn read, or the agent stops
            snap = self.feed.complete(ctx, snap, after)
        self.snapshot = snap
        for d in self.detectors:
            gil.pause_point()
            try:
                verdict = d.evaluate(snap)
            except Exception as exc:
                ctx.record_error(self.name, exc)
                continue
            if verdict is not None:
                self.book.update(d, verdict, snap)
        self._publish_slow_rank(ctx)

    def _change_token(self, snap: Snapshot) -> tuple[Any, ...]:
        """What a publish would carry that peers act on at once: a settled graph fingerprint, and this
        rank reaching the detectors' warm-up step. New flight-recorder entries do not count: they change
        at every read of a running job, and exchanging them every poll made the exchange and the
        cross-rank detectors over half of the agent thread's work."""
        cd = self._compile_divergence
        fp = cd.settled_fingerprint(snap) if cd is not None else None
        return (fp, min(snap.steps_done, WARMUP_STEP))

    def _publish_slow_rank(self, ctx: AgentContext) -> None:
        """What the Straggler detector concluded, for the step anatomy (``AgentContext.slow_rank``):
        this rank's own alert, else the peer it confirmed slowest among the ranks' exchanged lags."""
        st = self.states.get("Straggler")
        d = self._step_detectors[1]
        out = ctx.slow_rank
        out.here = st is not None and st.active
        slowest = d.slowest if d is not None and st is not None and not out.here else None
        out.peer = slowest[0] if slowest is not None else None
        if out.here:
            out.lag = float(st.value) if st is not None and st.value else None
        else:
            out.lag = float(slowest[1]) if slowest is not None else None

    def on_step(self, rec: StepRecord) -> None:
        events = self.book.take_span_events()
        if events:
            rec.events.extend(events)
            rec.anomalous = True

    def active_alerts(self) -> list[Alert]:
        """Alerts active now (any thread: reads a snapshot of the states)."""
        snap = self.snapshot
        rank = self.ctx.topology.rank if self.ctx is not None else 0
        return self.book.active_alerts(self.detectors, rank, snap.steps_done if snap is not None else 0)

    # ------------------------------------------------------------------------------------ outputs
    def collect(self) -> Iterable[Metric]:
        return self.book.collect(self.require_ctx().families)

    def summary(self) -> dict[str, Any]:
        return self.book.summary(self.detectors)
