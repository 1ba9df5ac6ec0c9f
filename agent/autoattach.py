"""Zero-code mode, inside the observed process: what the ``hpar-agent run`` shim calls.

The shim (``zerocode_site/sitecustomize.py``) decides *when* (after ``init_process_group`` in a
torchrun worker, after ``import torch`` in a plain script); this module attaches the agent with the
``HPAR_*`` environment as its configuration and adds the ``zerocode`` component, which says in one
line at exit (once per host) and in each rank's summary when the script gave no step boundaries.
"""

from __future__ import annotations

import logging
from typing import Any

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
        from hpar_agent.collectors.steps import StepCollector

        steps = self.ctx.find(StepCollector) if self.ctx is not None else None
        return steps.count if steps is not None else 0

    def uninstall(self) -> None:
        """At detach (before the summary is written): the one line when no step was seen, from the
        first rank of each host (every rank's summary carries it)."""
        local_rank = self.ctx.topology.local_rank if self.ctx is not None else 0
        if self._steps() == 0 and not self._noted and local_rank == 0:
            self._noted = True
            log.warning(NO_STEPS)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"attached_at": self.trigger, "step_boundaries": self._steps()}
        if out["step_boundaries"] == 0:
            out["note"] = NO_STEPS
        return out


def attach_now(trigger: str) -> Any:
    """Attach the agent (configured by ``HPAR_*``) unless one is already running; never raises into
    the caller's code path beyond what ``attach`` itself guards."""
    import hpar_agent
    from hpar_agent.agent import current

    running = current()
    if running is not None:
        return running
    agent = hpar_agent.attach()
    if agent.started:
        agent.add_component(ZeroCode(trigger))
        agent.events.emit("autoattach", trigger=trigger)
    return agent
