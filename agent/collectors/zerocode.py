"""The ``zerocode`` component: how a zero-code run (``hpar-agent run``) attached, and whether the
script gave any step boundary (one line at exit, once per host, and a note in each rank's summary)."""

from __future__ import annotations

import logging
from typing import Any

from hpar_agent.collectors.oom import OomCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component

log = logging.getLogger("hpar_agent")

NO_STEPS = (
    "hpar_agent: no step boundaries seen (no torch.optim optimizer stepped and agent.step() was never "
    "called), so step metrics and traces are empty; call hpar_agent.current().step() once per "
    "iteration, or step a torch.optim optimizer"
)


class ZeroCode(Component):
    """Records how the agent came to be attached and whether any step boundary arrived."""

    name = "zerocode"

    def __init__(self, trigger: str) -> None:
        super().__init__()
        self.trigger = trigger
        self._noted = False

    def _steps(self) -> int:
        steps = self.ctx.find(StepCollector) if self.ctx is not None else None
        return steps.count if steps is not None else 0

    def _stepless(self) -> bool:
        """No step boundary, and not because the loop ran out of memory before its first step."""
        oom = self.ctx.find(OomCollector) if self.ctx is not None else None
        return self._steps() == 0 and (oom is None or oom.record is None)

    def uninstall(self) -> None:
        """At detach (before the summary is written): the one line when no step was seen, from the
        first rank of each host (every rank's summary carries it)."""
        local_rank = self.ctx.topology.local_rank if self.ctx is not None else 0
        if self._stepless() and not self._noted and local_rank == 0:
            self._noted = True
            log.warning(NO_STEPS)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attached_at": self.trigger, "step_boundaries": self._steps()}
        if self._stepless():
            out["note"] = NO_STEPS
        return out
