"""2-rank DDP on gloo CPU with an optimizer; knows nothing of hpar_agent. argv[1]: steps; argv[2]
(optional): after training, wait (at most 60 s) until this file exists, so a test can scrape."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
steps = int(sys.argv[1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(steps):
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if len(sys.argv) > 2:
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[2]) and time.time() < deadline:
        time.sleep(0.1)
dist.destroy_process_group()
