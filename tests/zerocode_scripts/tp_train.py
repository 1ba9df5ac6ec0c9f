"""2-rank tensor parallel with DTensor (colwise/rowwise MLP) on a CPU mesh; no hpar_agent. argv[1]: steps."""

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.set_num_threads(1)
steps = int(sys.argv[1])
mesh = init_device_mesh("cpu", (2,))  # creates the default process group itself
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2)
for _ in range(steps):
    loss = mlp(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
