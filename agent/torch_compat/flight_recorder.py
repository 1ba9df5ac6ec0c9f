"""The one adapter for reading the c10d flight recorder (FR); decoding its entries is ``fr_decode``'s.

Everything here is private torch API, feature-detected at call time, so a change in torch touches this
file only. Facts (torch 2.11 CUDA, 2.13 CPU): gloo groups record into ``_dump_fr_trace`` (no durations,
no send/recv), NCCL groups into ``_dump_nccl_trace`` (``duration_ms`` with TORCH_NCCL_ENABLE_TIMING=1,
p2p included). Both return a pickle with ``entries`` and ``pg_status``; stack traces are never
requested (their first symbolization costs seconds).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

#: Recorder name -> function name in ``torch._C._distributed_c10d``.
RECORDERS: tuple[tuple[str, str], ...] = (("gloo", "_dump_fr_trace"), ("nccl", "_dump_nccl_trace"))


def _c10d() -> Any:
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    return c10d


def available_recorders() -> list[str]:
    """Names of the recorders this torch build exposes (``gloo``; ``nccl`` on CUDA builds)."""
    c10d = _c10d()
    return [name for name, fn in RECORDERS if c10d is not None and hasattr(c10d, fn)]


def dump(recorder: str, include_collectives: bool = True) -> dict[str, Any]:
    """One FR snapshot without stack traces: ``{"entries": [...], "pg_status": {...}, ...}``.

    ``include_collectives=False`` returns only ``pg_status`` (10-20 µs): enough to see whether
    anything was enqueued since the last full read.
    """
    fn: Callable[..., bytes] = getattr(_c10d(), dict(RECORDERS)[recorder])
    try:
        raw = fn(includeCollectives=include_collectives, includeStackTraces=False, onlyActive=False)
    except TypeError:  # older signature: positional or only includeStackTraces
        raw = fn(includeStackTraces=False)
    data = pickle.loads(raw)  # produced in-process by torch itself
    return data if isinstance(data, dict) else {}


#: Recorder name -> the function that dumps it as JSON (the pickle dumps are ``RECORDERS``').
JSON_DUMPS: dict[str, str] = {"gloo": "_dump_fr_trace_json", "nccl": "_dump_nccl_trace_json"}


def dump_bytes(recorder: str, fmt: str) -> bytes | None:
    """The whole ring of ``recorder`` as torch writes it, without stack traces: ``pickle`` (what torch's
    analyser, ``python -m torch.distributed.flight_recorder.fr_trace``, reads) or ``json`` (to read by
    eye). None when this build has no such recorder."""
    name = dict(RECORDERS)[recorder] if fmt == "pickle" else JSON_DUMPS[recorder]
    fn: Callable[..., bytes] | None = getattr(_c10d(), name, None)
    if fn is None:
        return None
    if fmt == "pickle":
        return bytes(fn(includeCollectives=True, includeStackTraces=False, onlyActive=False))
    return bytes(fn(includeCollectives=True, onlyActive=False))


def ring_entries() -> int | None:
    """The FR ring's capacity as configured (``TORCH_FR_BUFFER_SIZE``, or the older NCCL name); None
    when unset (torch's default)."""
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        try:
            return int(os.environ[var])
        except (KeyError, ValueError):
            continue
    return None


def nccl_timing() -> bool:
    """Whether NCCL groups stamp ``duration_ms`` on their entries (``TORCH_NCCL_ENABLE_TIMING``)."""
    return os.environ.get("TORCH_NCCL_ENABLE_TIMING", "0") not in ("0", "")


def process_groups() -> list[Any]:
    """Every live ProcessGroup of this process (the default group and each ``new_group``/mesh group)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return list(c10d._world.pg_map.keys())
    except Exception:
        return []


def can_enable_timing() -> bool:
    """Whether this torch can switch timing on for a live group (``ProcessGroup._enable_collectives_timing``:
    see ``enable_timing``)."""
    try:
        import torch.distributed as dist

        return hasattr(dist.ProcessGroup, "_enable_collectives_timing")
    except Exception:
        return False


def enable_timing(pg: Any) -> bool:
    """Switch CUDA-event timing on for one NCCL group (``ProcessGroup._enable_collectives_timing``,
    the in-process twin of ``TORCH_NCCL_ENABLE_TIMING``, which ProcessGroupNCCL reads only when it is
    constructed). Entries enqueued from then on get ``duration_ms``. False for other backends."""
    if group_backend(pg) != "nccl":
        return False
    fn = getattr(pg, "_enable_collectives_timing", None)
    if fn is None:
        return False
    fn()
    return True


def group_ranks(group: Any) -> list[int]:
    """Global ranks of a ProcessGroup's members, in group-rank order ([] if unknown): NCCL p2p
    profiling names spell peers as group ranks."""
    try:
        import torch.distributed as dist

        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:
        return []


def group_size(name: str) -> int | None:
    """Size of the process group registered under ``name`` (the FR ``process_group[0]``)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name).size())  # type: ignore[arg-type]
    except Exception:
        return None


def group_name(group: Any) -> tuple[str, str]:
    """(name, desc) of a ProcessGroup object (None: the default group), as the FR spells them."""
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return str(getattr(pg, "group_name", "")), str(getattr(pg, "group_desc", "") or "")


def group_backend(group: Any) -> str:
    """The backend a group's collectives run through on this host's accelerator. A group made without
    naming one (a bare ``init_process_group()``, ``init_device_mesh``) is "undefined" to
    ``get_backend``, and one given a map "cpu:gloo,cuda:nccl": both are read from the group's map,
    its CUDA entry where CUDA is available (the NCCL checks depend on it), else its CPU one."""
    try:
        import torch
        import torch.distributed as dist

        name = str(dist.get_backend(group))
        if name != "undefined" and ":" not in name:
            return name
        pairs = dict(p.split(":", 1) for p in str(dist.get_backend_config(group)).split(",") if ":" in p)
        device = "cuda" if "cuda" in pairs and torch.cuda.is_available() else "cpu"
        return pairs.get(device, name)
    except Exception:
        return "unknown"


def group_timeout_s(group: Any) -> float | None:
    """The timeout of a ProcessGroup's backend (None: the default group) in seconds, None if unknown: a
    program that only sends and receives (a pipeline on gloo) leaves no flight-recorder entry to read it
    from. ``ProcessGroup._get_backend(device).options._timeout`` (a timedelta), checked on torch 2.13."""
    try:
        import torch
        import torch.distributed as dist

        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if group_backend(pg) == "nccl" else "cpu")
        t = pg._get_backend(device).options._timeout.total_seconds()
        return float(t) if t > 0 else None
    except Exception:
        return None
