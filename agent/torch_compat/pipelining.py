"""The stages a ``torch.distributed.pipelining`` program builds and runs, and what a stage says of where
its rank sits in the pipeline (verified on torch 2.11 CUDA and 2.13 CPU).

A schedule keeps its stages in private attributes: ``PipelineScheduleSingle._stage`` (GPipe, 1F1B) and
``PipelineScheduleMulti._stages`` (interleaved, looped BFS, zero-bubble, V). Every stage class derives
from ``_PipelineStageBase``, whose ``__init__`` sets ``stage_index``, ``num_stages``, ``group``,
``group_rank`` and ``group_size``. Where torch renames them the schedule reads as having no stages, no
chunk is timed and no stage is learnt; ``watch_pipeline(stages=...)`` and ``HPAR_PP_STAGE`` still work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STAGE_MODULE = "torch.distributed.pipelining.stage"
STAGE_BASE = "_PipelineStageBase"
SCHEDULE_MODULE = "torch.distributed.pipelining.schedules"
SCHEDULE_CLASSES = ("PipelineScheduleSingle", "PipelineScheduleMulti")
#: Set on a schedule whose stages the topology watch was told of (``stages_once``).
_SEEN = "_hpar_stages_seen"
#: Set on each stage ``stages_once`` found: the class name of the schedule that runs it (``schedule_name``).
_SCHEDULE = "_hpar_schedule"


def schedule_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects ``schedule`` runs on this rank ([] where none is found)."""
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return [s for s in stages if s is not None]


def stages_once(schedule: Any, args: tuple[Any, ...] = ()) -> list[Any] | None:
    """The schedule's stages the first time it is asked of ``schedule`` (its ``__init__`` or its first
    ``step``), None after: the per-step hook costs one attribute read. Each stage is marked with the
    schedule's class name (``schedule_name``)."""
    if getattr(schedule, _SEEN, False):
        return None
    try:
        setattr(schedule, _SEEN, True)
    except Exception:
        return None
    stages = schedule_stages(schedule)
    for stage in stages:
        try:
            setattr(stage, _SCHEDULE, type(schedule).__name__)
        except Exception:
            pass  # a stage that takes no attribute: its schedule goes unnamed
    return stages or None


def schedule_name(stage: Any) -> str:
    """The class name of the schedule ``stages_once`` found running ``stage`` ("" where none did)."""
    name = getattr(stage, _SCHEDULE, "")
    return name if isinstance(name, str) else ""


@dataclass(frozen=True)
class StageInfo:
    """One stage on this rank: its index of ``num_stages``, and the pipeline group (this rank's
    position in it, its size, and its members' global ranks, [] where they cannot be read)."""

    index: int
    num_stages: int
    group_rank: int
    group_size: int
    group_ranks: tuple[int, ...]


def stage_info(stage: Any) -> StageInfo | None:
    """What ``stage`` says of its place in the pipeline; None for anything that is not a built stage."""
    try:
        index, num = stage.stage_index, stage.num_stages
        g_rank, g_size = stage.group_rank, stage.group_size
        if not all(isinstance(v, int) for v in (index, num, g_rank, g_size)):
            return None
        if not (0 <= index < num and 0 <= g_rank < g_size):
            return None
    except Exception:
        return None
    return StageInfo(index, num, g_rank, g_size, tuple(group_ranks(stage_group(stage))))


def stage_group(stage: Any) -> Any:
    """The stage's pipeline process group (None: the default group)."""
    return getattr(stage, "group", None)


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group``, in group-rank order ([] where they cannot be read)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        if group is None:
            return list(range(dist.get_world_size()))
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:
        return []
