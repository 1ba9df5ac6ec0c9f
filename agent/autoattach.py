"""Zero-code mode, inside each process ``hpar-agent run`` starts: attach when the process trains.

The shim (``zerocode_site/sitecustomize.py``) wraps ``init_process_group`` as soon as c10d is imported
and calls ``arm`` once ``import torch`` completes. From then on the process attaches the agent (with the
``HPAR_*`` environment as its configuration) at the first of:

- ``init_process_group`` returned: the process is a rank (whatever created the group: torchrun's
  workers, ``mp.spawn`` children, Lightning's and accelerate's ranks, ``init_device_mesh``);
- with no process group, the first step of a ``torch.optim`` optimizer (a global step pre-hook; the
  agent attaches inside that step, before its post-hooks run, so the step is counted);
- the first compile (dynamo's start callback, registered once ``torch._dynamo`` is imported, never
  importing it; registered again after ``torch._dynamo.reset()``);
- the first ``hpar_agent.current()`` (a loop that marks its own steps);
- an uncaught CUDA out-of-memory before any of these (a batch far too large fails in the first
  forward, before any optimizer step): attached then, the agent records it (``collectors.oom``).

A process that does none of these (the torchrun or accelerate launcher, an ``mp.spawn`` parent that
only waits, DataLoader and compile workers) is never observed: no port, no rank label, no summary.
Children inherit zero-code mode. Each trigger tries once per process (again in a forked child).
Standard library, ``topology_watch`` and torch_compat adapters (standard library at import) only here:
every process that imports torch arms.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType
from typing import Any

from hpar_agent import topology_watch
from hpar_agent.torch_compat import dynamo

#: Trigger names (the summary's ``attached_at``).
AT_PROCESS_GROUP = "init_process_group"
AT_OPTIMIZER = "optimizer step"
AT_COMPILE = "compile"
AT_CURRENT = "hpar_agent.current()"
AT_OOM = "CUDA out of memory"

ARMED = False
_tried = False  # one attach attempt per process (a disabled or failed attach is not retried per step)
_hooks: list[Any] = []
_previous_hook: Any = sys.__excepthook__


def _running() -> Any:
    """The attached agent, without importing the agent module (O(1): the triggers' fast path)."""
    mod = sys.modules.get("hpar_agent.agent")
    return None if mod is None else mod.running()


def arm() -> None:
    """Install the triggers (idempotent); called by the shim once ``import torch`` completed."""
    global ARMED, _previous_hook
    if ARMED:
        return
    ARMED = True
    topology_watch.install("zerocode")  # a mesh or wrapper built as the process becomes a rank
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _hooks.append(register_optimizer_step_pre_hook(_on_optimizer_step))
    topology_watch.after_import(dynamo.MODULE, _arm_dynamo)
    _previous_hook, sys.excepthook = sys.excepthook, _on_uncaught
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)


def _forget_in_child() -> None:
    global _tried
    _tried = False  # the agent module drops the parent's agent itself


def attach_now(trigger: str) -> Any:
    """Attach the agent (configured by ``HPAR_*``) unless one is running; one attempt per process.
    Never raises: a failure is said in one line on stderr and the program goes on unobserved."""
    global _tried
    running = _running()
    if running is not None or _tried:
        return running
    _tried = True
    if _in_dataloader_worker():
        return None
    try:
        import hpar_agent
        from hpar_agent.collectors.zerocode import ZeroCode

        agent = hpar_agent.attach()
        if agent.started:
            agent.add_component(ZeroCode(trigger))
            agent.events.emit("autoattach", trigger=trigger)
        return agent
    except Exception as exc:  # never break the user's script
        print(
            f"hpar-agent: zero-code attach failed ({type(exc).__name__}: {exc}); not observing",
            file=sys.stderr,
        )
        return None


def _in_dataloader_worker() -> bool:
    """A DataLoader worker never trains, even when its dataset code compiles or steps something: it
    carries its parent's RANK, and would take the rank's files and port."""
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is not None
    except Exception:
        return False


def on_process_group() -> None:
    """The shim's ``init_process_group`` wrapper, after the group exists: attach, or (attached before
    the group existed) have the agent re-detect its topology."""
    if _running() is None:
        attach_now(AT_PROCESS_GROUP)
    else:
        topology_watch.notify("process_group")


# ------------------------------------------------------------------------------------------------ triggers
def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: O(1) once attached. Attaching here would register the agent's
    own optimizer hooks while torch iterates over them (a RuntimeError in the user's step), so it is
    deferred to the point every step passes between its update and its post-hooks (``optim.run_in_step``):
    the agent's step post-hook then sees this very step."""
    if _tried or _running() is not None:
        return
    try:
        import torch

        if torch.compiler.is_compiling():
            return
    except Exception:
        pass
    from hpar_agent.torch_compat import optim  # only once a step runs: a process that never trains loads less

    optim.run_in_step(optimizer, _attach_in_step)


def _attach_in_step() -> None:
    attach_now(AT_OPTIMIZER)


def _arm_dynamo(module: ModuleType) -> None:
    """Once ``torch._dynamo`` is imported: the compile start callback, and again after each reset
    (``torch._dynamo.reset()`` clears every callback)."""
    _register_compile_start()
    reset = getattr(module, "reset", None)
    if callable(reset) and not getattr(reset, "_hpar_autoattach", False):

        @functools.wraps(reset)
        def reset_then_rearm(*args: Any, **kwargs: Any) -> Any:
            out = reset(*args, **kwargs)
            if _running() is None and not _tried:
                _register_compile_start()
            return out

        reset_then_rearm._hpar_autoattach = True  # type: ignore[attr-defined]
        module.reset = reset_then_rearm  # type: ignore[attr-defined]


def _register_compile_start() -> None:
    dynamo.register_callbacks(_on_compile_start, None)


def _on_compile_start(args: Any) -> None:
    """Dynamo starts compiling a frame. Left registered once attached (removing a callback while dynamo
    iterates over them would skip the next one, the agent's own)."""
    if _tried or _running() is not None:
        return
    attach_now(AT_COMPILE)


def _on_uncaught(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook``: a process that dies of a CUDA out-of-memory before anything attached the
    agent attaches now, so the run says where the memory went (an attached agent's own hook records
    it before this one is reached)."""
    try:
        torch = sys.modules.get("torch")
        if (
            _running() is None
            and not _tried
            and torch is not None
            and isinstance(value, torch.OutOfMemoryError)
        ):
            agent = attach_now(AT_OOM)
            oom = agent.component("oom") if agent is not None and agent.started else None
            if oom is not None:
                oom.on_uncaught(value)
    except Exception as exc:  # the user's traceback is printed whatever happens here
        print(
            f"hpar-agent: recording the out-of-memory failed ({type(exc).__name__}: {exc})", file=sys.stderr
        )
    _previous_hook(tp, value, tb)


def attach_on_use() -> Any:
    """``hpar_agent.current()`` in an armed process: a loop that marks its own steps attaches."""
    return attach_now(AT_CURRENT) if ARMED else None
