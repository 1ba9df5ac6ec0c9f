"""A DDP wrapper nested wrongly, as a user can write one (gloo, CPU, SGD), knowing nothing of hpar_agent:
only the first block is inside ``DistributedDataParallel``; the head after it is not, so its gradients
are never reduced and the replicas drift apart. ``python ddp_nested_wrongly.py STEPS`` under torchrun."""

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
body = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU()))  # 1,088 parameters, reduced
model = nn.Sequential(body, nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))  # 4,225 more, never reduced
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(int(sys.argv[1])):
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
dist.destroy_process_group()
