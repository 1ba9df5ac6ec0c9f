"""Detector base: a named signal whose parameters are declared once, overridable per job.

A detector's parameters are ``thresholds.DETECTOR_PARAMS[<its alert>]`` (name, default, meaning);
overrides come from ``AgentConfig.thresholds["<Alert>.<param>"]``. A detector only computes; the
DetectorsComponent owns the alert state machine (confirm/clear counts, metrics, events, evidence).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hpar_agent.thresholds import DETECTOR_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.evidence import Evidence


@dataclass
class Verdict:
    """One evaluation on this rank: ``active`` means this rank is the offender."""

    active: bool
    value: float
    details: dict[str, Any] = field(default_factory=dict)


class Evaluation(Protocol):
    """What a detector reads while it evaluates: the DetectorsComponent's state for this pass (it
    implements this; detectors never import it, so the two modules do not import each other)."""

    @property
    def context(self) -> AgentContext: ...
    @property
    def now(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def stage(self) -> int: ...
    @property
    def steps_done(self) -> int: ...
    @property
    def last_step_ts(self) -> float: ...
    @property
    def step_durations(self) -> list[float]: ...
    @property
    def peers(self) -> dict[int, dict[str, Any]]: ...
    @property
    def peers_fresh(self) -> bool: ...
    @property
    def peer_groups(self) -> Mapping[str, tuple[int, ...]]: ...
    @property
    def seen(self) -> Mapping[int, Mapping[str, Any]]: ...
    @property
    def read_ok_at(self) -> float: ...
    @property
    def exchange_interval_s(self) -> float: ...
    def fetch(self, purpose: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]: ...
    @property
    def evidence(self) -> Evidence | None: ...
    @property
    def compile_last_ts(self) -> float: ...
    @property
    def compile_last_step(self) -> int: ...
    @property
    def compile_quiet_s(self) -> float: ...
    @property
    def compile_busy_steps(self) -> int: ...
    def warmed_up(self, quiet_steps: int, max_busy_steps: int) -> bool: ...


class Detector:
    """Subclasses set ``name`` (an alert of the catalogue, whose parameters ``thresholds`` declares) and
    ``threshold_param`` (the one ``hpar_alert_*`` reports as the threshold)."""

    name: ClassVar[str] = ""
    defaults: ClassVar[Mapping[str, float]] = {}  # DETECTOR_DEFAULTS[name], set for each subclass
    threshold_param: ClassVar[str] = ""
    evidence: ClassVar[tuple[str, ...]] = ()  # kinds: pyspy, allocator, fr
    cross_rank: ClassVar[bool] = False
    confirm: ClassVar[int] = 1  # consecutive active evaluations before firing
    clear: ClassVar[int] = 1  # consecutive inactive evaluations before resolving

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            cls.defaults = DETECTOR_DEFAULTS[cls.name]

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        self.params = dict(self.defaults)
        for key, value in (thresholds or {}).items():
            alert, _, param = key.partition(".")
            if alert == self.name and param:
                self.params[param] = float(value)

    def p(self, param: str) -> float:
        return self.params[param]

    @property
    def threshold(self) -> float:
        return self.params.get(self.threshold_param, math.nan)

    def evaluate(self, ctx: Evaluation) -> Verdict | None:
        """Agent thread. None when there is no data yet (the alert state is left as it is)."""
        raise NotImplementedError

    def publish(self, ctx: Evaluation) -> dict[str, dict[str, Any]]:
        """Cross-rank detectors: this rank's part of the payload put in the store, by purpose (see
        ``crossrank``: ``s``, ``fr``, ``gs``, ``ck``)."""
        return {}
