"""The ``stream`` label: the CUDA stream work ran on, ``nccl:<pg>`` for a group's comm stream, ``cpu``."""

from __future__ import annotations

from typing import Any

CPU = "cpu"


def stream_label(device: Any = None, stream: Any = None) -> str:
    """Label of ``stream``, else of the current stream of ``device`` (cheap: no synchronization)."""
    import torch

    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return CPU
    s = stream if stream is not None else torch.cuda.current_stream(device)
    return "cuda:default" if s.stream_id == 0 else f"cuda:{s.stream_id}"


def comm_stream_label(pg: str, backend: str) -> str:
    return f"nccl:{pg}" if backend == "nccl" else CPU


#: Distinct ``stream`` values one collector exports; more (code that makes a stream per step) share OTHER.
MAX_STREAMS = 4
OTHER = "cuda:other"


class StreamCap:
    """Bounds one collector's ``stream`` label values (agent thread): the first ``cap`` seen keep
    their name, later ones become ``cuda:other``, so a series count never grows with user streams."""

    def __init__(self, cap: int = MAX_STREAMS) -> None:
        self.cap = cap
        self.seen: set[str] = set()

    def __call__(self, label: str) -> str:
        if label in self.seen:
            return label
        if len(self.seen) >= self.cap:
            return OTHER
        self.seen.add(label)
        return label
