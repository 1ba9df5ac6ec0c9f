"""Run a copy of the user's model on fake tensors (``torch._subclasses.fake_tensor``, private): the MFU
collector counts a torch.compile'd model's FLOPs this way, off the training thread, with no real work.

The copy shares nothing the training thread changes: each module is copied shallowly with its own
parameter, buffer and child dicts (fake tensors of the same shape, dtype and device), no hooks (the
agent's, the user's, DDP's), and no compiled call (``Module.compile()``'s ``_compiled_call_impl``); a
torch.compile wrapper (``OptimizedModule``) and a DDP wrapper are replaced by the module they wrap.
Running the original compiled code under the counter's dispatch modes would recompile it (dynamo
guards on them); the copy never enters dynamo. A parameter that is a tensor subclass (a DTensor of
tensor parallelism or FSDP2, FSDP's FlatParameter) is refused: its ops would go over the process groups.
An op of a process group inside the forward raises instead of running (a collective from the agent
thread would desynchronise the ranks). The counter runs without its per-module tracking, whose global
module hooks the training thread would run meanwhile. Checked on torch 2.13 (CPU).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

#: Operator namespaces of process-group work: refused during the fake run.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})


class Refused(RuntimeError):
    """The model cannot be run on fake tensors (the reason is the message)."""


def unwrap(module: Any) -> Any:
    """The module a torch.compile or DDP wrapper runs (repeatedly), else ``module``."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    for _ in range(8):
        inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is None and isinstance(module, ddp):
            inner = module.module
        if inner is None:
            return module
        module = inner
    return module


def is_compile_wrapper(module: Any) -> bool:
    """Whether ``module`` is torch.compile's wrapper (``OptimizedModule``): its hooks run outside dynamo."""
    return "_orig_mod" in getattr(module, "__dict__", {}).get("_modules", {})


def compiled_call(module: Any) -> Any:
    """The compiled call ``Module.compile()`` gave ``module`` itself (its hooks then run inside dynamo's
    graph), or None."""
    return getattr(module, "__dict__", {}).get("_compiled_call_impl")


def record_compiled_calls(module: Any, record: Callable[[Any, Any, Any], None]) -> Callable[[], None]:
    """Have ``record(module, args, kwargs)`` see each call of ``module``'s compiled call, outside dynamo
    (``Module.__call__`` reads the attribute before entering the compiled code, which stays as it is);
    returns what puts the compiled call back."""
    fn = compiled_call(module)

    def call(*args: Any, **kwargs: Any) -> Any:
        record(module, args, kwargs)
        return fn(*args, **kwargs)

    module.__dict__["_compiled_call_impl"] = call

    def undo() -> None:
        if module.__dict__.get("_compiled_call_impl") is call:
            module.__dict__["_compiled_call_impl"] = fn

    return undo


def has_compiled(module: Any) -> bool:
    """Whether ``module`` or a module inside it is compiled (a torch.compile wrapper, or
    ``Module.compile()``): true even when dynamo took every graph from its cache and compiled none."""
    return any(is_compile_wrapper(m) or compiled_call(m) is not None for m in module.modules())


def has_sharded(module: Any) -> bool:
    """Whether a parameter of ``module`` is a tensor subclass (a DTensor of tensor parallelism or FSDP2,
    FSDP's FlatParameter): torch's flop counter sees a DTensor's global shape, not this rank's work."""
    import torch

    return any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in module.parameters())


def _check_plain(tensors: Iterable[Any]) -> None:
    import torch

    for t in tensors:
        if t is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise Refused(
                f"a parameter or buffer of type {type(t).__name__} (sharded over the process groups)"
            )


def fake_copy(module: Any, fake: Any) -> Any:
    """A copy of ``module``'s tree whose tensors are ``fake(t)``, without hooks or compiled calls."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    memo: dict[int, Any] = {}

    def clone(m: Any) -> Any:
        m = unwrap(m)
        if id(m) in memo:
            return memo[id(m)]
        if isinstance(m, FSDP):
            raise Refused(
                "an FSDP wrapper (FullyShardedDataParallel): a copy would share its flat-parameter "
                "state, which its forward changes under the training's backward"
            )
        _check_plain(m._parameters.values())
        _check_plain(m._buffers.values())
        c = copy.copy(m)
        memo[id(m)] = c
        d = c.__dict__
        for k, v in list(d.items()):
            if k.endswith("hooks") and isinstance(v, dict):
                d[k] = type(v)()
            elif isinstance(v, torch.Tensor):
                _check_plain([v])
                d[k] = fake(v)
        d["_compiled_call_impl"] = None
        d["_parameters"] = {k: None if p is None else fake(p) for k, p in m._parameters.items()}
        d["_buffers"] = {k: None if b is None else fake(b) for k, b in m._buffers.items()}
        d["_modules"] = {k: None if s is None else clone(s) for k, s in m._modules.items()}
        return c

    return clone(module)


def count_flops(module: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> float:
    """FLOPs (torch's flop counter) of the forward and backward of ``module`` for each recorded call,
    on a fake copy. ``calls`` hold (args, kwargs) with each tensor replaced by ``TensorSpec``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class NoCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace in COLLECTIVE_NAMESPACES:
                raise Refused(f"the forward calls {func} (a process-group op)")
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode()
    fakes: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        f = fakes.get(id(t))
        if f is None:
            f = fakes[id(t)] = mode.from_tensor(t)
        return f

    model = fake_copy(module, fake)
    counter = flop_counter()
    with mode, counter, NoCollectives(), torch.enable_grad():  # type: ignore[no-untyped-call]
        for args, kwargs in calls:
            out = model(*[_make(a) for a in args], **{k: _make(v) for k, v in kwargs.items()})
            roots = _grad_roots(out)
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    return float(counter.get_total_flops())


def flop_counter() -> Any:
    """torch's flop counter (``FlopCounterMode``) counting the total alone, which is all the agent reads.
    Its per-module tracker would add global module hooks while it is on, and with them a multi-grad hook
    on every module's inputs and outputs: ``torch.autograd.grad`` over a leaf input then raises ("A leaf
    node was passed to _will_engine_execute_node", pytorch#131753: a gradient penalty, a zero-bubble
    pipeline's input backward), and on the agent thread the training thread's modules would run them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModuleTracking()  # type: ignore[assignment]
    return counter


class _NoModuleTracking:
    """Stands in for the counter's per-module tracker (``flop_counter``): every op counts to Global."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class TensorSpec(tuple[tuple[int, ...], Any, Any, bool]):
    """(shape, dtype, device, requires_grad) of an input tensor: what the fake run rebuilds."""

    __slots__ = ()


def spec(value: Any) -> Any:
    """``value`` with a tensor replaced by its ``TensorSpec`` (top level only)."""
    import torch

    if isinstance(value, torch.Tensor):
        return TensorSpec((tuple(value.shape), value.dtype, value.device, value.requires_grad))
    return value


def _make(value: Any) -> Any:
    import torch

    if isinstance(value, TensorSpec):
        shape, dtype, device, grad = value
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)
    return value


def _grad_roots(out: Any) -> list[Any]:
    """The output tensors a backward starts from: the output, or the items of a tuple, list or mapping
    with a grad_fn (all in one backward: a node shared by two runs once)."""
    if getattr(out, "grad_fn", None) is not None:
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for t in items if getattr(t, "grad_fn", None) is not None]
