"""A GAN under DDP, as a user writes one: two models, each wrapped in its own DDP, two optimizers, the
discriminator's gradients accumulated over two micro-batches with ``no_sync``. One training iteration
is one step however many optimizers it steps. ``python gan.py --steps N`` under torchrun; each rank
writes ``result.rank<R>.json`` into ``$COMPAT_OUT`` (``_result``). Knows nothing of hpar_agent."""

import argparse
import contextlib

import torch
import torch.distributed as dist
from _result import dump
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
gen = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)))
disc = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
for _ in range(args.steps):
    for micro in range(2):  # the gradients all-reduced once, at the last micro-batch
        with disc.no_sync() if micro == 0 else contextlib.nullcontext():
            fake = gen(torch.randn(16, 8)).detach()
            (bce(disc(torch.randn(16, 16)), ones) + bce(disc(fake), zeros)).backward()
    opt_d.step()
    opt_d.zero_grad()
    bce(disc(gen(torch.randn(16, 8))), ones).backward()
    opt_g.step()
    opt_g.zero_grad()
dump(rank, world, args.steps, dp=world)
dist.barrier()
dist.destroy_process_group()
