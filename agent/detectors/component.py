"""DetectorsComponent: evaluates every detector on the agent thread and turns verdicts into alerts.

One state machine for all alerts: ``confirm`` consecutive active verdicts fire, ``clear`` inactive ones
resolve. Firing increments ``hpar_alerts_total``, collects evidence, writes a JSONL ``alert`` event
naming the evidence, logs one rate-limited line and puts an event on the next completed step's span
(marking it anomalous so its trace is kept). ``hpar_alert_active`` is exported for every catalogued
alert from the first scrape, so rules see 0 rather than absence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent.component import Component
from hpar_agent.crossrank import Exchange, open_store
from hpar_agent.detectors.base import Detector
from hpar_agent.detectors.cluster import CollectiveMismatch, CompileDivergence, ReplicaDivergence, Straggler
from hpar_agent.detectors.local import CollectiveLatencyHigh, GraphBreaks, Hang, MemoryLeak, RecompileStorm
from hpar_agent.detectors.sources import step_state
from hpar_agent.evidence import Evidence
from hpar_agent.spans import StepRecord

log = logging.getLogger("hpar_agent")
D = TypeVar("D", bound=Detector)

ALL_DETECTORS: tuple[type[Detector], ...] = (
    RecompileStorm, GraphBreaks, CompileDivergence, ReplicaDivergence, CollectiveMismatch, MemoryLeak,
    CollectiveLatencyHigh, Straggler, Hang,
)  # fmt: skip


@dataclass
class AlertState:
    active: bool = False
    value: float = 0.0
    fired: int = 0
    streak: int = 0  # consecutive verdicts disagreeing with ``active``
    last_fired_step: int | None = None
    last_log: float = -1e18
    logged: bool = False
    evidence: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


class DetectorsComponent(Component):
    """Runs last in poll order, after the collectors whose state it reads.

    Defaults of the component itself (``AgentConfig.thresholds``): ``detectors.exchange_s`` = 3 (seconds
    between store exchanges), ``detectors.log_interval_s`` = 60 (one log line per alert per interval),
    ``detectors.stale_s`` = 30 (peer payloads older than this are ignored).
    """

    name = "detectors"

    def __init__(self, exchange: Exchange | None = None, evidence: Evidence | None = None) -> None:
        super().__init__()
        self.detectors: list[Detector] = []
        self._step_detectors: tuple[ReplicaDivergence | None, Straggler | None] = (None, None)
        self.states: dict[str, AlertState] = {a: AlertState() for a in cat.ALERT_NAMES}
        self.exchange = exchange
        self.evidence = evidence
        self.now = 0.0
        self.rank = 0
        self.stage = 0
        self.steps_done = 0
        self.last_step_ts = 0.0
        self.step_durations: list[float] = []
        self.peers: dict[int, dict[str, Any]] = {}
        self.peers_fresh = False
        self._last_exchange = -1e18
        self._span_events: list[tuple[str, int, dict[str, Any]]] = []
        self._store_tried = exchange is not None
        self.exchange_s = 3.0
        self.log_interval_s = 60.0
        self.stale_s = 30.0

    # ------------------------------------------------------------------------------------ lifecycle
    def install(self, agent: Any) -> None:
        super().install(agent)
        th = dict(agent.config.thresholds)
        self.exchange_s = float(th.get("detectors.exchange_s", 3.0))
        self.log_interval_s = float(th.get("detectors.log_interval_s", 60.0))
        self.stale_s = float(th.get("detectors.stale_s", 30.0))
        self.detectors = [cls(th) for cls in ALL_DETECTORS]
        self._step_detectors = (self.detector(ReplicaDivergence), self.detector(Straggler))  # looked up once
        self.rank = agent.topology.rank
        self.stage = agent.topology.pp_stage
        if self.evidence is None:
            self.evidence = Evidence(agent.run_dir, self.rank, enabled=agent.config.evidence,
                                     on_error=lambda exc: agent.record_error("evidence", exc))

    def detector(self, cls: type[D]) -> D | None:
        for d in self.detectors:
            if isinstance(d, cls):
                return d
        return None

    # ------------------------------------------------------------------------------------ training thread
    def step_hook(self, step: int, t_ns: int) -> None:
        rep, straggler = self._step_detectors
        if rep is not None and self.agent is not None and self.agent.topology.world_size > 1:
            try:
                rep.step_hook(self.agent.model, step)
            except Exception as exc:
                self.agent.record_error(self.name, exc)
        if straggler is not None:
            straggler.step_hook(step, t_ns)

    # ------------------------------------------------------------------------------------ agent thread
    def _exchange(self) -> None:
        agent = self.agent
        assert agent is not None
        self.peers_fresh = False
        if self.now - self._last_exchange < self.exchange_s:
            return
        self._last_exchange = self.now
        if self.exchange is None and not self._store_tried:
            self._store_tried = True
            if agent.topology.world_size > 1:
                store = open_store()
                if store is not None:
                    self.exchange = Exchange(store, agent.topology.job_id, self.rank)
        if self.exchange is None:
            return
        topo = agent.topology
        payload: dict[str, Any] = {
            "c": {"dp": topo.dp_rank, "tp": topo.tp_rank, "pp": topo.pp_rank, "stage": topo.pp_stage},
            "step": self.steps_done,
        }
        for d in self.detectors:
            if d.cross_rank:
                payload.update(d.publish(self))
        self.exchange.publish(payload)
        self.peers = self.exchange.read(self._peer_ranks(), max_age_s=self.stale_s)
        self.peers_fresh = True

    def _peer_ranks(self) -> list[int]:
        """Ranks sharing this rank's pp coordinate when the mesh says which (the only ones any
        detector compares with); otherwise every rank."""
        agent = self.agent
        assert agent is not None
        mesh = agent.mesh
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if "pp" in names:
            try:
                grid = mesh.mesh  # type: ignore[union-attr]
                return [int(r) for r in grid.select(names.index("pp"), agent.topology.pp_rank).flatten().tolist()]
            except Exception:
                pass
        return list(range(agent.topology.world_size))

    def poll(self, now: float) -> None:
        agent = self.agent
        assert agent is not None
        if not agent.config.detectors:
            return
        self.now = now
        self.steps_done, self.last_step_ts, self.step_durations = step_state(agent)
        try:
            self._exchange()
        except Exception as exc:
            agent.record_error(self.name, exc)
        for d in self.detectors:
            try:
                verdict = d.evaluate(self)
            except Exception as exc:
                agent.record_error(self.name, exc)
                continue
            if verdict is not None:
                self._update(d, verdict.active, verdict.value, verdict.details)

    def _update(self, d: Detector, active: bool, value: float, details: dict[str, Any]) -> None:
        st = self.states[d.name]
        st.value = value
        if active == st.active:
            st.streak = 0
            if active:
                st.details = details
            return
        st.streak += 1
        if st.streak < (d.confirm if active else d.clear):
            return
        st.streak = 0
        st.active = active
        st.details = details
        if active:
            st.fired += 1
            st.last_fired_step = self.steps_done
            self._fire(d, st)
        else:
            self._resolve(d, st)

    def _fire(self, d: Detector, st: AlertState) -> None:
        agent = self.agent
        assert agent is not None
        paths: list[str] = []
        if d.evidence and agent.config.evidence and self.evidence is not None:
            try:
                paths = self.evidence.collect(f"{d.name}-{st.fired}", d.evidence)
            except Exception as exc:
                agent.record_error(self.name, exc)
        st.evidence = paths
        self._announce(d, st, "firing", logging.WARNING)

    def _resolve(self, d: Detector, st: AlertState) -> None:
        self._announce(d, st, "resolved", logging.INFO)

    def _announce(self, d: Detector, st: AlertState, state: str, level: int) -> None:
        agent = self.agent
        assert agent is not None
        agent.events.emit(
            "alert",
            alert=d.name,
            state=state,
            rank=self.rank,
            pp_stage=self.stage,
            step=self.steps_done,
            value=st.value,
            threshold=d.threshold,
            evidence=st.evidence if state == "firing" else [],
            details=st.details,
        )
        attrs = {cat.ATTR_ALERT: d.name, "state": state, "value": st.value}
        self._span_events.append((cat.EVENT_ALERT, time.time_ns(), attrs))
        del self._span_events[:-64]
        if state == "firing":  # rate limit: a resolution is logged only if its firing was
            st.logged = self.now - st.last_log >= self.log_interval_s
            if st.logged:
                st.last_log = self.now
        if st.logged:
            log.log(
                level,
                "hpar_agent: alert %s %s on rank %d stage %d (value %.4g, threshold %.4g)%s",
                d.name, state, self.rank, self.stage, st.value, d.threshold,
                f"; evidence: {', '.join(st.evidence)}" if state == "firing" and st.evidence else "",
            )  # fmt: skip

    def on_step(self, rec: StepRecord) -> None:
        if self._span_events:
            rec.events.extend(self._span_events)
            rec.anomalous = True
            self._span_events = []

    # ------------------------------------------------------------------------------------ outputs
    def collect(self) -> Iterable[Metric]:
        f = self.agent.families  # type: ignore[union-attr]
        active = f.gauge("hpar_alert_active")
        total = f.counter("hpar_alerts_total")
        value = f.gauge("hpar_detector_value")
        for name in cat.ALERT_NAMES:
            st = self.states[name]
            f.add(active, [name], 1.0 if st.active else 0.0)
            f.add(total, [name], st.fired)
            f.add(value, [name], st.value)
        return [active, total, value]

    def summary(self) -> dict:
        out = {}
        for d in self.detectors:
            st = self.states[d.name]
            out[d.name] = {
                "active": st.active,
                "value": st.value,
                "threshold": d.threshold,
                "params": d.params,
                "fired": st.fired,
                "last_fired_step": st.last_fired_step,
                "evidence": st.evidence,
            }
        return out
