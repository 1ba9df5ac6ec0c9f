"""Detector base: a named signal with documented defaults, overridable per job.

Overrides come from ``AgentConfig.thresholds["<Alert>.<param>"]``. A detector only computes; the
DetectorsComponent owns the alert state machine (confirm/clear counts, metrics, events, evidence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from hpar_agent.detectors.component import DetectorsComponent


@dataclass
class Verdict:
    """One evaluation on this rank: ``active`` means this rank is the offender."""

    active: bool
    value: float
    details: dict[str, Any] = field(default_factory=dict)


class Detector:
    """Subclasses set ``name`` (an alert of the catalogue), ``defaults`` and ``threshold_param``."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, float]] = {}
    threshold_param: ClassVar[str] = ""
    evidence: ClassVar[tuple[str, ...]] = ()  # kinds: pyspy, allocator, fr
    cross_rank: ClassVar[bool] = False
    confirm: ClassVar[int] = 1  # consecutive active evaluations before firing
    clear: ClassVar[int] = 1  # consecutive inactive evaluations before resolving

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

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        """Agent thread. None when there is no data yet (the alert state is left as it is)."""
        raise NotImplementedError

    def publish(self, ctx: DetectorsComponent) -> dict[str, Any]:
        """Cross-rank detectors: this rank's part of the payload put in the store."""
        return {}
