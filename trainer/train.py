"""Training entry point: process group, mesh, model parts, loop, summary."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from hpar_agent.safefiles import write_atomic

from .config import TrainConfig, parse_args
from .data import MarkovData, loader
from .inject import Injector
from .metrics import RankRecorder
from .model import GPT, ModelArgs, build_model
from .parallelize import parallelize, sync_tp_replicated_grads
from .pipeline import build_schedule, split_stage, stage_ids

log = logging.getLogger("hpar_trainer")


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


#: NCCL settings that make a hung collective end the job (set unless the environment already has them).
NCCL_TEARDOWN = {
    # 3 = on a timed-out or failed collective the watchdog takes the process down without aborting the
    # communicator: ncclCommAbort can itself hang while kernels of the stuck collective spin on the GPU.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # wait() stays non-blocking: with blocking wait a timeout raises only in a thread that waits, and
    # DDP/replicate bucket all-reduces are waited inside autograd, where no error reaches the loop; the
    # watchdog sees every Work against its timeout either way.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # keep the flight-recorder dump of a timeout, but bound how long the watchdog waits for it
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "5000",
    # the heartbeat monitor ends a process whose watchdog is itself stuck (e.g. in a CUDA call while
    # handling the timeout): after 20 s, not the default 8 minutes
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "20",
}


def configure_nccl_teardown(inject: bool) -> None:
    """Before init_process_group (ProcessGroupNCCL reads these once, when it is created): a hang ends
    within the pg timeout plus the dump wait, on every rank. The pg timeout itself reaches every group
    (apply_pg_timeout). Injected runs also write no core file: a CUDA process's core can take minutes."""
    for key, value in NCCL_TEARDOWN.items():
        os.environ.setdefault(key, value)
    if inject:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def init_distributed(cfg: TrainConfig) -> torch.device:
    """Start the process group (torchrun env://, or a one-rank group for a plain process)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    timeout = datetime.timedelta(seconds=cfg.pg_timeout)
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
        configure_nccl_teardown(bool(cfg.inject))
    else:
        torch.set_num_threads(1)  # ranks share the cores; more threads make TP blocks much slower
        device, backend = torch.device("cpu"), "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def build_mesh(cfg: TrainConfig, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """(dp, pp, tp); fsdp: torchtitan's names (dp_replicate, dp_shard, pp, tp) with ``dp`` flattened
    from the first two (data sharding and the loss mean use it, FSDP uses the 2-D or dp_shard one).
    Returns (mesh, dp mesh)."""
    if cfg.dp_mode != "fsdp":
        mesh = init_device_mesh(device.type, (cfg.dp, cfg.pp, cfg.tp), mesh_dim_names=("dp", "pp", "tp"))
        return mesh, mesh["dp"]
    mesh = init_device_mesh(
        device.type,
        (cfg.dp_replicate, cfg.dp_shard, cfg.pp, cfg.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "pp", "tp"),
    )
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")  # private; what torchtitan does


def apply_pg_timeout(mesh: DeviceMesh, seconds: float) -> None:
    """--pg-timeout for the mesh's groups too: torch gives new groups its 30-minute default, so a rank
    stuck in a dp or tp collective would otherwise outlive the default group's timeout by far."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # private; torch >= 2.3
    if set_timeout is None:
        return
    for name in mesh.mesh_dim_names or ():
        try:
            set_timeout(datetime.timedelta(seconds=seconds), mesh[name].get_group())
        except (AssertionError, RuntimeError, ValueError) as exc:
            log.debug("--pg-timeout not applied to the %s group: %s", name, exc)


#: Mesh dims that data parallelism shards parameters over: every rank still computes the whole model.
DP_DIMS = frozenset({"dp", "dp_replicate", "dp_shard"})


def model_flops_per_token(model_parts: list[nn.Module]) -> float:
    """Training FLOPs this rank spends per token it processes: 6 x its parameters (forward 2, backward 4).
    TP shards and PP stages count only what this rank holds; FSDP/HSDP shards count whole, since each rank
    gathers them and computes the full layer. The usual dense estimate: it leaves out attention's
    sequence-length term, so MFU reads slightly low for long sequences."""
    n = 0.0
    for part in model_parts:
        for p in part.parameters():
            if not isinstance(p, DTensor):  # a plain tensor: what this rank holds is what it computes with
                n += p.numel()
                continue
            mesh, split = p.device_mesh, 1  # a DTensor: its global numel, divided by the non-dp shards
            names = mesh.mesh_dim_names or ()
            for i, placement in enumerate(p.placements):
                if placement.is_shard() and (names[i] if i < len(names) else "") not in DP_DIMS:
                    split *= mesh.size(i)
            n += p.numel() / split
    return 6.0 * n


def attach_observability(
    cfg: TrainConfig,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    schedule: Any,
) -> Any:
    """Attach the hpar_agent to the built model (unless --no-agent); it must never stop training."""
    if cfg.no_agent:
        return None
    try:
        import hpar_agent

        agent = hpar_agent.attach(model_parts[0], optimizer=optimizer, mesh=mesh)
        if schedule is not None:
            agent.watch_pipeline(schedule=schedule)
        agent.report_flops(
            per_token=model_flops_per_token(model_parts),
            peak=cfg.peak_tflops * 1e12 if cfg.peak_tflops > 0 else None,
        )
        return agent
    except ValueError:
        raise  # a bad explicit setting: the user must fix it
    except Exception:
        log.exception("attaching hpar_agent failed; training continues without it")
        return None


def detach_observability(timeout: float = 15.0) -> None:
    """Flush the agent (traces, summary) in bounded time, also after a failed collective."""
    try:
        import hpar_agent
    except ImportError:
        return
    worker = threading.Thread(target=hpar_agent.detach, name="hpar-detach", daemon=True)
    worker.start()
    worker.join(timeout)


class Trainer:
    """Builds the rank's model parts (one per owned stage) and runs the steps."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.mesh, self.dp_mesh = build_mesh(cfg, device)
        apply_pg_timeout(self.mesh, cfg.pg_timeout)
        apply_pg_timeout(self.dp_mesh, cfg.pg_timeout)
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.is_last_pp = self.pp_rank == cfg.pp - 1
        self.is_log_rank = self.is_last_pp and self.dp_rank == 0 and self.tp_rank == 0
        coords = {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}
        self.rec = RankRecorder(cfg.out, self.rank, coords)
        self.injector = Injector(cfg, self.rank, world, self.rec, device)
        self.agent: Any = None  # set by attach_observability
        self.data = self.injector.data_source(
            MarkovData(vocab=cfg.vocab, seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=cfg.seed)
        )
        self.batches = loader(self.data, self.dp_rank, cfg.dp)
        self._build()

    def _build(self) -> None:
        cfg = self.cfg
        args = ModelArgs(
            vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads, layers=cfg.layers, seq_len=cfg.seq_len
        )
        full = build_model(args, cfg.seed).to(
            self.device, torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
        )
        self.stages = stage_ids(self.pp_rank, cfg) if cfg.pp > 1 else [0]
        self.parts: list[GPT] = (
            [split_stage(full, s, cfg.num_stages) for s in self.stages] if cfg.pp > 1 else [full]
        )
        self.modules: list[nn.Module] = []
        for part in self.parts:
            self.rec.forward_timer(part)
            self.injector.install_forward_hooks(part)
            self.modules.append(
                parallelize(
                    part, self.mesh, cfg, self.injector, self.rec.compile_stats, self.device, self.dp_mesh
                )
            )
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, foreach=False)
        self.schedule = (
            build_schedule(self.modules, self.stages, cfg, self.mesh, self.device, loss_fn)
            if cfg.pp > 1
            else None
        )
        self.has_first = 0 in self.stages
        self.has_last = cfg.num_stages - 1 in self.stages

    def step(self, step: int) -> float | None:
        """One optimizer step; returns the dp-mean loss on last-stage ranks, None elsewhere."""
        x, y = (
            t.to(self.device) for t in next(self.batches)
        )  # the batch of ``step``: the loader yields them in order
        self.optimizer.zero_grad(set_to_none=True)
        if self.schedule is None:
            loss = loss_fn(self.modules[0](x), y)
            loss.backward()
            local = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            args = (x,) if self.has_first else ()
            if self.has_last:
                self.schedule.step(*args, target=y, losses=losses)
            else:
                self.schedule.step(*args)
            local = torch.stack(losses).mean().detach() if self.has_last else None  # type: ignore[assignment]
        if self.cfg.tp > 1 and not self.injector.skip_tp_grad_sync():
            sync_tp_replicated_grads(self.parts, self.mesh["tp"].get_group())
        if self.agent is not None:
            self.agent.report_tokens(self.cfg.global_batch // self.cfg.dp * self.cfg.seq_len)
        self.optimizer.step()
        if local is None:
            return None
        # Loss is a logging value only: mean over the dp replicas of the last stage (same tp/pp coords).
        total = local.float().clone()
        if self.cfg.dp > 1:
            dist.all_reduce(total, group=self.dp_mesh.get_group())
        return float(total) / self.cfg.dp

    def pause(self) -> None:
        """--pause-at: a checkpoint-like stall. Every rank stages a copy of its parameters; rank 0, the
        writer, holds it for --pause-seconds while the others go on and wait for it in the next
        collective; then the copy is freed."""
        with torch.no_grad():
            staged = [p.detach().clone() for m in self.modules for p in m.parameters()]
        if self.rank == 0:
            log.info(
                "rank 0: checkpoint-like pause of %.1fs before step %d",
                self.cfg.pause_seconds,
                self.cfg.pause_at,
            )
            time.sleep(self.cfg.pause_seconds)
        del staged

    def run(self) -> list[float | None]:
        losses: list[float | None] = []
        if self.rank == self.cfg.start_delay_rank and self.cfg.start_delay > 0:
            log.info("rank %d: starting %.1fs late", self.rank, self.cfg.start_delay)
            time.sleep(self.cfg.start_delay)  # a slow start (data, a late node): the peers wait in step 0
        for step in range(self.cfg.steps):
            self.rec.begin_step(step)
            self.injector.before_step(step, self.parts)
            if step == self.cfg.pause_at:
                self.pause()
            t0 = time.perf_counter()
            if self.injector.hangs(step):
                log.warning("rank %d: injected hang: skipping step %d's collectives", self.rank, step)
                dist.barrier()  # the peers are inside step collectives: nobody completes
            loss = self.step(step)
            dt = time.perf_counter() - t0
            losses.append(loss)
            self.rec.end_step(dt, loss)
            if self.is_log_rank and (step % self.cfg.log_every == 0 or step == self.cfg.steps - 1):
                log.info("step %d loss %.4f step_time %.3fs", step, loss, dt)
        self.rec.finish(self.parts)  # type: ignore[arg-type]
        return losses

    def write_summary(self, losses: list[float | None]) -> None:
        """Rank 0 writes --out with the log rank's losses (one object broadcast at the end)."""
        names = self.mesh.mesh_dim_names or ()
        log_rank = int(self.mesh.mesh[tuple(self.cfg.pp - 1 if n == "pp" else 0 for n in names)])
        box = [losses]
        dist.broadcast_object_list(box, src=log_rank)
        if self.rank == 0 and self.cfg.out:
            summary = {
                "config": self.cfg.to_dict(),
                "world_size": dist.get_world_size(),
                "losses": box[0],
                "step_times": [s["step_s"] for s in self.rec.data["steps"]],
                "step_starts": [s["t0"] for s in self.rec.data["steps"]],
            }  # wall clock, s
            write_atomic(self.cfg.out, json.dumps(summary, indent=1).encode())  # 0600, as the agent's


class _Prefix(logging.Filter):
    """The logger's name before the message, unless the message starts with it already (the agent's
    lines read ``hpar_agent: ...`` on their own, without a logging setup)."""

    def filter(self, record: logging.LogRecord) -> bool:
        named = record.getMessage().startswith(f"{record.name}: ")
        record.prefix = "" if named else f"{record.name}: "
        return True


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(prefix)s%(message)s", stream=sys.stdout)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Prefix())
    device = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, device)
        trainer.agent = attach_observability(
            cfg, trainer.modules, trainer.optimizer, trainer.mesh, trainer.schedule
        )
        losses = trainer.run()
        trainer.write_summary(losses)
        detach_observability()
    except Exception as e:
        traceback.print_exc()
        sys.stderr.write(
            f"hpar-train: rank {dist.get_rank()}: error: {type(e).__name__}: {str(e).splitlines()[0]}\n"
        )
        detach_observability()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # never block in process-group teardown after a failed collective
    dist.destroy_process_group()
    return 0
