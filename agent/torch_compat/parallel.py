"""Where torch builds the objects that say how a rank is parallel, and what the agent reads of them
(verified on torch 2.11 CUDA and 2.13 CPU).

Each hook point is a method of a class, looked up when the object is built, so patching the class
catches every construction however the program imported the name: ``DistributedDataParallel`` and
FSDP1's ``FullyShardedDataParallel`` (the wrapper itself), the state ``init`` of FSDP2's
``fully_shard`` and of the composable ``replicate`` (the module it was applied to: the parameters are
sharded right after, on the agent thread's next pass they are DTensors), ``DeviceMesh`` and the
pipelining stages and schedules (``torch_compat.pipelining``). Modules
are named, never imported here: the watcher patches a class once its module has been imported.

The readers below reach private names of those objects (the default store, a mesh's flattened dims,
FSDP2's mixed-precision policy, DDP's comm hooks, a DTensor's local shard); where torch moved one, each
reads as "none" (None, {}, []) and the agent reports less, never an error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpar_agent.torch_compat import pipelining


@dataclass(frozen=True)
class HookPoint:
    """``module.cls.method``: after it returns, ``source(self, args)`` is what was built (a module
    that parallelizes, or a mesh)."""

    module: str
    cls: str
    method: str
    kind: str  # "wrapper" | "mesh" | "stage"
    source: Callable[[Any, tuple[Any, ...]], Any]
    before: bool = False  # read the source before the method runs (a schedule's step may never return)


def _self(obj: Any, args: tuple[Any, ...]) -> Any:
    return obj


def _first_module(obj: Any, args: tuple[Any, ...]) -> Any:
    """FSDP2/replicate ``state.init(modules, device, ...)``: the module ``fully_shard`` was given
    (the last call of a program is its root)."""
    modules = args[0] if args else None
    if isinstance(modules, (tuple, list)) and modules:
        return modules[0]
    return None


#: The composable ``replicate`` (FSDP2-style).
REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"
HOOK_POINTS = (
    HookPoint("torch.nn.parallel.distributed", "DistributedDataParallel", "__init__", "wrapper", _self),
    HookPoint(
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "FullyShardedDataParallel",
        "__init__",
        "wrapper",
        _self,
    ),
    HookPoint(
        "torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "init", "wrapper", _first_module
    ),
    HookPoint(REPLICATE_MODULE, "_ReplicateState", "init", "wrapper", _first_module),
    HookPoint("torch.distributed.device_mesh", "DeviceMesh", "__init__", "mesh", _self),
    # a pipeline stage built after attach; a schedule's stages at its init or first step (a stage
    # built before attach)
    HookPoint(pipelining.STAGE_MODULE, pipelining.STAGE_BASE, "__init__", "stage", _self),
    *(
        HookPoint(pipelining.SCHEDULE_MODULE, cls, method, "stage", pipelining.stages_once, method == "step")
        for cls in pipelining.SCHEDULE_CLASSES
        for method in ("__init__", "step")
    ),
)
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


# ------------------------------------------------------------------------ what the agent reads of them
def default_store() -> Any:
    """The c10d store of the default process group (``distributed_c10d._get_default_store``); None
    before the group exists or where torch moved the name."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def flattened_meshes(mesh: Any) -> dict[str, Any]:
    """``{name: 1-D mesh}`` of the dims flattened from ``mesh`` (torchtitan's ``dp``, ``dp_shard_cp``):
    the root mesh's ``_flatten_mapping``; {} where there is none."""
    try:
        return dict(getattr(mesh, "_flatten_mapping", None) or {})
    except Exception:
        return {}


def fsdp_mixed_precision(module: Any) -> Any:
    """The ``MixedPrecisionPolicy`` of an FSDP2 module (``FSDPModule._get_fsdp_state()._mp_policy``);
    None for other modules or where torch moved the names."""
    state_fn = getattr(module, "_get_fsdp_state", None)
    if state_fn is None:
        return None
    try:
        return state_fn()._mp_policy
    except Exception:
        return None


def ddp_comm_hooks(module: Any) -> list[Any]:
    """The communication hooks registered on a ``DistributedDataParallel`` (``_comm_hooks``, a list of
    (hook, state)); [] for other modules or where torch moved the name."""
    try:
        return [hook for hook, _state in getattr(module, "_comm_hooks", None) or ()]
    except Exception:
        return []


def local_tensor(t: Any) -> Any:
    """A DTensor's local shard (``DTensor._local_tensor``: read without the autograd op that the public
    ``to_local()`` records); any other tensor as it is."""
    return getattr(t, "_local_tensor", t)


def is_shard(placement: Any) -> bool:
    """Whether a DTensor placement shards its dim: ``Shard`` or the ``_StridedShard`` that FSDP2 over TP
    places (by class name: the private class is never imported)."""
    return type(placement).__name__ in ("Shard", "_StridedShard")


def replicate_module_class() -> type | None:
    """``ReplicateModule``, the class the composable ``replicate`` gives the modules it was applied to,
    once the program imported it (None before, or where torch moved it)."""
    cls = getattr(sys.modules.get(REPLICATE_MODULE), "ReplicateModule", None)
    return cls if isinstance(cls, type) else None
