"""hpar-agent: observability for DP x TP x PP PyTorch training with torch.compile.

One line in a torchrun job::

    agent = hpar_agent.attach(model)

exports Prometheus metrics and OpenTelemetry spans labelled by rank, pipeline stage and stream, and runs
detectors for the hybrid-parallel failure modes. ``HPAR_DISABLE=1`` turns it into a no-op.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpar_agent._version import __version__
from hpar_agent.config import AgentConfig

if TYPE_CHECKING:
    from hpar_agent.agent import Agent


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
    from hpar_agent.agent import attach_agent

    return attach_agent(model, optimizer=optimizer, mesh=mesh, config=config, **overrides)


def detach() -> None:
    """Remove every hook the agent installed, stop its thread and close its endpoint."""
    from hpar_agent.agent import detach_agent

    detach_agent()


def __getattr__(name: str) -> Any:
    """``Agent`` and the ``agent`` module load on first use: ``import hpar_agent`` (the CLI, ``doctor``
    on a machine without torch) must not need torch."""
    if name in ("Agent", "attach_agent", "current", "detach_agent"):
        return getattr(importlib.import_module("hpar_agent.agent"), name)
    if name == "agent":
        return importlib.import_module("hpar_agent.agent")
    raise AttributeError(f"module 'hpar_agent' has no attribute {name!r}")


__all__ = ["Agent", "AgentConfig", "__version__", "attach", "current", "detach"]
