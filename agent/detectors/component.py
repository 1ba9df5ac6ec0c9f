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
from hpar_agent.detectors.base import Detector, StepTick, detector_classes
from hpar_agent.detectors.exchange import CrossRankExchange, Payload
from hpar_agent.detectors.feed import DetectorFeed
from hpar_agent.detectors.snapshot import Snapshot
from hpar_agent.thresholds import COMPONENT_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.evidence import Evidence
    from hpar_agent.spans import StepRecord
    from hpar_agent.topology import Topology

D = TypeVar("D", bound=Detector)

#: Every detector, in the catalogue's order (``base.detector_classes``: a module of this package that
#: defines a ``Detector`` subclass named for an alert of ``catalogue.ALERTS`` is all it takes).
ALL_DETECTORS: tuple[type[Detector], ...] = detector_classes()
#: What a rank reaching the detectors' warm-up step changes in its payload (see ``_change_token``).
WARMUP_STEP = 3


def payload(snap: Snapshot, detectors: Iterable[Detector]) -> Payload:
    """This rank's payload by purpose (``crossrank``'s table): its coordinates, step and GPU health in
    ``s``, and what each cross-rank detector publishes."""
    topo = snap.topology
    parts: Payload = {p: {} for p in PURPOSES}
    parts["s"] = {"c": {**snap.coords, "dp": topo.dp_rank, "stage": topo.pp_stage}, "step": snap.steps_done}
    if snap.gpu is not None:  # what a verdict naming this rank quotes of its GPU (``gpu_culprit``)
        parts["s"]["gh"] = snap.gpu.packed()
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
        self._stepping: tuple[Detector, ...] = ()  # those with a step hook of their own
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
        self._stepping = tuple(d for d in self.detectors if type(d).step_hook is not Detector.step_hook)
        self.book.install(ctx, params["log_interval_s"], self.record_error)
        self.crossrank.install(ctx, params["exchange_s"], params["exchange_min_s"], params["stale_s"])
        needs = [d.needs() for d in self.detectors]
        self.feed = DetectorFeed(
            memory_window=max((n.memory_window for n in needs), default=0),
            fr_limit=max((n.fr_entries for n in needs), default=0),
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
        ctx = self.ctx
        if ctx is None or not self._stepping:
            return
        tick = StepTick(step, t_ns, ctx.model, ctx.topology.world_size)
        for d in self._stepping:
            try:
                d.step_hook(tick)
            except Exception as exc:
                ctx.record_error(self.name, exc)

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
        self._publish_conclusions(ctx)

    def _change_token(self, snap: Snapshot) -> tuple[Any, ...]:
        """What a publish would carry that peers act on at once (each cross-rank detector's
        ``change_token``: a settled graph fingerprint), and this rank reaching the detectors' warm-up
        step. New flight-recorder entries do not count: they change at every read of a running job, and
        exchanging them every poll made the exchange and the cross-rank detectors over half of the agent
        thread's work."""
        tokens = tuple(d.change_token(snap) for d in self.detectors if d.cross_rank)
        return (tokens, min(snap.steps_done, WARMUP_STEP))

    def _publish_conclusions(self, ctx: AgentContext) -> None:
        """Each detector's conclusion after the pass (``Detector.conclusion``), for the rest of the
        agent: ``AgentContext.conclusions`` by alert. None before the detector has given ``confirm``
        verdicts: until it could have fired, its silence is no judgement (a run shorter than its window)."""
        for d in self.detectors:
            try:
                st = self.states[d.name]
                got = d.conclusion(st.active, st.value) if st.judged >= d.confirm else None
            except Exception as exc:
                ctx.record_error(self.name, exc)
                continue
            if got is None:
                ctx.conclusions.pop(d.name, None)
            else:
                ctx.conclusions[d.name] = got

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
