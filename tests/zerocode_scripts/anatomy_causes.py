"""A training loop with one planted bottleneck, for the step anatomy's verdict tests. argv[1], the cause:
``clean`` (a few ms of compute a step, batches from a DataLoader), ``slow-data`` (every item of the
dataset takes 0.2 s), ``host`` (0.2 s of host work after each optimizer step: logging, a checkpoint),
``slow-peer`` (2 ranks under torchrun: rank 1's forward takes 0.2 s longer, so rank 0 waits in DDP's
all-reduce). argv[2] ``attach``: the script attaches the agent itself (``hpar_agent.attach(model)``);
else it knows nothing of hpar_agent (run it under ``hpar-agent run``)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 10
DELAY = 0.2
cause = sys.argv[1]
torch.set_num_threads(1)
ranks = "WORLD_SIZE" in os.environ
if ranks:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ranks else 0


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> torch.Tensor:
        if cause == "slow-data":
            time.sleep(DELAY)
        return torch.randn(256, 256)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cause == "slow-peer" and rank == 1:
            time.sleep(DELAY)
        return self.body(x)


model = DDP(Net()) if ranks else Net()
if sys.argv[2:] == ["attach"]:
    import hpar_agent

    hpar_agent.attach(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x in torch.utils.data.DataLoader(Data(), batch_size=None):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if cause == "host":
        time.sleep(DELAY)
if ranks:
    dist.destroy_process_group()
