"""2-rank FSDP2 (fully_shard) on gloo CPU; no hpar_agent. argv[1]: steps."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)
steps = int(sys.argv[1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
