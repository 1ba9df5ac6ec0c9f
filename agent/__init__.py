"""hpar-agent: observability for DP x TP x PP PyTorch training with torch.compile.

One line in a torchrun job::

    agent = hpar_agent.attach(model)

exports Prometheus metrics and OpenTelemetry spans labelled by rank, pipeline stage and stream, and runs
detectors for the hybrid-parallel failure modes. ``HPAR_DISABLE=1`` turns it into a no-op.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import Any

from hpar_agent.config import AgentConfig


def attach(
    model: Any = None,
    *,
    optimizer: Any = None,
    mesh: Any = None,
    config: AgentConfig | None = None,
    **overrides: Any,
) -> Agent:
    """Attach the agent to this process (one per process) and return it.

    Step boundaries come from the global optimizer step hook; call ``Agent.step()`` in loops without
    an optimizer. Attaching twice warns and returns the running agent.
    """
    return attach_agent(model, optimizer=optimizer, mesh=mesh, config=config, **overrides)


def detach() -> None:
    """Remove every hook the agent installed, stop its thread and close its endpoint."""
    detach_agent()


from hpar_agent.agent import Agent, attach_agent, current, detach_agent  # noqa: E402

__all__ = ["Agent", "AgentConfig", "__version__", "attach", "current", "detach"]
