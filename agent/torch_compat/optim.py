"""A call inside the optimizer step torch is running (verified on torch 2.11 CUDA and 2.13 CPU).

Every ``Optimizer.step`` (wrapped by ``Optimizer.profile_hook_step``) runs the global and per-optimizer
pre-hooks, the update, then ``self._optimizer_step_code()`` (a no-op the profiler hooks into), then the
post-hooks. An instance attribute of that name runs in its place once: code that must not run while
torch iterates over the pre-hooks (registering a hook there raises) runs there instead, and the step's
post-hooks still see this step. Where torch renames the method nothing is deferred.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_STEP_CODE = "_optimizer_step_code"


def run_in_step(optimizer: Any, fn: Callable[[], Any]) -> bool:
    """Run ``fn()`` once in ``optimizer``'s step now starting, between its update and its post-hooks
    (called from a step pre-hook). False, doing nothing, where this torch has no such point or a call
    is pending already."""
    if _STEP_CODE in vars(optimizer) or not hasattr(type(optimizer), _STEP_CODE):
        return False

    def step_code() -> None:
        vars(optimizer).pop(_STEP_CODE, None)
        try:
            fn()
        finally:  # torch's own step code runs whatever ``fn`` did
            getattr(type(optimizer), _STEP_CODE)(optimizer)

    setattr(optimizer, _STEP_CODE, step_code)
    return True
