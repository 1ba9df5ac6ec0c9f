"""The one adapter over the CUDA caching allocator's private surface: its out-of-memory observer, its
snapshot and its allocation history.

Facts (torch 2.11 CUDA and 2.13; CPU builds have none of it): ``torch._C._cuda_attach_out_of_memory_observer(fn)``
calls ``fn(device, requested_bytes, device_limit_bytes, device_free_bytes)`` (the limit is the device's
total, or the per-process fraction's cap when one is set) on the thread whose allocation failed, with the
GIL taken and the allocator's lock released, before the ``OutOfMemoryError`` is raised. An exception out
of ``fn`` would replace that error, and observers cannot be detached; attaching initializes CUDA. So one
trampoline is attached per process, only once CUDA is initialized, and it calls the current handler,
swallowing whatever it raises. ``torch.cuda.memory._snapshot`` reads every device's segments and blocks
(host memory only; allocation stacks only while ``_record_memory_history`` records).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``handler(device, requested_bytes, device_limit_bytes, device_free_bytes)``
OomHandler = Callable[[int, int, int, int], None]

_handler: OomHandler | None = None
_attached = False
_unavailable = False  # no observer in this build, or attaching failed: not tried again


def _trampoline(device: int, requested: int, limit: int, free: int) -> None:
    handler = _handler
    if handler is None:
        return
    try:
        handler(device, requested, limit, free)
    except Exception:  # raised here, it would replace the user's OutOfMemoryError
        pass


def cuda_initialized() -> bool:
    """Whether the program initialized CUDA (read only: never initializes it)."""
    try:
        import torch

        return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]  # torch: unannotated
    except Exception:
        return False


def observe_ooms(handler: OomHandler) -> bool:
    """Route the allocator's OOM observer to ``handler`` (replacing the previous one). False, doing
    nothing, when this build has no observer or CUDA is not initialized yet (attaching would initialize it)."""
    global _handler, _attached, _unavailable
    if not _attached:
        if _unavailable or not cuda_initialized():
            return False
        try:
            import torch

            getattr(torch._C, "_cuda_attach_out_of_memory_observer")(_trampoline)  # noqa: B009 - absent on CPU builds
        except Exception:  # a CPU build, or an allocator backend without observers (cudaMallocAsync)
            _unavailable = True
            return False
        _attached = True
    _handler = handler
    return True


def stop_observing(handler: OomHandler) -> None:
    """The trampoline stays attached (torch cannot detach it) but calls nothing once ``handler`` left."""
    global _handler
    if _handler is handler:
        _handler = None


def snapshot(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot``: ``{"segments": [...], "device_traces": [...], ...}``; raises
    where this build has none (a CPU build) or the allocator is not the caching one."""
    import torch

    snap = torch.cuda.memory._snapshot(device)
    if not isinstance(snap, dict):
        raise TypeError(f"allocator snapshot is a {type(snap).__name__}, not a dict")
    return snap


def record_history(device: Any, max_entries: int) -> None:
    """Start recording every allocation and free with its Python stack (C++ unwinding on every one cost
    several % of step time on an H200; the Python frames are what name the code)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", device=device)


def stop_history(device: Any) -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None, device=device)
