"""Gradient and parameter samples read off the training thread without synchronizing the GPU.

ReplicaDivergence (checksums) and the tp gradient-sync coverage both take a strided sample of each
tensor on the training thread and hand it to the agent thread, which reads it once the copy is done.
"""

from __future__ import annotations

from typing import Any


def strided(t: Any, n: int) -> Any:
    """At most ``n`` elements of a tensor's flattened values, evenly strided (``flat[::k][:n]``, with
    ``k = numel // n``), in its own dtype. One ``as_strided`` view of a contiguous tensor: the reshape,
    two slices and a cast per tensor were five dispatches, and with ``detach`` on a DTensor a checksum
    capture took 4.4-5.3x as long on the training thread."""
    numel = t.numel()
    k = max(1, numel // n)
    if t.is_contiguous():
        return t.as_strided((min(n, -(-numel // k)),), (k,), t.storage_offset())
    return t.reshape(-1)[::k][:n]


def sample_cat(parts: list[Any]) -> Any:
    """The samples of ``strided`` as one float32 tensor (``cat`` promotes mixed dtypes; one cast)."""
    import torch

    return torch.cat(parts).float()


def copy_to_host(t: Any) -> tuple[Any, Any]:
    """``(host tensor, event)``: a CUDA tensor is copied into pinned memory on its own stream without
    waiting (read it once ``event.query()`` is true); a CPU tensor is returned as is, with no event."""
    if not t.is_cuda:
        return t, None
    import torch

    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
    event.record(torch.cuda.current_stream(t.device))  # the copy's stream, not device 0's
    return host, event


def segment_sums(host: Any, sizes: list[int], with_abs: bool = False) -> list[list[float]]:
    """``[sum]`` (``[sum, abs-sum]`` with ``with_abs``) in float64 of each consecutive segment of a host
    sample, one list per entry of ``sizes``. Summed in Python from one ``tolist()``: a ``split`` then a
    ``.sum()`` per segment was one to two torch dispatches per parameter on the agent thread (the tp
    gradient-sync samples' share of a pass on 4 CPU ranks fell from ~0.5 to 0.18-0.20 ms with this)."""
    values = host.double().tolist()
    out: list[list[float]] = []
    at = 0
    for n in sizes:
        seg = values[at : at + n]
        at += n
        out.append([sum(seg), sum(map(abs, seg))] if with_abs else [sum(seg)])
    return out
