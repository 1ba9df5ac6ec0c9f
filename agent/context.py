"""AgentContext: the part of the agent a component may use, so components depend on it, not on ``Agent``.

It holds what is fixed at attach (config, the model the user gave), the topology and device (replaced
when ``redetect`` finds them changed) and the agent's services (metric families, event log, span sink,
error recording, step fan-out, alert dispatch, re-detection). Other components are looked up by
class (``ctx.find(StepCollector)``), so a lookup is typed and a renamed class fails at import rather
than reading as "no such component". This module imports no component.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hpar_agent.alert_callbacks import Alert
from hpar_agent.config import AgentConfig
from hpar_agent.events import EventLog
from hpar_agent.evidence import Evidence
from hpar_agent.families import Families
from hpar_agent.spans import Child
from hpar_agent.topology import Topology

T = TypeVar("T")


class SpanSink(Protocol):
    """Where components hand child spans (the agent queues them until their step's trace is exported)."""

    @property
    def tracing_on(self) -> bool: ...

    def add_span(self, span: Child) -> None: ...


class _NoSpans:
    tracing_on = False

    def add_span(self, span: Child) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Conclusion:
    """What a detector concluded, for the rest of the agent (``AgentContext.conclusions``, by alert).
    The detectors component writes it after every pass and a collector reads it (the step anatomy
    reads Straggler's), so a collector never reaches into a detector."""

    here: bool = False  # this rank's own alert is active: it is the offender
    peer: int | None = None  # else the peer the detector names; None: no offender
    value: float | None = None  # the offender's value (Straggler: its arrival lag ratio)


def _never() -> bool:
    return False


def _no_wait(seconds: float) -> None:
    return None


def _no_redetect(*, wait: bool = True, in_pass: bool = False) -> bool:
    return False


def _ignore_step(step: int, t_ns: int) -> None:
    return None


def _ignore_alert(alert: Alert) -> None:
    return None


@dataclass(eq=False)
class AgentContext:
    """Built by the agent at attach, after the topology, families and event log are known."""

    config: AgentConfig
    topology: Topology = field(default_factory=Topology)
    families: Families = field(default_factory=lambda: Families(["0", "0"]))
    events: EventLog = field(default_factory=lambda: EventLog(None, 0))
    record_error: Callable[[str, BaseException], None] = lambda component, exc: None
    spans: SpanSink = field(default_factory=_NoSpans)
    #: training thread: fan a step boundary out to the components' step hooks (StepCollector calls it)
    on_step_boundary: Callable[[int, int], None] = _ignore_step
    #: True from the agent's ``stop()`` on (the final poll reads every source in full)
    is_stopping: Callable[[], bool] = _never
    #: agent thread, in a pass: wait up to the seconds given, the GIL released; at once on the final pass
    #: (detach, flush) and as soon as the agent stops (without an agent: never waits)
    wait: Callable[[float], None] = _no_wait
    #: an alert transition for the user's ``on_alert`` callbacks
    dispatch_alert: Callable[[Alert], None] = _ignore_alert
    #: detect the topology again and apply what changed (True when something did): keyword ``wait``
    #: for a pass in progress (else give up at once), ``in_pass`` from a component's poll
    redetect: Callable[..., bool] = _no_redetect
    device: Any = None  # torch.device of this rank (see hpar_agent.device)
    model: Any = None
    optimizer: Any = None
    mesh: Any = None
    run_dir: str = ""
    #: the agent's component list (shared: a component added later is found too)
    components: Sequence[object] = ()
    #: each detector's conclusion by alert (``Detector.conclusion``): the step anatomy reads Straggler's
    conclusions: dict[str, Conclusion] = field(default_factory=dict)
    #: how the process is ending, set on the way out: "exception: <Type>: <message>" (uncaught in the main
    #: thread), "signal: SIGTERM", else "" (a clean exit or detach)
    exit_reason: str = ""
    _evidence: Evidence | None = field(default=None, repr=False)

    def judged(self, alert: str) -> bool:
        """Whether a cross-rank detector's judgement is known: it has published a conclusion (after
        ``confirm`` verdicts), or the job is one rank, with nobody to compare."""
        return alert in self.conclusions or self.topology.world_size <= 1

    @property
    def evidence(self) -> Evidence:
        """The rank's one evidence writer (alerts and out-of-memory records share its limits and its
        allocator-history state), built on first use and kept on the rank's current device and rank."""
        if self._evidence is None:
            self._evidence = Evidence(
                self.run_dir,
                self.topology.rank,
                enabled=self.config.evidence,
                on_error=lambda exc: self.record_error("evidence", exc),
            )
        self._evidence.device, self._evidence.rank = self.device, self.topology.rank
        return self._evidence

    def find(self, cls: type[T]) -> T | None:
        """The installed component of class ``cls`` (or a subclass), None when there is none."""
        for comp in self.components:
            if isinstance(comp, cls):
                return comp
        return None

    @property
    def tracing_on(self) -> bool:
        """Whether spans go anywhere: components build no ``SpanRecord`` otherwise."""
        return self.spans.tracing_on

    def add_span(self, span: Child) -> None:
        self.spans.add_span(span)

    @property
    def stopping(self) -> bool:
        return self.is_stopping()
