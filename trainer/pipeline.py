"""Split the model into pipeline stages and build the torch.distributed.pipelining schedule."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    _PipelineSchedule,
)

from .config import TrainConfig
from .model import GPT

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_ids(pp_rank: int, cfg: TrainConfig) -> list[int]:
    """Stages held by a pp rank: rank r holds r, r+pp, r+2pp, ... (the loop order Interleaved1F1B expects)."""
    return [pp_rank + v * cfg.pp for v in range(cfg.stages_per_rank)]


def split_stage(full: GPT, stage: int, num_stages: int) -> GPT:
    """A copy of ``full`` keeping only the blocks, embeddings and head that ``stage`` owns."""
    part = copy.deepcopy(full)
    per = len(full.layers) // num_stages
    owned = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for key in list(part.layers.keys()):
        if key not in owned:
            del part.layers[key]
    if stage != 0:
        part.tok_emb = part.pos_emb = None
    if stage != num_stages - 1:
        part.norm = part.head = None
    return part


def build_schedule(
    parts: list[nn.Module],
    stages: list[int],
    cfg: TrainConfig,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: LossFn,
) -> _PipelineSchedule:
    group = mesh["pp"].get_group()
    pipe_stages = [
        PipelineStage(p, s, cfg.num_stages, device, group=group) for p, s in zip(parts, stages, strict=True)
    ]
    if cfg.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(
            pipe_stages,  # type: ignore[arg-type]
            n_microbatches=cfg.microbatches,
            loss_fn=loss_fn,  # type: ignore[arg-type]
        )
    cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    return cls(pipe_stages[0], n_microbatches=cfg.microbatches, loss_fn=loss_fn)
