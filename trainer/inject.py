"""Failure injections: each reproduces its problem for real, with no monitoring involved.

See config.INJECTIONS for what each one does; the model calls ``Block.inject_hook`` inside the
compiled region, everything else is a hook installed here.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .config import TrainConfig
from .data import DataSource, SlowData
from .metrics import RankRecorder
from .model import GPT, Block


def _leaky_graph(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """compile-leak's per-microbatch function: every copy of its code object compiles a new graph."""
    return x.float().mean() + buf.mean()


def compile_fresh(x: torch.Tensor, buf: torch.Tensor) -> Any:
    """Compile and run a new copy of ``_leaky_graph`` (a new code object: dynamo compiles it afresh)."""
    leaky = types.FunctionType(_leaky_graph.__code__.replace(), _leaky_graph.__globals__, "_leaky_graph")
    fn = torch.compile(leaky, backend="eager")
    fn(x, buf)
    return fn


def _recompile_storm(block: Block, h: torch.Tensor) -> torch.Tensor:
    # Dynamo treats int attributes of nn.Modules as static: every new step value fails a guard -> recompile.
    return h + 0.0 * block.inject_tag


def _graph_break(block: Block, h: torch.Tensor) -> torch.Tensor:
    if h.detach().float().abs().mean().item() > 1e9:  # .item() + data-dependent branch: graph break
        h = h * 0.5
    return h


def _divergent_graph(block: Block, h: torch.Tensor) -> torch.Tensor:
    return h + torch.zeros_like(h)


def _chain(hooks: tuple[Any, ...], block: Block, h: torch.Tensor) -> torch.Tensor:
    """Several in-graph injections at once (e.g. recompile-storm with graph-break)."""
    for hook in hooks:
        h = hook(block, h)
    return h


def _bf16_same_bytes_hook(group: dist.ProcessGroup, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """bf16 compression sent as a message of the fp32 bucket's byte size (the bf16 values, then zeros).

    Neither gloo nor NCCL checks dtypes: with equal byte counts the reduction completes and every rank
    reads its peers' bytes in its own dtype, so the gradients are silently corrupted (the realistic
    outcome of a rank whose mixed-precision setting drifted). The flight recorder still records each
    rank's own dtype and element count, which is what CollectiveMismatch compares.
    """
    buf = bucket.buffer()
    packed = torch.zeros(
        max(buf.numel(), buf.numel() * buf.element_size() // 2), dtype=torch.bfloat16, device=buf.device
    )
    packed[: buf.numel()] = buf / group.size()

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buf.copy_(fut.value()[0][: buf.numel()])
        return buf

    return dist.all_reduce(packed, group=group, async_op=True).get_future().then(decompress)  # type: ignore[union-attr]


class _KeepLocalShard:
    """hsdp-replicate-skip on one FSDP module: the reduce-scatter (over dp_shard) runs as usual and its
    output is kept; after the replicate-dimension all-reduce, the all-reduce hook puts the kept output
    back. Every rank still makes the same collective calls (nothing hangs, FR stays aligned), but this
    rank's gradient shards miss their replicas' contributions and its parameters drift from them."""

    def __init__(self, live: Any) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self.live = live
        self.kept: torch.Tensor | None = None
        keeper = self

        class KeepingReduceScatter(DefaultReduceScatter):
            def __call__(
                self,
                output_tensor: torch.Tensor,
                input_tensor: torch.Tensor,
                group: Any,
                op: Any,
                async_op: bool = False,
            ) -> Any:
                work = super().__call__(output_tensor, input_tensor, group, op, async_op)
                keeper.kept = (
                    output_tensor.clone() if keeper.live() else None
                )  # same stream: ordered after RS
                return work

        self.reduce_scatter = KeepingReduceScatter()

    def all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        if self.kept is not None:
            reduce_output.copy_(self.kept)
            self.kept = None


class Injector:
    """Installs the configured injections on this rank and drives their per-step state."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        recorder: RankRecorder,
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")  # leaks live where the model lives (NVML sees them)
        self.cfg, self.rank, self.rec = cfg, rank, recorder
        self.names = set(cfg.inject)
        self.on_rank = bool(cfg.inject) and rank == cfg.injected_rank(world_size)
        self.step = 0
        self._kept: list[Any] = []
        self._slept_this_step = False
        self._breaking = False

    def _live(self, name: str, rank_specific: bool = True) -> bool:
        return (
            name in self.names and (self.on_rank or not rank_specific) and self.step >= self.cfg.inject_step
        )

    # --- build time -------------------------------------------------------------------------
    def prepare_blocks(self, part: GPT) -> None:
        """Set the in-graph hooks before the blocks are compiled (graph-break's from --inject-step)."""
        self._set_block_hooks(part, graph_break=False)

    def _set_block_hooks(self, part: GPT, *, graph_break: bool) -> None:
        named = [("recompile-storm", _recompile_storm), ("graph-break", _graph_break)]
        hooks = [fn for name, fn in named if name in self.names and (graph_break or name != "graph-break")]
        if "divergent-graph" in self.names and self.on_rank:
            hooks.append(_divergent_graph)
        hook = None if not hooks else hooks[0] if len(hooks) == 1 else functools.partial(_chain, tuple(hooks))
        for block in part.layers.values():
            block.inject_hook = hook  # type: ignore[assignment]

    def install_forward_hooks(self, part: nn.Module) -> None:
        """Straggler and compile-leak act on the stage's (unwrapped) forward."""
        if self.on_rank and self.names & {"straggler", "compile-leak"}:
            part.register_forward_pre_hook(self._pre_forward)

    @contextlib.contextmanager
    def outside_dp(self, part: GPT) -> Iterator[None]:
        """ddp-nesting: detach the stage's first block while DP wraps it, then re-attach it."""
        if "ddp-nesting" not in self.names:
            yield
            return
        blocks = dict(part.layers.items())
        first = next(iter(blocks))
        del part.layers[first]
        yield
        part.layers = nn.ModuleDict(blocks)

    def install_comm_hook(self, ddp: nn.Module, group: dist.ProcessGroup) -> None:
        """dtype-mismatch / slow-collective act inside the DDP gradient all-reduce of the dp group."""
        if not self.names & {"dtype-mismatch", "slow-collective"}:
            return

        def hook(_, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations here
            if self._live("slow-collective"):
                time.sleep(self.cfg.inject_delay)
            bf16 = self._live("dtype-mismatch")
            dtype = str(torch.bfloat16 if bf16 else bucket.buffer().dtype)
            if self.rec.current.get("reduce_dtype") != dtype:
                self.rec.current["reduce_dtype"] = dtype
                self.rec.data["last_reduce_dtype"] = dtype
                self.rec.flush()  # recorded before the reduction that corrupts the step
            t0 = time.perf_counter()
            fut = (_bf16_same_bytes_hook if bf16 else default_hooks.allreduce_hook)(group, bucket)

            def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                self.rec.current["dp_wait_s"] = (
                    self.rec.current.get("dp_wait_s", 0.0) + time.perf_counter() - t0
                )
                return f.value()

            return fut.then(done)

        ddp.register_comm_hook(None, hook)  # type: ignore[operator]

    def install_fsdp_hooks(self, part: nn.Module) -> None:
        """hsdp-replicate-skip: on the inject rank, every FSDP module of the part keeps its local shard."""
        if not ("hsdp-replicate-skip" in self.names and self.on_rank):
            return
        from torch.distributed.fsdp import FSDPModule

        for module in part.modules():
            if isinstance(module, FSDPModule):
                keep = _KeepLocalShard(lambda: self._live("hsdp-replicate-skip"))
                module.set_custom_reduce_scatter(keep.reduce_scatter)
                module.set_all_reduce_hook(keep.all_reduce_hook)
                self._kept.append(keep)

    def data_source(self, data: DataSource) -> DataSource:
        """slow-data: the inject rank's batches come from a loader that cannot keep up."""
        if "slow-data" in self.names and self.on_rank:
            return SlowData(data, self.cfg.inject_delay, self.cfg.inject_step)
        return data

    # --- run time ---------------------------------------------------------------------------
    def before_step(self, step: int, parts: list[GPT]) -> None:
        self.step = step
        self._slept_this_step = False
        if self._live("graph-break", rank_specific=False) and not self._breaking:
            self._breaking = True  # a new hook: the blocks recompile and break from this step on
            for part in parts:
                self._set_block_hooks(part, graph_break=True)
        if self._live("recompile-storm", rank_specific=False):
            for part in parts:
                for block in part.layers.values():
                    block.inject_tag = step  # type: ignore[assignment]
        if self._live("tensor-leak"):
            self._kept.append(torch.ones(self.cfg.inject_size // 4, device=self.device))
            self.rec.data["leaked_bytes"] += self.cfg.inject_size

    def hangs(self, step: int) -> bool:
        return "hang" in self.names and self.on_rank and step == self.cfg.inject_step

    def skip_tp_grad_sync(self) -> bool:
        return "tp-grad-skip" in self.names

    def _pre_forward(self, _: nn.Module, args: tuple[Any, ...]) -> None:
        if self._live("straggler") and not self._slept_this_step:
            self._slept_this_step = True
            time.sleep(self.cfg.inject_delay)
        if self._live("compile-leak"):
            # The PP x compile-cache leak: a fresh compiled function per microbatch that stays alive.
            # A new code object (same file:line) has an empty dynamo cache, so every microbatch compiles
            # a new graph (a new frame id: no recompile limit stops it) and the schedule keeps it.
            buf = torch.ones(self.cfg.inject_size // 4, device=self.device)
            fn = compile_fresh(args[0].detach(), buf)
            self._kept.append((fn, buf))  # keeps the callable, its dynamo cache entry and graph, and buf
            self.rec.data["leaked_bytes"] += self.cfg.inject_size
            self.rec.data["leaked_graphs"] = self.rec.data.get("leaked_graphs", 0) + 1
