"""Detector base: a named signal whose parameters are declared once, overridable per job, and
everything the detectors component asks of a detector.

A detector's parameters are ``thresholds.DETECTOR_PARAMS[<its alert>]`` (name, default, meaning);
overrides come from ``AgentConfig.thresholds["<Alert>.<param>"]``. A detector only computes, from the
pass's ``Snapshot``: the DetectorsComponent owns the alert state machine (confirm/clear counts,
metrics, events, evidence), and calls every detector through the hooks below alike, naming none:
``step_hook`` (training thread, each step), ``needs`` (what the feed must read for it), ``publish``
and ``change_token`` (its part of the cross-rank payload), ``evaluate`` (each pass) and
``conclusion`` (what the rest of the agent may read of its judgement). A subclass with a ``name``
registers itself; ``detector_classes`` lists them in the catalogue's order of their alerts.
"""

from __future__ import annotations

import importlib
import math
import os
import pkgutil
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from hpar_agent.context import Conclusion
from hpar_agent.thresholds import DETECTOR_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot


class StepTick(NamedTuple):
    """A step boundary, as every detector's ``step_hook`` gets it (training thread)."""

    step: int  # steps completed
    t_ns: int  # the boundary's time, as the step collector took it
    model: Any  # the user's model (None when not known)
    world_size: int


class FeedNeeds(NamedTuple):
    """What a detector needs the feed (``feed.DetectorFeed``) to read for it each pass; the feed reads
    the most any detector needs."""

    memory_window: int = 0  # post-step memory samples per source
    fr_entries: int = 0  # recent flight-recorder entries


_REGISTRY: dict[str, type[Detector]] = {}


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
    #: Its culprits may be a GPU's doing (slow, hung or gone): the alert book adds their GPU health
    #: against their peers' to its details (``gpu_culprit``).
    gpu_culprits: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            cls.defaults = DETECTOR_DEFAULTS[cls.name]
            _REGISTRY.setdefault(cls.name, cls)  # the first class of a name (a test's subclass is not it)

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

    def step_hook(self, tick: StepTick) -> None:
        """Training thread, at every step boundary: O(µs), never synchronizes the GPU; an exception is
        counted, never raised. Called only on detectors that override it."""

    def needs(self) -> FeedNeeds:
        """What the feed must read for this detector each pass (none by default)."""
        return FeedNeeds()

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        """Cross-rank detectors: this rank's part of the payload put in the store, by purpose (see
        ``crossrank``: ``s``, ``fr``, ``gs``, ``ck``), from the snapshot taken at the pass's start."""
        return {}

    def change_token(self, snap: Snapshot) -> Hashable:
        """Cross-rank detectors: what of this rank's payload the peers act on at once; when it changes
        the exchange publishes before its next slot (None: nothing of the kind)."""
        return None

    def conclusion(self, active: bool, value: float) -> Conclusion | None:
        """What the rest of the agent may read of this detector's judgement after each pass, given its
        alert's state (active, value) (``AgentContext.conclusions[name]``: the step anatomy's slow-rank
        verdict reads Straggler's). None: it publishes nothing. Asked only once the detector has given
        ``confirm`` verdicts: before that, the rest of the agent reads its judgement as not known."""
        return None


def detector_classes() -> tuple[type[Detector], ...]:
    """Every detector, in the catalogue's order of the in-process alerts (``catalogue.ALERTS``): the
    modules of this package are imported and each ``Detector`` subclass with a ``name`` has registered
    itself. An alert without a detector, or a detector without an alert, is an error."""
    from hpar_agent import catalogue

    package = __name__.rpartition(".")[0]  # this package, by name: importing it is the component's
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        importlib.import_module(f"{package}.{info.name}")
    alerts = catalogue.ALERT_NAMES
    stray = sorted(set(_REGISTRY) - set(alerts))
    missing = [a for a in alerts if a not in _REGISTRY]
    if stray or missing:
        raise RuntimeError(f"detectors without an alert: {stray}; alerts without a detector: {missing}")
    return tuple(_REGISTRY[a] for a in alerts)
