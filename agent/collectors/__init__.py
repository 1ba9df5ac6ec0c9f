"""One collector per source. ``default_components`` is the set ``attach()`` installs, in poll order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpar_agent.component import Component

if TYPE_CHECKING:
    from hpar_agent.agent import Agent


def default_components(agent: Agent) -> list[Component]:
    from hpar_agent.collectors.pipeline import PipelineCollector
    from hpar_agent.collectors.steps import StepCollector

    comps: list[Component] = [StepCollector(), PipelineCollector()]
    return comps
