"""A plain DDP program (gloo, CPU, AdamW) that knows nothing of hpar_agent, with one planted fault.

``python faulty_ddp.py STEPS [--fault F --rank R --at S] [--slow RANKS --slow-s SEC] [--timeout-s T]``:
at step S rank R (F =) ``sleep``s before its backward (the others wait in the DDP all-reduce),
sends itself ``SIGKILL``, or ``SIGSTOP``s itself; ``--slow 4,5,6,7`` makes those ranks sleep
``--slow-s`` more every step. ``--step-s`` paces every rank (a fault then comes seconds in, after the
agents' first exchanges). ``--timeout-s``: the process group's timeout. ``--buckets 12``: a deeper model
whose gradients DDP reduces in about that many all-reduces a step.
"""

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--fault", choices=["sleep", "SIGKILL", "SIGSTOP"], default=None)
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--at", type=int, default=40)
p.add_argument("--slow", default="")
p.add_argument("--slow-s", type=float, default=0.06)
p.add_argument("--step-s", type=float, default=0.0)
p.add_argument("--timeout-s", type=float, default=1800)
p.add_argument("--buckets", type=int, default=1)
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
rank = dist.get_rank()
torch.manual_seed(0)
if a.buckets > 1:  # one 256x256 layer (256 KiB of fp32 gradients) per bucket of 0.25 MiB
    layers = [torch.nn.Linear(64, 256)] + [torch.nn.Linear(256, 256) for _ in range(a.buckets - 1)]
    net = torch.nn.Sequential(
        *[m for layer in layers for m in (layer, torch.nn.ReLU())], torch.nn.Linear(256, 1)
    )
    model = DDP(net, bucket_cap_mb=0.25)
else:
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
slow = {int(r) for r in a.slow.split(",") if r}
for step in range(a.steps):
    loss = model(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad()
    if step == a.at and rank == a.rank:
        if a.fault == "sleep":
            time.sleep(3600)
        elif a.fault is not None:
            os.kill(os.getpid(), getattr(signal, a.fault))
    if a.step_s or rank in slow:
        time.sleep(a.step_s + (a.slow_s if rank in slow else 0.0))
    loss.backward()
    opt.step()
dist.destroy_process_group()
