"""This rank's accelerator, fixed once at attach, so every GPU read names it explicitly.

A new Python thread starts on CUDA device 0 whatever the training thread set: on the agent thread
``torch.cuda.memory_stats()`` and friends silently read device 0. Every GPU read in the agent (allocator
stats, the NVML handle, CUDA events, allocator snapshots) therefore takes the device resolved here.
Resolving never initializes CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _param_device(model: Any) -> torch.device | None:
    """The device of the model's first CUDA parameter (DTensor parameters report their local device)."""
    if model is None or not hasattr(model, "parameters"):
        return None
    try:
        for p in model.parameters():
            dev: torch.device = p.device
            if dev.type == "cuda":
                return dev
    except Exception:
        return None
    return None


def resolve_device(model: Any = None, mesh: Any = None, local_rank: int | None = None) -> torch.device:
    """This rank's device: a CUDA parameter of the model, else the calling thread's current CUDA device
    (once CUDA is initialized), else LOCAL_RANK among the visible GPUs (torchrun's one GPU per local
    rank), else the CPU. A mesh on CPU, or a host with no visible GPU, means the CPU. Call it on the
    training thread."""
    dev = _param_device(model)
    if dev is not None:
        if dev.index is None and torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return dev if dev.index is not None else torch.device("cuda", 0)
    mesh_type = str(getattr(mesh, "device_type", "") or "")
    if mesh_type and mesh_type != "cuda":
        return torch.device("cpu")
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch: unannotated
        return torch.device("cuda", torch.cuda.current_device())
    n = torch.cuda.device_count()  # NVML-based: does not initialize CUDA
    if n:
        lr = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0") or 0)
        return torch.device("cuda", lr % n)
    return torch.device("cpu")


def nvml_index(device: torch.device) -> int | str:
    """The NVML index (or UUID) of a CUDA device, through ``CUDA_VISIBLE_DEVICES``."""
    index = device.index or 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible):
        dev = visible[index]
        return int(dev) if dev.isdigit() else dev
    return index
