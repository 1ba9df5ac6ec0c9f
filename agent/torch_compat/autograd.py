"""The autograd engine's ``queue_callback`` (verified on torch 2.11 CUDA and 2.13 CPU).

``torch.autograd.Variable._execution_engine.queue_callback(fn)``, called from inside a backward (a
tensor hook), runs ``fn`` once that backward has finished: its end without a synchronization, as DDP
marks it. Private, with no public twin; where torch moves it, ``queue_callback`` raises at install and
the component that needs it reports ``up=0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def queue_callback() -> Callable[[Callable[[], Any]], None]:
    """The engine's ``queue_callback``, looked up once (at install: a hook calls the bound method)."""
    import torch

    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    fn: Callable[[Callable[[], Any]], None] | None = getattr(engine, "queue_callback", None)
    if fn is None:
        raise RuntimeError("this torch has no autograd engine queue_callback: backward ends are not marked")
    return fn
