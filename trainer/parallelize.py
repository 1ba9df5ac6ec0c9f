"""Apply TP -> compile -> DP (DDP, replicate or FSDP2/HSDP) to one model part (a whole model or one
pipeline stage)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import TrainConfig
from .inject import Injector
from .model import GPT, Attention

log = logging.getLogger(__name__)

TP_PLAN = {
    "attn.wq": ColwiseParallel(),
    "attn.wk": ColwiseParallel(),
    "attn.wv": ColwiseParallel(),
    "attn.wo": RowwiseParallel(),
    "mlp.w_in": ColwiseParallel(),
    "mlp.w_out": RowwiseParallel(),
}


def _replicate_fn() -> tuple[Callable[..., Any], bool]:
    """Composable replicate: the FSDP2-based one (torch >= 2.11) or the older DDP-based one."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate, True
    except ImportError:
        from torch.distributed._composable import replicate  # type: ignore[no-redef]

        return replicate, False


_COMM_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "wait_tensor")


def _is_collective(target: Any) -> bool:
    name = str(getattr(target, "__name__", target))
    return any(c in name for c in _COMM_NAMES)


def counting_backend(name: str, stats: dict[str, int]) -> Callable[..., Any]:
    """Wrap a Dynamo backend so each rank can report how many graphs/ops it compiled, and how many of
    those ops are collectives (FSDP's all-gather/reduce-scatter must stay outside the graphs: 0)."""
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        stats["graphs"] += 1
        stats["ops"] += len(calls)
        # collectives traced into a graph (TP's functional ones, or FSDP's if its hooks were traced)
        stats["comm_ops"] = stats.get("comm_ops", 0) + sum(1 for n in calls if _is_collective(n.target))
        return inner(gm, example_inputs)

    backend.compiler_name = name  # type: ignore[attr-defined]  # the backend label the agent reports
    return backend


def parallelize(
    part: GPT,
    mesh: DeviceMesh,
    cfg: TrainConfig,
    injector: Injector,
    compile_stats: dict[str, int],
    device: torch.device,
    dp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """TP -> compile -> DP, the torchtitan order.

    TP first so compiled blocks trace the sharded (local-heads) computation; compile per block before
    DP so DP hooks stay outside the graphs (torch 2.13 DDP cannot take a whole compiled stage).
    fsdp: ``fully_shard`` each (compiled) block, then the part, on the ``dp_shard`` mesh (HSDP: the 2-D
    ``dp_replicate`` x ``dp_shard`` sub-mesh; with TP the blocks' DTensors become 2-D dp x tp ones).
    The block's all-gather (pre-forward) and reduce-scatter (post-backward) run in FSDP's module hooks,
    which Dynamo does not trace (``skip_fsdp_hooks``): communication stays between compiled regions.
    Inside a pipeline stage blocks keep their parameters unsharded between microbatches
    (``reshard_after_forward=False``); the schedule drives the last backward's reduce-scatter.
    Returns the module to call (a DDP wrapper in ddp mode, the part itself otherwise).
    """
    if cfg.tp > 1:
        for block in part.layers.values():
            parallelize_module(block, mesh["tp"], TP_PLAN)
    injector.prepare_blocks(part)
    if cfg.compile != "none":
        backend = counting_backend(cfg.compile, compile_stats)
        for block in part.layers.values():
            block.compile(backend=backend)
    if cfg.dp == 1:
        log.info("dp == 1: no data parallelism applied")
        return part
    dp_mesh = dp_mesh if dp_mesh is not None else mesh["dp"]
    with injector.outside_dp(part):
        if cfg.dp_mode == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            wrapped = DDP(part, process_group=dp_mesh.get_group(), device_ids=ids)
            injector.install_comm_hook(wrapped, dp_mesh.get_group())
            return wrapped
        if cfg.dp_mode == "fsdp":
            shard_part(part, mesh, cfg)
            injector.install_fsdp_hooks(part)
            return part
        replicate, fsdp_based = _replicate_fn()
        if fsdp_based:
            replicate(part, mesh=dp_mesh)
        else:
            replicate(part, process_group=dp_mesh.get_group())
    return part


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp_mesh(mesh: DeviceMesh, cfg: TrainConfig) -> DeviceMesh:
    """The mesh fully_shard shards over: ``dp_shard``, or (``dp_replicate``, ``dp_shard``) for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if cfg.dp_replicate > 1 else mesh["dp_shard"]


def mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy:
    """--mp-param-dtype / --mp-reduce-dtype (unset: no cast, FSDP's default)."""
    param = _DTYPES.get(cfg.mp_param_dtype)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_DTYPES.get(cfg.mp_reduce_dtype, param))


def shard_part(part: GPT, mesh: DeviceMesh, cfg: TrainConfig) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, head) as torchtitan does."""
    dp_mesh, mp = fsdp_mesh(mesh, cfg), mp_policy(cfg)
    reshard = cfg.pp == 1
    for block in part.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(part, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)


def sync_tp_replicated_grads(parts: list[GPT], tp_group: dist.ProcessGroup) -> None:
    """Sum the q/k-norm weight grads over tp: replicated params that only saw this rank's heads."""
    grads = []
    for part in parts:
        for m in part.modules():
            if isinstance(m, Attention):
                grads += [p.grad for p in (m.q_norm.weight, m.k_norm.weight) if p.grad is not None]
    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=tp_group)
    for g, chunk in zip(local, flat.split([g.numel() for g in local]), strict=True):
        g.copy_(chunk.view_as(g))
