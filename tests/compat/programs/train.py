"""A tiny DDP job started every way torch offers.

``python train.py MODE [options]``, MODE:

- ``env``: a rank whose launcher set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun,
  or srun/mpirun through a wrapper);
- ``spawn``: this process starts 2 ranks with ``torch.multiprocessing.spawn`` and only waits (the PyTorch
  DDP tutorial);
- ``start_processes``: the same with ``torch.multiprocessing.start_processes(start_method="spawn")``;
- ``process``: the same with two ``multiprocessing.Process`` (fork, the start method's default here);
- ``single``: one process, no process group.

Options: ``--steps N``, ``--compile BACKEND`` (torch.compile the model), ``--leak-mib M`` (from step 3
keep M MiB of host memory alive per step; ``--leak-rank R``: on rank R only), ``--slow-rank R
--slow-s S`` (rank R sleeps S seconds per step), ``--step-s S`` (every rank sleeps S per step), ``--attach`` (the program's only mention of
hpar_agent: ``attach(model, optimizer=opt)`` once the model is wrapped). Each rank writes
``result.rank<R>.json`` into ``$COMPAT_OUT`` (``_result``).
"""

import argparse
import multiprocessing
import os
import socket
import time

import torch
import torch.distributed as dist
from _result import dump
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["env", "spawn", "start_processes", "process", "single"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--compile", default="")
    p.add_argument("--leak-mib", type=int, default=0)
    p.add_argument("--leak-rank", type=int, default=-1, help="the rank that leaks (-1: every rank)")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--attach", action="store_true", help="hpar_agent.attach(model, optimizer=opt) after DDP")
    return p.parse_args()


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    distributed = args.mode != "single"
    if distributed:
        if args.mode == "env":
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    if args.compile:  # compiled inside DDP: dynamo splits the graph at DDP's buckets (DDPOptimizer)
        model = torch.compile(model, backend=args.compile)
    if distributed:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.attach:
        import hpar_agent

        hpar_agent.attach(model, optimizer=opt)
    kept = []
    for step in range(args.steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.leak_mib and step >= 3 and args.leak_rank in (-1, rank):
            kept.append(torch.ones(args.leak_mib << 18))  # float32: 4 bytes each, touched
        delay = args.slow_s if rank == args.slow_rank else args.step_s
        if delay:
            time.sleep(delay)
    dump(rank, world, args.steps, dp=world if distributed else 1)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    args = parse()
    if args.mode == "env":
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if args.mode == "single":
        train(0, 1, args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if args.mode == "spawn":
        torch.multiprocessing.spawn(train, args=(WORLD, args), nprocs=WORLD)
    elif args.mode == "start_processes":
        torch.multiprocessing.start_processes(train, args=(WORLD, args), nprocs=WORLD, start_method="spawn")
    else:
        procs = [multiprocessing.Process(target=train, args=(r, WORLD, args)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
