"""The step anatomy's training-thread side: hooks that append ``(step, code, epoch ns, ...)`` marks.

- forward: pre-hook (prepended: the user's own pre-hooks count as forward) and post-hook on the
  model's root module only (``model_root.Root``; global module hooks would cost µs per submodule call),
  and where the root is a wrapper (DDP) a pre-hook on the module it wraps that marks evaluations only;
- backward: at forward exit, a hook on the output tensor marks the start of that backward and queues
  an autograd-engine callback (``queue_callback``, as DDP does) that marks its end; on the CPU clock a
  second callback, queued by that one and so run after DDP's/FSDP's, ends their wait (``SYNC1``);
- optimizer: the global optimizer step pre-hook; on CUDA a post-hook records the step's end event;
- data loader: ``_BaseDataLoaderIter.__next__`` wrapped while attached (time inside the loader).

Every hook is a no-op while torch.compile traces, and on the steps without detail
(``StepCollector.stride``), and never raises into the training loop; the forward hooks also without
grad (an evaluation between steps is time between steps). On CUDA each mark also records a
CUDA event on the rank's device's current stream (the agent thread resolves it, never synchronizing).
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpar_agent import topology_watch as watch
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.collectors import model_root
from hpar_agent.collectors.phases import BWD0, BWD1, EVAL, FWD0, FWD1, LOAD, OPT0, OPT1, SYNC1
from hpar_agent.torch_compat import autograd, dataloader

if TYPE_CHECKING:
    from hpar_agent.collectors.steps import StepCollector
    from hpar_agent.context import AgentContext

#: One mark: (step, phase code, t0 epoch ns, t1 epoch ns (the data loader's end; else 0), CUDA event or
#: None). A plain tuple: the garbage collector stops tracking one of atomic values (see ``buffer``).
Mark = tuple[int, int, int, int, Any]
MAX_OUTPUTS = 4  # items of a tuple/mapping output looked at for the tensors a backward starts from


def _grad_outputs(out: Any) -> list[Any]:
    """The tensors of a module's output that a backward runs through: the output, or of the first items
    of a tuple, list or mapping (Hugging Face's ``ModelOutput``: loss, logits) those with a grad_fn. The
    loop may call backward on any of them (its own loss from the logits), so each gets the hook; the
    first to run opens the backward, the first end closes it."""
    if getattr(out, "grad_fn", None) is not None:
        return [out]
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return [t for t in itertools.islice(items, MAX_OUTPUTS) if getattr(t, "grad_fn", None) is not None]


def _never() -> bool:
    return False


class AnatomyHooks:
    """The hooks, the root module they sit on, and the buffer they append to."""

    def __init__(self) -> None:
        self.ctx: AgentContext | None = None
        self.buffer: BoundedBuffer[Mark] = BoundedBuffer("anatomy", 1 << 16)
        self.root = model_root.Root(self._fwd_pre, self._fwd_post, self._eval_pre)
        self.forward_source = "none"  # where forward times come from: module-hooks, pipeline-chunks
        self._steps: StepCollector | None = None
        self._handles: list[Any] = []  # the optimizer hooks
        self._loader_patch: tuple[Any, Any] | None = None
        self._dist_on: Any = _never
        self._compiling: Any = _never
        self._grad_on: Any = _never  # torch.is_grad_enabled: a forward without it is no training step's
        self._eval_step = -1  # the last step an evaluation was marked in
        self._queue_callback: Any = None
        self._module_cls: Any = None
        self.event: Any = None  # torch.cuda.Event on CUDA
        self._stream: Any = None  # current stream of the rank's device, on CUDA

    def install(self, ctx: AgentContext, steps: StepCollector | None) -> None:
        import torch

        self.ctx, self._steps = ctx, steps
        self.buffer.capacity = ctx.config.buffer_size
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available():
            self._dist_on = dist.is_initialized
        self._compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
        self._grad_on = torch.is_grad_enabled
        self._queue_callback = autograd.queue_callback()
        self._module_cls = torch.nn.Module
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        if getattr(ctx.device, "type", "") == "cuda":  # the rank's device (hpar_agent.device)
            self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        self.root.checks = model_root.MAX_CHECKS
        if isinstance(ctx.model, torch.nn.Module):
            self._adopt(ctx.model, "attach(model)")
        else:
            watch.listen(self._on_source)
            if watch.wrapper() is not None:
                self._on_source("wrapper")
        self._patch_loader()

    def _patch_loader(self) -> None:
        cls = dataloader.iterator_class()
        if cls is None:
            return
        orig = cls.__next__
        put, steps = self.buffer.put, self._steps

        def __next__(it: Any) -> Any:
            if steps is not None and not steps.detailed:
                return orig(it)
            t0 = time.time_ns()
            try:
                return orig(it)
            finally:
                put((steps.count if steps is not None else 0, LOAD, t0, time.time_ns(), None))

        __next__._hpar_orig = orig  # type: ignore[attr-defined]
        cls.__next__ = __next__
        self._loader_patch = (cls, orig)

    def uninstall(self) -> None:
        watch.unlisten(self._on_source)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.root.remove()
        if self._loader_patch is not None:
            cls, orig = self._loader_patch
            if getattr(cls.__next__, "_hpar_orig", None) is orig:
                cls.__next__ = orig
            self._loader_patch = None

    # ------------------------------------------------------------------------------------ the model's root
    def _adopt(self, module: Any, how: str) -> None:
        """Time the forward and backward of ``module`` from now on (training thread, rare)."""
        self.root.take(module, how, self._step())
        self.forward_source = "module-hooks"
        device = self.ctx.device if self.ctx is not None else None
        try:
            on_cuda = next(module.parameters()).device.type == "cuda"
        except StopIteration:
            on_cuda = False
        if on_cuda and getattr(device, "type", "") == "cuda" and self.event is None:
            import torch

            self.event = torch.cuda.Event
            self._stream = functools.partial(torch.cuda.current_stream, device)

    def _on_source(self, kind: str) -> None:
        """``topology_watch``: a data-parallel wrapper was built; it is the root while none was found at
        an optimizer step, or when it wraps the root (FSDP wraps the blocks, then the whole model)."""
        if kind != "wrapper" or self.root.found_by not in ("", "wrapper"):
            return
        try:
            new = model_root.outermost(self.root.module, watch.wrapper())
            if new is not None and new is not self.root.module:
                self._adopt(new, "wrapper")
        except Exception as exc:
            self._error(exc)

    def _check_root(self, optimizer: Any, frame: Any) -> None:
        """At an optimizer step while the root is not settled (``model_root.Root.check``)."""
        root = self.root
        try:
            found = root.check(optimizer, frame, self._step(), self._module_cls)
            if found is not None:
                self._adopt(found, "optimizer step")
        except Exception as exc:
            root.checks = 0
            self._error(exc)
        finally:
            root.settle()

    # ------------------------------------------------------------------------------------ training thread
    def _error(self, exc: BaseException) -> None:
        if self.ctx is not None:
            self.ctx.record_error("anatomy", exc)

    def _step(self) -> int:
        steps = self._steps
        return steps.count if steps is not None else 0

    def _mark(self, step: int, code: int) -> None:
        """Append one timestamp (and on CUDA an event); never raises into the training loop."""
        try:
            ev = None
            if self.event is not None:
                ev = self.event(enable_timing=True)
                ev.record(self._stream())  # the rank's device's stream, not the thread's device 0
            self.buffer.put((step, code, time.time_ns(), 0, ev))
        except Exception as exc:
            self._error(exc)

    def _fwd_pre(self, module: Any, args: Any) -> None:
        steps = self._steps
        # compiling first: traced, the hook then reads nothing torch.compile would guard on (a guard on
        # ``detailed`` recompiles the model when the detail stride toggles it). Without grad (an
        # evaluation between steps) the forward is the time between steps, not the next step's forward,
        # and its step gets the detail whatever the stride: its phases say where that time went.
        if self._compiling():
            return
        if not self._grad_on():
            self._evaluating(steps)
            return
        if steps is not None and not steps.detailed:
            return
        self.root.fired = True
        self._mark(self._step(), FWD0)

    def _eval_pre(self, module: Any, args: Any) -> None:
        """On the module a wrapper root wraps: only its forwards without grad (an evaluation) count."""
        if not self._compiling() and not self._grad_on():
            self._evaluating(self._steps)

    def _evaluating(self, steps: StepCollector | None) -> None:
        step = self._step()
        if steps is not None and step != self._eval_step:  # once a step: an evaluation runs many
            self._eval_step, steps.detailed = step, True
            self.buffer.put((step, EVAL, time.time_ns(), 0, None))

    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        steps = self._steps
        if self._compiling() or (steps is not None and not steps.detailed) or not self._grad_on():
            return
        self._mark(self._step(), FWD1)
        try:
            # Tensor hooks, registered before FSDP/replicate's on the same output: tensor hooks run in
            # order, so our engine callback (the backward's end) is queued before their root
            # post-backward callback, whose gradient reduction then counts as communication.
            for t in _grad_outputs(out):
                t.register_hook(self._bwd_pre)
        except Exception as exc:  # never into the training loop
            self._error(exc)

    def _bwd_pre(self, grad_outputs: Any) -> None:
        self._mark(self._step(), BWD0)
        try:
            self._queue_callback(self._bwd_end)
        except Exception as exc:
            self._error(exc)

    def _bwd_end(self) -> None:
        self._mark(self._step(), BWD1)
        if self.event is None and self._dist_on():  # CPU clock: time DDP's wait (module docstring)
            try:
                self._queue_callback(self._sync_end)
            except Exception as exc:
                self._error(exc)

    def _sync_end(self) -> None:
        self._mark(self._step(), SYNC1)

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        steps = self._steps
        if steps is None:
            return
        oid = steps._optimizer_id
        if oid is not None and id(optimizer) != oid:
            return
        if self.root.checks:
            self._check_root(optimizer, sys._getframe(1))
        if steps.explicit or not steps.detailed:
            return
        self._mark(steps.count, OPT0)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """CUDA only: an event after the optimizer's kernels (the step collector's post-hook, installed
        first, has already counted the step); also after an undetailed step the next detailed one is
        measured from."""
        steps = self._steps
        if self.event is None or steps is None or steps.explicit or steps._optimizer_id != id(optimizer):
            return
        if not (steps.prev_detailed or steps.detailed):
            return
        self._mark(steps.count - 1, OPT1)
