"""A plain pipeline program (torch.distributed.pipelining, GPipe, one stage per rank, gloo, CPU, SGD) that
knows nothing of hpar_agent, with one planted fault.

``python faulty_gpipe.py STEPS [--dp N] [--sleep-rank R --at S] [--timeout-s T]``: ``--dp`` pipeline
replicas (rank = replica * stages + stage) whose stages all-reduce their gradients; at step S rank R
sleeps before its pipeline step (the stage after it waits for its activations, the stage before it
for its gradients, its replicas in the all-reduce). ``--timeout-s``: the process group's timeout.
"""

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--dp", type=int, default=1)
p.add_argument("--sleep-rank", type=int, default=-1)
p.add_argument("--at", type=int, default=40)
p.add_argument("--timeout-s", type=float, default=1800)
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
stages = world // a.dp
replica, stage_idx = divmod(rank, stages)
timeout = datetime.timedelta(seconds=a.timeout_s)
pipes = [dist.new_group([d * stages + s for s in range(stages)], timeout=timeout) for d in range(a.dp)]
dps = [dist.new_group([d * stages + s for d in range(a.dp)], timeout=timeout) for s in range(stages)]
torch.manual_seed(stage_idx)
block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
stage = PipelineStage(block, stage_idx, stages, torch.device("cpu"), group=pipes[replica])
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, y: (out - y).pow(2).mean())
opt = torch.optim.SGD(block.parameters(), lr=1e-3)
for step in range(a.steps):
    if step == a.at and rank == a.sleep_rank:
        time.sleep(3600)
    opt.zero_grad()
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    if stage_idx == 0:
        schedule.step(x)
    elif stage_idx == stages - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    if a.dp > 1:
        for p in block.parameters():
            dist.all_reduce(p.grad, group=dps[stage_idx])
    opt.step()
dist.destroy_process_group()
