"""Where torch builds the objects that say how a rank is parallel (verified on torch 2.11 and 2.13).

Each hook point is a method of a class, looked up when the object is built, so patching the class
catches every construction however the program imported the name: ``DistributedDataParallel`` and
FSDP1's ``FullyShardedDataParallel`` (the wrapper itself), the state ``init`` of FSDP2's
``fully_shard`` and of the composable ``replicate`` (the module it was applied to: the parameters are
sharded right after, on the agent thread's next pass they are DTensors) and ``DeviceMesh``. Modules
are named, never imported here: the watcher patches a class once its module has been imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HookPoint:
    """``module.cls.method``: after it returns, ``source(self, args)`` is what was built (a module
    that parallelizes, or a mesh)."""

    module: str
    cls: str
    method: str
    kind: str  # "wrapper" | "mesh"
    source: Callable[[Any, tuple[Any, ...]], Any]


def _self(obj: Any, args: tuple[Any, ...]) -> Any:
    return obj


def _first_module(obj: Any, args: tuple[Any, ...]) -> Any:
    """FSDP2/replicate ``state.init(modules, device, ...)``: the module ``fully_shard`` was given
    (the last call of a program is its root)."""
    modules = args[0] if args else None
    if isinstance(modules, (tuple, list)) and modules:
        return modules[0]
    return None


HOOK_POINTS = (
    HookPoint("torch.nn.parallel.distributed", "DistributedDataParallel", "__init__", "wrapper", _self),
    HookPoint("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "__init__",
              "wrapper", _self),
    HookPoint("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "init", "wrapper", _first_module),
    HookPoint("torch.distributed._composable.replicate_with_fsdp", "_ReplicateState", "init", "wrapper",
              _first_module),
    HookPoint("torch.distributed.device_mesh", "DeviceMesh", "__init__", "mesh", _self),
)  # fmt: skip
#: The modules that define ``init_process_group`` (``torch.distributed`` re-exports c10d's).
PROCESS_GROUP_MODULES = ("torch.distributed.distributed_c10d", "torch.distributed")


def mesh_size(mesh: Any) -> int | None:
    """Ranks in ``mesh`` (None when torch moved the name)."""
    try:
        return int(mesh.size())
    except Exception:
        return None


def has_default_group() -> bool:
    """Whether the default process group exists (False without torch.distributed)."""
    return world_size() is not None


def world_size() -> int | None:
    """Ranks in the default process group; None before it exists."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:
        pass
    return None
