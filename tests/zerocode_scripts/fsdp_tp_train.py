"""A 2-D program: FSDP2 over dp, tensor parallel over tp (DTensor, colwise/rowwise MLP blocks), the model
compiled (aot_eager), on a named 2 x 2 CPU mesh; no hpar_agent. argv[1]: steps."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.set_num_threads(1)
steps = int(sys.argv[1])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


model = torch.nn.Sequential(*[Block() for _ in range(3)])
for block in model:  # a materialised model: each TP shard is scattered from rank 0
    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
compiled = torch.compile(model, backend="aot_eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(steps):
    compiled(torch.randn(8, 16, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
