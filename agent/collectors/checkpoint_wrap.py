"""Checkpoint saves and loads, timed without user code: the public entry points wrapped while attached.

Wrapped: ``torch.distributed.checkpoint``'s ``save``, ``load``, ``save_state_dict``, ``load_state_dict``
and ``async_save`` (its blocking part: the staging before it returns), and ``torch.save`` of a mapping
(a state dict, or a dict holding them) and ``torch.load`` (a load that returns a mapping is counted).
Only the outermost call counts (DCP's writers call ``torch.save`` inside ``save``), and only calls on
the thread that made it (the goodput ledger keeps those of the training thread). A program that bound
``save`` to its own name before attach (``from torch.distributed.checkpoint import save``) calls the
original: its checkpoints count as host time.

Each call appends one ``(start ns, end ns, native thread id, save, steps done)`` record: two clock reads,
an attribute read and a put. While the outermost call runs, ``open`` holds its thread: a checkpoint in
progress is progress to Hang (a save of minutes writes, or waits on its writer threads, between steps).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpar_agent.buffer import BoundedBuffer

#: One checkpoint call: (start epoch ns, end epoch ns, native id of the calling thread, whether it saved,
#: the steps the process had completed when it returned).
Call = tuple[int, int, int, bool, int]

DCP_SAVES = ("save", "save_state_dict", "async_save")
DCP_NAMES = (*DCP_SAVES, "load", "load_state_dict")


def _no_steps() -> int:
    return 0


class CheckpointWrap:
    """The wrappers, what they replaced, and the buffer they append to."""

    def __init__(self) -> None:
        self.buffer: BoundedBuffer[Call] = BoundedBuffer("checkpoint", 4096)
        self._patched: list[tuple[Any, str, Any]] = []  # (module, name, original)
        self._depth = threading.local()
        self.steps_done: Callable[[], int] = _no_steps
        self.open: dict[int, int] = {}  # native thread id -> start ns of its outermost call in progress

    def install(self, capacity: int, steps_done: Callable[[], int] | None = None) -> None:
        self.buffer.capacity = capacity
        self.steps_done = steps_done or _no_steps
        import torch

        self._patch(torch, "save", True, lambda args, out: bool(args) and isinstance(args[0], Mapping))
        self._patch(torch, "load", False, lambda args, out: isinstance(out, Mapping))
        try:
            import torch.distributed.checkpoint as dcp
        except Exception:  # torch built without distributed
            return
        for name in DCP_NAMES:
            self._patch(dcp, name, name in DCP_SAVES, None)

    def uninstall(self) -> None:
        for mod, name, orig in reversed(self._patched):
            if getattr(getattr(mod, name, None), "_hpar_orig", None) is orig:
                setattr(mod, name, orig)
        self._patched.clear()

    def _patch(self, mod: Any, name: str, save: bool, counts: Any) -> None:
        orig = getattr(mod, name, None)
        if orig is None or not callable(orig) or getattr(orig, "_hpar_orig", None) is not None:
            return
        put, depth, wrap, opened = self.buffer.put, self._depth, self, self.open

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            level = getattr(depth, "n", 0)
            depth.n = level + 1
            t0, tid = time.time_ns(), threading.get_native_id()
            if level == 0:
                opened[tid] = t0
            out = None
            try:
                out = orig(*args, **kwargs)
                return out
            finally:
                depth.n = level
                if level == 0:
                    opened.pop(tid, None)
                    try:
                        if counts is None or counts(args, out):
                            put((t0, time.time_ns(), tid, save, wrap.steps_done()))
                    except Exception:  # never into the training loop
                        pass

        wrapper._hpar_orig = orig  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(orig, "__name__", name)
        wrapper.__qualname__ = getattr(orig, "__qualname__", name)
        wrapper.__doc__ = getattr(orig, "__doc__", None)
        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        setattr(mod, name, wrapper)
        self._patched.append((mod, name, orig))
