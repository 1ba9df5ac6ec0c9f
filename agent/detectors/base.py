"""Detector base: a named signal whose parameters are declared once, overridable per job.

A detector's parameters are ``thresholds.DETECTOR_PARAMS[<its alert>]`` (name, default, meaning);
overrides come from ``AgentConfig.thresholds["<Alert>.<param>"]``. A detector only computes, from the
pass's ``Snapshot``: the DetectorsComponent owns the alert state machine (confirm/clear counts,
metrics, events, evidence).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from hpar_agent.thresholds import DETECTOR_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot


@dataclass
class Verdict:
    """One evaluation on this rank: ``active`` means this rank is the offender. ``memory_history``:
    start (True) or stop (False) recording the CUDA allocator's history for the evidence; None leaves it.
    ``threshold``: the limit ``value`` was compared with, where the detector derived it (Hang: from the
    process group's timeout and the step time); None: the detector's ``threshold`` parameter."""

    active: bool
    value: float
    details: dict[str, Any] = field(default_factory=dict)
    memory_history: bool | None = None
    threshold: float | None = None


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
    #: The details key of the py-spy stack taken when the alert fires: what the rank was doing then.
    stack_detail: ClassVar[str] = "stack"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            cls.defaults = DETECTOR_DEFAULTS[cls.name]

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
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

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        """Agent thread. None when there is no data yet (the alert state is left as it is)."""
        raise NotImplementedError

    def fired_details(
        self, evidence: Any, snap: Snapshot, value: float, details: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Agent thread, once the alert fired and its evidence is collected: details read from the
        evidence (``evidence.Evidence`` or None), kept while the alert stays active."""
        return {}

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        """Cross-rank detectors: this rank's part of the payload put in the store, by purpose (see
        ``crossrank``: ``s``, ``fr``, ``gs``, ``ck``), from the snapshot taken at the pass's start."""
        return {}
