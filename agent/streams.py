"""The ``stream`` label: the CUDA stream work ran on, ``nccl:<pg>`` for a group's comm stream, ``cpu``."""

from __future__ import annotations

from typing import Any

CPU = "cpu"


def stream_label(device: Any = None) -> str:
    """Label of the current stream of ``device`` (cheap: no synchronization)."""
    import torch

    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return CPU
    s = torch.cuda.current_stream(device)
    return "cuda:default" if s.stream_id == 0 else f"cuda:{s.stream_id}"


def comm_stream_label(pg: str, backend: str) -> str:
    return f"nccl:{pg}" if backend == "nccl" else CPU
