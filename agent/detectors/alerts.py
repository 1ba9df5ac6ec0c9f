"""The alert book: every alert's state and what a transition does.

One state machine for all alerts: ``confirm`` consecutive active verdicts fire, ``clear`` inactive ones
resolve. Firing increments ``hpar_alerts_total``, collects evidence, writes a JSONL ``alert`` event
naming the evidence, logs one rate-limited line, hands the alert to the user's callbacks and puts an
event on the next completed step's span (marking it anomalous so its trace is kept); a firing alert that
names other culprits writes an ``updated`` event. A verdict of a detector whose culprits may be a GPU's
doing (``Detector.gpu_culprits``) gets their GPU health against their peers' (``gpu_culprit``). ``hpar_alert_active`` is exported for every catalogued
alert from the first scrape, so rules see 0 rather than absence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent.alert_callbacks import Alert
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.detectors.gpu_culprit import culprit_gpu, culprit_gpu_text
from hpar_agent.evidence import Evidence, main_stack
from hpar_agent.thresholds import COMPONENT_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.detectors.base import Detector, Verdict
    from hpar_agent.detectors.snapshot import Snapshot
    from hpar_agent.families import Families

log = logging.getLogger("hpar_agent")

#: Culprits of one alert exported as ``hpar_alert_culprit`` series (the event lists them all).
MAX_CULPRIT_SERIES = 16
#: (event name, epoch ns, attributes) of a span event
SpanEvent = tuple[str, int, dict[str, Any]]


@dataclass
class AlertState:
    active: bool = False
    value: float = 0.0
    fired: int = 0
    judged: int = 0  # verdicts given (a detector that had nothing to judge gives none)
    streak: int = 0  # consecutive verdicts disagreeing with ``active``
    last_fired_step: int | None = None
    last_log: float = -1e18
    logged: bool = False
    evidence: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    threshold: float | None = None  # the limit the last verdict was compared with (None: the parameter's)
    kept: dict[str, Any] = field(default_factory=dict)  # details read from the evidence at firing


class AlertBook:
    """The states of every catalogued alert, updated by the detectors' verdicts on the agent thread
    (``update``) and read by the scrape thread (``collect``) and any thread (``active_alerts``)."""

    def __init__(self, evidence: Evidence | None = None) -> None:
        self.states: dict[str, AlertState] = {a: AlertState() for a in cat.ALERT_NAMES}
        self.evidence = evidence
        self.ctx: AgentContext | None = None
        self.log_interval_s = COMPONENT_DEFAULTS["log_interval_s"]
        self.on_error: Callable[[BaseException], None] = lambda exc: None
        self._span_events: list[SpanEvent] = []

    def install(
        self, ctx: AgentContext, log_interval_s: float, on_error: Callable[[BaseException], None]
    ) -> None:
        self.ctx = ctx
        self.log_interval_s = log_interval_s
        self.on_error = on_error
        if self.evidence is None:
            self.evidence = ctx.evidence

    def _steps_now(self) -> int:
        """The training thread's step count now (``StepCollector.count``)."""
        steps = self.ctx.find(StepCollector) if self.ctx is not None else None
        return steps.count if steps is not None else 0

    def update(self, d: Detector, verdict: Verdict, snap: Snapshot) -> None:
        """Apply one verdict of ``d``: its request about the allocator's history, then the state machine."""
        if verdict.memory_history is not None and self.evidence is not None:
            if verdict.memory_history:
                self.evidence.start_memory_history(steps_now=self._steps_now)
            else:
                self.evidence.stop_memory_history()
        if verdict.active and d.gpu_culprits and culprits(verdict.details):
            try:
                gpu = culprit_gpu(culprits(verdict.details), snap.exchange)
                if gpu:
                    verdict.details = {**verdict.details, "culprit_gpu": gpu}
            except Exception as exc:
                self.on_error(exc)
        st = self.states[d.name]
        st.judged += 1
        st.value = verdict.value
        st.threshold = verdict.threshold
        if verdict.active == st.active:
            st.streak = 0
            if verdict.active:
                details = verdict.details
                named = culprits(details) != culprits(st.details) and bool(culprits(details))
                st.details = {**details, **st.kept}
                if named:
                    self._announce(d, st, "updated", logging.INFO, snap)
            return
        st.streak += 1
        if st.streak < (d.confirm if verdict.active else d.clear):
            return
        st.streak = 0
        st.active = verdict.active
        st.details = verdict.details
        if verdict.active:
            st.fired += 1
            st.last_fired_step = snap.steps_done
            self._fire(d, st, snap)
        else:
            self._announce(d, st, "resolved", logging.INFO, snap)

    def confirming(self, detectors: Iterable[Detector]) -> bool:
        """A cross-rank alert awaits its confirmation (its next verdict comes at the next exchange)."""
        return any(
            d.cross_rank and self.states[d.name].streak > 0 and not self.states[d.name].active
            for d in detectors
        )

    def take_span_events(self) -> list[SpanEvent]:
        """The transitions since the last call, for the next completed step's span."""
        out = self._span_events
        if out:
            self._span_events = []
        return out

    def _fire(self, d: Detector, st: AlertState, snap: Snapshot) -> None:
        ctx = self._ctx()
        paths: list[str] = []
        if d.evidence and ctx.config.evidence and self.evidence is not None:
            try:
                paths = self.evidence.collect(f"{d.name}-{st.fired}", d.evidence)
            except Exception as exc:
                self.on_error(exc)
        st.evidence = paths
        st.kept = {}
        try:  # before the stack: a page that cuts long details keeps the site
            st.kept.update(d.fired_details(self.evidence, snap, st.value, st.details))
        except Exception as exc:
            self.on_error(exc)
        stack = next((main_stack(p) for p in paths if p.endswith(".pyspy.json")), [])
        if stack:
            st.kept[d.stack_detail] = stack  # what this rank was doing (the culprit of a hang: why)
        st.details.update(st.kept)
        self._announce(d, st, "firing", logging.WARNING, snap)

    def _announce(self, d: Detector, st: AlertState, state: str, level: int, snap: Snapshot) -> None:
        ctx = self._ctx()
        ctx.events.emit(
            "alert",
            alert=d.name,
            state=state,
            rank=snap.rank,
            pp_stage=snap.stage,
            step=snap.steps_done,
            value=st.value,
            threshold=limit(d, st),
            evidence=st.evidence if state == "firing" else [],
            details=st.details,
        )
        named = culprits(st.details)
        if state == "updated":
            log.info(
                "hpar_agent: alert %s on rank %d: culprit rank(s) %s%s",
                d.name,
                snap.rank,
                _ranks_text(named),
                culprit_gpu_text(st.details),
            )
            return
        ctx.dispatch_alert(self.alert(d, st, state, snap.rank, snap.steps_done))
        attrs = {cat.ATTR_ALERT: d.name, "state": state, "value": st.value}
        self._span_events.append((cat.EVENT_ALERT, time.time_ns(), attrs))
        del self._span_events[:-64]
        if state == "firing":  # rate limit: a resolution is logged only if its firing was
            st.logged = snap.now - st.last_log >= self.log_interval_s
            if st.logged:
                st.last_log = snap.now
        if st.logged:
            log.log(
                level,
                "hpar_agent: alert %s %s on rank %d stage %d (value %.4g, threshold %.4g)%s%s%s%s",
                d.name,
                state,
                snap.rank,
                snap.stage,
                st.value,
                limit(d, st),
                f"; culprit rank(s) {_ranks_text(named)}" if state == "firing" and named else "",
                culprit_gpu_text(st.details) if state == "firing" else "",
                _site_text(st.details) if state == "firing" else "",
                f"; evidence: {', '.join(st.evidence)}" if state == "firing" and st.evidence else "",
            )

    @staticmethod
    def alert(d: Detector, st: AlertState, state: str, rank: int, step: int) -> Alert:
        return Alert(
            name=d.name,
            state=state,
            value=st.value,
            threshold=limit(d, st),
            step=step,
            rank=rank,
            details=dict(st.details),
            evidence=tuple(st.evidence) if state == "firing" else (),
        )

    def active_alerts(self, detectors: Iterable[Detector], rank: int, step: int) -> list[Alert]:
        """Alerts active now (any thread: reads a snapshot of the states)."""
        return [
            self.alert(d, self.states[d.name], "firing", rank, step)
            for d in list(detectors)
            if self.states[d.name].active
        ]

    # ------------------------------------------------------------------------------------ outputs
    def collect(self, f: Families) -> list[Metric]:
        active = f.gauge("hpar_alert_active")
        total = f.counter("hpar_alerts_total")
        value = f.gauge("hpar_detector_value")
        culprit = f.gauge("hpar_alert_culprit")
        for name in cat.ALERT_NAMES:
            st = self.states[name]
            f.add(active, [name], 1.0 if st.active else 0.0)
            f.add(total, [name], st.fired)
            f.add(value, [name], st.value)
            if st.active:
                for r in culprits(st.details)[:MAX_CULPRIT_SERIES]:
                    f.add(culprit, [name, str(r)], 1.0)
        return [active, total, value, culprit]

    def summary(self, detectors: Iterable[Detector]) -> dict[str, Any]:
        out = {}
        for d in detectors:
            st = self.states[d.name]
            out[d.name] = {
                "active": st.active,
                "value": st.value,
                "threshold": limit(d, st),
                "params": d.params,
                "fired": st.fired,
                "judged": st.judged,
                "last_fired_step": st.last_fired_step,
                "evidence": st.evidence,
            }
        return out

    def _ctx(self) -> AgentContext:
        if self.ctx is None:
            raise RuntimeError("the alert book is not installed")
        return self.ctx


def limit(d: Detector, st: AlertState) -> float:
    """The threshold an alert's value was compared with: its verdict's own, else the parameter's. Every
    line, event and callback prints this one, so a value is never shown against a limit it was not
    judged by."""
    return d.threshold if st.threshold is None else st.threshold


def culprits(details: Mapping[str, Any]) -> list[int]:
    """The ranks a verdict names as the cause (``details.culprits``), [] when it names none."""
    got = details.get("culprits")
    return [int(r) for r in got if isinstance(r, int)] if isinstance(got, list) else []


def _site_text(details: Mapping[str, Any]) -> str:
    """The allocating site an alert names (MemoryLeak), or why it names none."""
    site = details.get("site")
    if not site:
        return ""
    if site == "unknown":
        return f"; site unknown: {details.get('site_unknown', '')}"
    growth = details.get("site_growth_bytes_per_step") or 0
    return f"; site {site} ({growth / (1 << 20):.1f} MiB a step)"


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (f" and {len(ranks) - 32} more" if len(ranks) > 32 else "")
