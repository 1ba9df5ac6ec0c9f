"""The zero-code component (``collectors.zerocode.ZeroCode``): the no-step note, once per host, on every
rank's summary."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("local_rank", "steps", "lines"), [(0, 0, 1), (1, 0, 0), (0, 3, 0)])
def test_no_step_line_once_per_host(
    caplog: pytest.LogCaptureFixture, local_rank: int, steps: int, lines: int
) -> None:
    from hpar_agent.collectors.steps import StepCollector
    from hpar_agent.collectors.zerocode import NO_STEPS, ZeroCode
    from hpar_agent.config import AgentConfig
    from hpar_agent.context import AgentContext
    from hpar_agent.topology import Topology

    counter = StepCollector()  # never installed: no hook
    counter.count = steps
    comp = ZeroCode("init_process_group")
    comp.install(AgentContext(AgentConfig(), Topology(local_rank=local_rank), components=[counter]))
    with caplog.at_level("WARNING", logger="hpar_agent"):
        comp.uninstall()
        comp.uninstall()
    assert [r.getMessage() for r in caplog.records].count(NO_STEPS) == lines
    assert ("note" in comp.summary()) == (steps == 0)  # every rank's summary carries it
