"""The stages a ``torch.distributed.pipelining`` schedule runs (verified on torch 2.11 CUDA and 2.13 CPU).

A schedule keeps them in private attributes: ``PipelineScheduleSingle._stage`` (GPipe, 1F1B) and
``PipelineScheduleMulti._stages`` (interleaved, looped BFS, zero-bubble). Where torch renames them the
schedule reads as having no stages and no chunk is timed; ``watch_pipeline(stages=...)`` still works.
"""

from __future__ import annotations

from typing import Any


def schedule_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects ``schedule`` runs on this rank ([] where none is found)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [s for s in stages if s is not None]
