"""The shape every collector and detector takes inside the agent.

A component sees the agent only through its ``AgentContext`` (``self.ctx``, set by ``install``).

A component installs its hooks on attach (training thread; they only append to a BoundedBuffer),
drains and derives state in ``poll`` (agent thread), renders fresh metric families in ``collect``
(scrape thread) and removes exactly what it installed in ``uninstall``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.spans import StepRecord
    from hpar_agent.topology import Topology


class Component:
    """Base class; subclasses override what they need. ``name`` is the ``component`` label value."""

    name: str = "component"

    def __init__(self) -> None:
        self.ctx: AgentContext | None = None
        self.up = True

    def install(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    def require_ctx(self) -> AgentContext:
        """The context, for code that only runs once installed (the agent catches the error)."""
        if self.ctx is None:
            raise RuntimeError(f"component {self.name} is not installed")
        return self.ctx

    def record_error(self, exc: BaseException) -> None:
        """Count ``exc`` against this component (nothing before ``install``)."""
        if self.ctx is not None:
            self.ctx.record_error(self.name, exc)

    def uninstall(self) -> None:
        """Remove every hook/handler/callback ``install`` added."""

    def poll(self, now: float) -> None:
        """Agent thread: drain buffers, poll sources, update state."""

    def on_topology(self, old: Topology, new: Topology) -> None:
        """Agent thread: the topology was detected again and changed (``ctx.topology`` is ``new``
        already): refresh what was derived from ``old`` at install."""

    def step_hook(self, step: int, t_ns: int) -> None:
        """Training thread, inside the step-boundary hook: must be O(µs), only append. Only
        components that override it are called."""

    def on_uncaught(self, exc: BaseException) -> None:
        """Main thread, in the agent's ``sys.excepthook``: ``exc`` is about to end the process."""

    def on_step(self, rec: StepRecord) -> None:
        """Agent thread: called once per completed step, after every component's ``poll``."""

    def end_pass(self) -> None:
        """Agent thread: once per pass, after every component's ``poll`` and the pass's ``on_step``
        calls: work done once for the lot (a fast loop completes hundreds of steps per pass), and
        before ``span_watermark_ns`` is asked."""

    def span_watermark_ns(self) -> int | None:
        """Agent thread: every child span starting before this epoch time has been handed to the
        agent (``None``: spans are never late). A step's trace is exported once it passes its end."""
        return None

    def collect(self) -> Iterable[Metric]:
        """Scrape: build and return fresh metric families from state."""
        return ()

    def summary(self) -> dict[str, Any]:
        """A JSON-able digest for the demo summary and the run report."""
        return {}
