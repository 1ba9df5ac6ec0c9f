"""Out-of-memory forensics (component ``oom``): what held the GPU's memory when it ran out, written once.

Two ways in:

- the CUDA allocator's OOM observer (``torch_compat.cuda_memory``), attached once CUDA is initialized: at
  attach, else at a step boundary (the training thread, where no allocation of ours races the attach).
  Torch calls it on the thread whose allocation failed, before the ``OutOfMemoryError`` is raised, with
  that code's stack still live;
- the agent's ``sys.excepthook`` (``Component.on_uncaught``): an uncaught ``torch.OutOfMemoryError`` ends the process. The record is marked
  fatal, or made there when the observer could not be (CUDA initialized after attach, no step since).

The first out-of-memory of the process writes the record: the step, the allocator's numbers, the stacks
that allocated, the live tensors' owners, a digest of the allocator snapshot, the memory trend before it
(``memory_forensics``); and as evidence the snapshot itself (pytorch.org/memory_viz), a py-spy dump and
the record as JSON. One ``oom`` event names the files; another follows when the error ends the process.
Later ones (a program that catches the error and retries smaller, cuDNN trying algorithms) are only
counted. Nothing here allocates CUDA memory: the snapshot and the owners are host-side metadata.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from hpar_agent import memory_forensics as mf
from hpar_agent.collectors.memory import MemoryCollector
from hpar_agent.collectors.steps import StepCollector, innermost_optimizer
from hpar_agent.component import Component
from hpar_agent.torch_compat import cuda_memory

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

#: Evidence file tag (``OutOfMemory.rank<R>.<time>.<i>.<kind>.<ext>``).
TAG = "OutOfMemory"
#: Characters of the error's message kept (torch's names the request, the capacity and what is free).
MESSAGE_CHARS = 2000


def _stats(device: Any) -> Mapping[str, Any]:
    """The allocator's counters of a CUDA device (host-side, never initializes CUDA)."""
    if getattr(device, "type", "") != "cuda" or not cuda_memory.cuda_initialized():
        return {}
    import torch

    return torch.cuda.memory_stats(device)


class OomCollector(Component):
    """The observer, the exception hook and the one record of this process."""

    name = "oom"

    def __init__(
        self,
        snapshot: Callable[[Any], Mapping[str, Any]] | None = None,
        stats: Callable[[Any], Mapping[str, Any]] = _stats,
    ) -> None:
        super().__init__()
        self._snapshot = snapshot or cuda_memory.snapshot  # injectable for tests
        self._stats = stats
        self.observing = False
        self.count = 0  # out-of-memory errors seen (observer calls, or the one uncaught error)
        self.record: dict[str, Any] | None = None
        self._busy = False
        self._pid = 0  # the process that installed it (a forked child inherits it, not the record)

    # ------------------------------------------------------------------------------------ lifecycle
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._pid = os.getpid()
        self._observe()

    def uninstall(self) -> None:
        cuda_memory.stop_observing(self.on_allocator_oom)
        self.observing = False

    def _observe(self) -> None:
        ctx = self.ctx
        if ctx is not None and getattr(ctx.device, "type", "") == "cuda":
            self.observing = cuda_memory.observe_ooms(self.on_allocator_oom)

    def step_hook(self, step: int, t_ns: int) -> None:
        """Training thread: attach the observer once the program initialized CUDA (then O(1))."""
        if not self.observing:
            self._observe()

    # ------------------------------------------------------------------------------------ the two ways in
    def on_allocator_oom(self, device: int, requested: int, limit: int, free: int) -> None:
        """The allocator's observer, on the allocating thread: count, and the first time write the record."""
        self.count += 1
        if self.record is not None or self._busy:
            return
        self._busy = True
        try:
            this = sys._getframe(1)
            stacks = {threading.current_thread().name: mf.stack_lines(traceback.extract_stack(this))}
            frames = list(mf.frames_up(this))
            main = threading.main_thread()
            if threading.current_thread() is not main and main.ident is not None:
                top = sys._current_frames().get(main.ident)  # a backward's allocation: the loop is there
                stacks[main.name] = mf.stack_lines(traceback.extract_stack(top))
                frames += list(mf.frames_up(top))
            self._write(
                "allocator",
                device,
                frames if mf.SAFE_LOCALS else [],
                stacks,
                requested=requested,
                limit=limit,
                free=free,
            )
        except Exception as exc:
            self.record_error(exc)
        finally:
            self._busy = False

    def on_uncaught(self, exc: BaseException) -> None:
        """An exception that ends the process (the agent's ``sys.excepthook``, or zero-code mode attaching
        for an out-of-memory): recorded when it is an out-of-memory."""
        import torch

        if not isinstance(exc, torch.OutOfMemoryError) or os.getpid() != self._pid:
            return
        self.count = max(self.count, 1)
        fatal = {"fatal": True, "message": str(exc)[:MESSAGE_CHARS]}
        stack = mf.stack_lines(traceback.extract_tb(exc.__traceback__))
        rec = self.record
        if rec is None:
            index = getattr(self.require_ctx().device, "index", None)
            self._write(
                "exception", index, mf.tb_frames(exc.__traceback__), {"traceback": stack}, fatal=fatal
            )
            return
        rec["stacks"]["traceback"] = stack
        rec.update(fatal, site=rec.get("site") or mf.user_site(stack))
        self.require_ctx().events.emit("oom", **rec)

    # ------------------------------------------------------------------------------------ the record
    def _write(
        self,
        source: str,
        device: int | None,
        frames: list[FrameType],
        stacks: dict[str, list[str]],
        requested: int | None = None,
        limit: int | None = None,
        free: int | None = None,
        fatal: Mapping[str, Any] | None = None,
    ) -> None:
        ctx = self.require_ctx()
        dev = ctx.device
        stats = self._stats(dev)
        allocated, reserved = (
            stats.get("allocated_bytes.all.current"),
            stats.get("reserved_bytes.all.current"),
        )
        models, optimizers, found = self._objects(frames)
        owners, names = mf.owners(models, optimizers, dev, allocated)
        owners["source"] = found
        snap: Mapping[str, Any] | None = None
        snap_note = "no allocator snapshot: not a CUDA device"
        try:
            if getattr(dev, "type", "") == "cuda":
                snap = self._snapshot(dev)
        except Exception as exc:
            snap_note = f"no allocator snapshot ({type(exc).__name__}: {exc})"
        steps = ctx.find(StepCollector)
        site = next((s for s in map(mf.user_site, stacks.values()) if s), "")
        rec: dict[str, Any] = {
            "source": source,
            "fatal": False,
            "step": steps.count if steps is not None else None,
            "device": str(dev),
            "requested_bytes": requested,
            "device_limit_bytes": limit,
            "device_free_bytes": free,
            "headroom_bytes": None
            if free is None or allocated is None or reserved is None
            else free + max(0, reserved - allocated),
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "site": site,
            "stacks": stacks,
            "owners": owners,
            "snapshot": mf.snapshot_digest(snap, device, names) if snap is not None else {"note": snap_note},
            "trend": self._trend(),
            **(fatal or {}),
        }
        if rec["snapshot"].get("oom_site"):
            rec["site"] = rec["snapshot"]["oom_site"]
        rec["evidence"] = self._evidence(rec, snap) if ctx.config.evidence and ctx.run_dir else []
        self.record = rec
        ctx.events.emit("oom", **rec)
        log.warning(
            "hpar_agent: CUDA out of memory on rank %d after %s completed steps%s%s",
            ctx.topology.rank,
            rec["step"],
            f" at {rec['site']}" if rec["site"] else "",
            f"; evidence: {', '.join(rec['evidence'])}" if rec["evidence"] else "",
        )

    def _objects(self, frames: list[FrameType]) -> tuple[list[Any], list[Any], str]:
        """The model and optimizer given to ``attach`` (else the optimizer that steps), and what the
        locals of ``frames`` hold where those are missing (``frames`` is empty where reading them is not
        safe: a program that goes on)."""
        ctx = self.require_ctx()
        steps = ctx.find(StepCollector)
        stepping = steps.optimizer() if steps is not None and steps.optimizer is not None else None
        models = [ctx.model] if ctx.model is not None else []
        optimizer = innermost_optimizer(ctx.optimizer) if ctx.optimizer is not None else stepping
        optimizers = [optimizer] if optimizer is not None else []
        if models and optimizers:
            return models, optimizers, "attached model and optimizer"
        found_models, found_opts = mf.found_in_frames(frames) if frames else ([], [])
        models, optimizers = models or found_models, optimizers or found_opts
        what = (
            "attached model"
            if ctx.model is not None
            else "model found on the stack"
            if models
            else "optimizer's parameters (no model known)"
            if optimizers
            else "no model known"
        )
        return models, optimizers, what

    def _trend(self) -> dict[str, Any]:
        mem = self.ctx.find(MemoryCollector) if self.ctx is not None else None
        return mf.trend(mem.series()) if mem is not None else {}

    def _evidence(self, rec: dict[str, Any], snap: Mapping[str, Any] | None) -> list[str]:
        """The snapshot, a py-spy dump and the record, each under a rate limit of its own (an alert's
        evidence a minute ago must not suppress these)."""
        ev = self.require_ctx().evidence
        paths: list[str] = []
        try:
            if snap is not None:
                paths += ev.save(TAG, "allocator", "pickle", pickle.dumps(snap), limit="oom-allocator")
            paths += ev.py_spy(TAG, limit="oom-pyspy")
            rec["evidence"] = list(paths)
            paths += ev.save(TAG, "oom", "json", json.dumps(rec, indent=1, default=str).encode(), limit="oom")
        except OSError as exc:  # a full disk: counted; the event still says what happened
            self.record_error(exc)
        return paths

    # ------------------------------------------------------------------------------------ outputs
    def summary(self) -> dict[str, Any]:
        return {"observer": self.observing, "count": self.count, "record": self.record}
