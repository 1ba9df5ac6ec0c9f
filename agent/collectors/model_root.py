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
            if isinstance(attrs, dict) and not isinstance(value, (module_cls, type)):
                for attr in list(attrs.values()):
                    take(attr)
        frame = frame.f_back
    return out


def find_root(optimizer: Any, module_cls: type, skip: Iterable[Any] = (), frame: Any = None) -> Any:
    """The model the frames above hold whose parameters the optimizer steps, or None."""
    ids = param_ids(optimizer)
    holders = [m for m in candidates(frame or sys._getframe(1), module_cls, skip) if holds(m, ids)] if ids else []
    tops = [m for m in holders if not any(contains(o, m) for o in holders)]
    if len(tops) < 2:
        return tops[0] if tops else None
    return max(tops, key=lambda m: sum(1 for p in m.parameters() if id(p) in ids))  # the nearest of equals
