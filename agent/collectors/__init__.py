"""One collector per source. ``default_components`` is the set ``attach()`` installs, in poll order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpar_agent.component import Component

if TYPE_CHECKING:
    from hpar_agent.agent import Agent


def default_components(agent: Agent) -> list[Component]:
    from hpar_agent.collectors.anatomy import AnatomyCollector
    from hpar_agent.collectors.collectives import CollectiveCollector
    from hpar_agent.collectors.compile import CompileCollector
    from hpar_agent.collectors.gradsync import GradSyncCollector
    from hpar_agent.collectors.memory import MemoryCollector, NvmlCollector
    from hpar_agent.collectors.pipeline import PipelineCollector
    from hpar_agent.collectors.steps import StepCollector

    comps: list[Component] = [StepCollector(), PipelineCollector(), AnatomyCollector()]
    comps += [CollectiveCollector(), GradSyncCollector(), NvmlCollector(), MemoryCollector()]
    comps.append(CompileCollector())
    if agent.config.detectors:
        from hpar_agent.detectors import DetectorsComponent

        comps.append(DetectorsComponent())  # last: polls after the collectors it reads
    return comps
