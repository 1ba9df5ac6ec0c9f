"""The component that re-detects the agent's topology when a source appears (``topology_watch``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpar_agent import topology_watch as watch
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.component import Component

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext


class TopologyWatch(Component):
    """Re-detects the agent's topology when a process group, a data-parallel wrapper, a mesh or a
    pipeline stage appeared (a stage's chunks it times at once, ``_time_chunks``): right then on the
    training thread when no pass is in progress (a short job may end, and destroy its group, before
    the next pass), and again at the next pass (first in poll order: the rest of that pass sees the
    new topology), when what the source built is complete (FSDP2 shards the parameters after the
    state's ``init``)."""

    name = "topology"

    def __init__(self) -> None:
        super().__init__()
        self.due = False
        self.redetects = 0  # re-detections that changed the topology

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        watch.install(self)
        watch.listen(self._on_source)
        self.due = bool(watch.seen())  # built before attach (a mesh whose constructor made the group)

    def uninstall(self) -> None:
        watch.unlisten(self._on_source)
        watch.uninstall(self)

    def _on_source(self, kind: str) -> None:
        """Training thread, when a source is built (rare: not per step). Before the default group is
        destroyed, a re-detection still due runs, waiting for a pass in progress: the wrappers built
        on the group can be read only until then."""
        if kind == "destroy":
            if self.due:
                self._redetect(wait=True)
            return
        if kind == "stage":
            self._time_chunks()
        self.due = True
        if self.require_ctx().redetect(wait=False):
            self.redetects += 1

    def _time_chunks(self) -> None:
        """Time the chunks of the stages a pipelining program builds or a schedule runs, as
        ``Agent.watch_pipeline`` does (idempotent), with no call of the program's: at the stage's
        construction, or the schedule's construction or first step (before it runs), so no chunk of a
        step is timed without its others. Once a stage; a chunk then costs a timestamp and an append."""
        pipe = self.require_ctx().find(PipelineCollector)
        if pipe is not None:
            try:
                pipe.watch(watch.stages())
            except Exception as exc:
                pipe.record_error(exc)

    def poll(self, now: float) -> None:
        for exc in watch.take_errors():
            self.record_error(exc)
        if self.due:
            self._redetect(in_pass=True)

    def _redetect(self, **how: bool) -> None:
        self.due = False
        try:
            if self.require_ctx().redetect(**how):
                self.redetects += 1
        finally:
            watch.release()

    def summary(self) -> dict[str, Any]:
        return {"redetects": self.redetects, "sources": sorted(set(watch.seen()))}
