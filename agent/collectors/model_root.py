"""Which module is the model, when ``attach()`` was given none (``hpar-agent run``, a bare ``attach()``).

The step anatomy times the forward and the backward with hooks on the model's root module. With no model
given, it takes the first of:

- a data-parallel wrapper the program builds (DDP, FSDP, ``fully_shard``, ``replicate``: the newest one
  ``topology_watch`` saw, moving outwards as FSDP wraps its blocks and then the root);
- at an optimizer step: the modules the training loop holds (the locals of the frames that called
  ``step()`` and the attributes of those locals, e.g. a trainer's ``self.model``, each also as the first
  items of a list or tuple) that hold one of the optimizer's parameters; of those the outermost, and of
  several apart the one holding most of the optimizer's parameters.

A root taken from a wrapper is kept when it holds one of the stepping optimizer's parameters; a root
whose forward never ran in a whole step (a container such as a ``ModuleDict``, a module the loop never
calls) is dropped and the search runs again without it. The search reads frames once per step for at
most ``MAX_CHECKS`` steps, on the training thread (linear in the frames' locals, the optimizer's
parameters and the candidates' modules, once or twice at the start), and installs no global module
hook: one would cost every submodule call a hook call and change what torch.compile guards on.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

MAX_FRAMES = 64  # frames above the optimizer's step read for the model
MAX_ITEMS = 8  # items of a list or tuple read (a pipeline rank's stages)
MAX_CHECKS = 4  # optimizer steps the root is looked for / confirmed on, then the anatomy goes on without


def param_ids(optimizer: Any) -> set[int]:
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())}


def holds(module: Any, ids: set[int]) -> bool:
    """Whether ``module`` holds one of the parameters ``ids`` names (stops at the first)."""
    return any(id(p) in ids for p in module.parameters())


def contains(outer: Any, inner: Any) -> bool:
    return outer is not inner and any(m is inner for m in outer.modules())


def outermost(current: Any, new: Any) -> Any:
    """``new`` when it wraps ``current`` (or there is no current), else ``current``."""
    return new if current is None or contains(new, current) else current


def _callable(module: Any, module_cls: type) -> bool:
    """Not a bare container (ModuleDict, ModuleList, ...): it has a forward of its own (torch.compile's
    wrapper sets one on the instance)."""
    forward = getattr(module, "forward", None)
    return getattr(forward, "__func__", forward) is not getattr(module_cls, "forward", None)


def candidates(frame: Any, module_cls: type, skip: Iterable[Any] = ()) -> list[Any]:
    """Modules the frames from ``frame`` outwards hold in their locals or one attribute down (also as
    the first items of a list or tuple: a trainer's ``self.model_parts``), nearest first, without
    duplicates and without those in ``skip``."""
    out: list[Any] = []
    seen = {id(m) for m in skip}

    def take(value: Any) -> None:
        for v in value[:MAX_ITEMS] if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, module_cls) and id(v) not in seen and _callable(v, module_cls):
                seen.add(id(v))
                out.append(v)

    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            take(value)
            attrs = getattr(value, "__dict__", None)
            # not into a Python module's namespace: torch.distributed's deprecated reduce_op warns when looked at
            if isinstance(attrs, dict) and not isinstance(value, (module_cls, type, types.ModuleType)):
                for attr in list(attrs.values()):
                    take(attr)
        frame = frame.f_back
    return out


def wrapped(module: Any) -> Any:
    """The module a wrapper wraps (DDP, DataParallel, DeepSpeed's engine: its submodule
    ``module``, holding every parameter of the wrapper), else None: a model's own submodule of that name
    holds only some, and may run without grad inside a training step (a frozen encoder). Read from the
    wrapper's own submodules: ``torch.compile``'s wrapper forwards ``.module`` to the model it compiled."""
    try:
        inner: Any = vars(module).get("_modules", {}).get("module")
        if inner is None or inner is module:
            return None
        params = {id(p) for p in module.parameters()}
        return inner if params and params == {id(p) for p in inner.parameters()} else None
    except Exception:
        return None


def find_root(optimizer: Any, module_cls: type, skip: Iterable[Any] = (), frame: Any = None) -> Any:
    """The model the frames above hold whose parameters the optimizer steps, or None."""
    ids = param_ids(optimizer)
    holders = (
        [m for m in candidates(frame or sys._getframe(1), module_cls, skip) if holds(m, ids)] if ids else []
    )
    tops = [m for m in holders if not any(contains(o, m) for o in holders)]
    if len(tops) < 2:
        return tops[0] if tops else None
    return max(tops, key=lambda m: sum(1 for p in m.parameters() if id(p) in ids))  # the nearest of equals


class Root:
    """The root module the step anatomy times, how it was found, and the forward hooks on it.

    Training thread only (hooks, the optimizer's pre-hook, ``topology_watch``'s listeners)."""

    def __init__(self, fwd_pre: Any, fwd_post: Any, eval_pre: Any = None) -> None:
        self.fwd_pre, self.fwd_post = fwd_pre, fwd_post  # the anatomy's hooks, put on each root taken
        self.eval_pre = eval_pre  # on the module a wrapper root wraps: an evaluation may call it directly
        self.module: Any = None
        self.found_by = ""  # "attach(model)", "wrapper" or "optimizer step"
        self.class_name = ""
        self.fired = False  # its forward ran (outside torch.compile) since it was taken
        self.checks = 0  # optimizer steps left to find or confirm the root on (0: settled)
        self._handles: list[Any] = []
        self._silent: list[Any] = []  # of roots dropped without their forward ever running: see drop
        self._taken_at = 0  # the step it was taken at
        self._rejected: list[Any] = []  # roots whose forward never ran in a whole step

    def take(self, module: Any, how: str, step: int) -> None:
        """Time the forward and backward of ``module`` from now on (instead of the current root)."""
        self.drop(step)
        self._handles = [
            module.register_forward_pre_hook(self.fwd_pre, prepend=True),
            # prepended: its output hook must precede FSDP's/replicate's (see AnatomyHooks.fwd_post)
            module.register_forward_hook(self.fwd_post, prepend=True),
        ]
        # An evaluation through the wrapped module (``ddp.module(x)``, as the HF Trainer evaluates). Not on
        # a root found at an optimizer step: forwards ran, and code torch.compile traced through that module
        # would not run a hook added now (dynamo skips hook guards by default) or would recompile for it.
        inner = wrapped(module) if self.eval_pre is not None and how != "optimizer step" else None
        if inner is not None:
            self._handles.append(inner.register_forward_pre_hook(self.eval_pre))
        self.module, self.found_by, self.fired = module, how, False
        self.class_name = type(module).__name__
        self._taken_at = step

    def drop(self, step: int) -> None:
        """Stop timing the current root. Hooks that never ran in a whole step stay until detach, silent:
        they may sit inside code torch.compile traced with them, and removing them would recompile it."""
        if self.module is not None and not self.fired and self._taken_at != step:
            self._silent += self._handles
        else:
            for h in self._handles:
                h.remove()
        self._handles, self.module, self.found_by, self.class_name = [], None, "", ""

    def check(self, optimizer: Any, frame: Any, step: int, module_cls: type) -> Any:
        """At an optimizer step while not settled (``checks``): None to keep a root whose forward ran and
        that holds the optimizer's parameters (or was given to ``attach``), else the model the frames
        above hold (``find_root``) to take instead: a model given to ``attach`` but called only through a
        wrapper that runs its hooks inside torch.compile (``torch.compile(model)``) is timed at that
        wrapper. With nothing found a root not given to ``attach`` is dropped."""
        self.checks -= 1
        root = self.module
        if root is not None and not self.fired and self._taken_at == step:
            return None  # taken during this step: its forward runs from the next one
        given = self.found_by == "attach(model)"
        if root is not None and self.fired and (given or holds(root, param_ids(optimizer))):
            self.checks = 0  # confirmed
            return None
        if root is not None:
            self._rejected.append(root)
        found = find_root(optimizer, module_cls, self._rejected, frame)
        if found is None and root is not None and self.found_by != "attach(model)":  # the user's choice stays
            self.drop(step)
        return found

    def settle(self) -> None:
        """After a check: once settled, the rejected roots are not the agent's to keep alive."""
        if not self.checks:
            self._rejected.clear()

    def remove(self) -> None:
        """Every hook, silent ones included (detach); the user's model is not the agent's to keep alive."""
        for h in [*self._handles, *self._silent]:
            h.remove()
        self._handles.clear()
        self._silent.clear()
        self.module, self._rejected = None, []
