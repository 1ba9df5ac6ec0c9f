"""A DDP loop under ``torchrun --max-restarts 1`` whose first attempt crashes, for the goodput ledger's
restart test. argv[1], the steps; argv[2], a directory. Every CKPT_EVERY steps each rank saves
``{"model", "step"}`` with torch.save; an attempt that finds its rank's checkpoint loads it and resumes at
its step. In the first attempt rank CRASH raises before step CRASH_AT (after CRASH_AT steps, the last
checkpoint at step 8), so the second attempt does steps 8 and 9 again. The agent attaches itself."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hpar_agent

CKPT_EVERY, CRASH, CRASH_AT = 4, 1, 10
steps, out = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
hpar_agent.attach()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# gloo's keys of each attempt apart: on the launcher's store as is, the second attempt's ranks read the
# first one's addresses and fail to connect (torch 2.13, gloo, --standalone)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group(
    "gloo",
    store=dist.PrefixStore(f"attempt{attempt}", store),
    rank=int(os.environ["RANK"]),
    world_size=int(os.environ["WORLD_SIZE"]),
)
rank = dist.get_rank()
net = torch.nn.Linear(64, 64)
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = os.path.join(out, f"ckpt.rank{rank}.pt")
start = 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    net.load_state_dict(state["model"])
    start = state["step"]
for i in range(start, steps):
    if attempt == 0 and rank == CRASH and i == CRASH_AT:
        raise RuntimeError("injected crash")
    model(torch.randn(32, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
    if (i + 1) % CKPT_EVERY == 0:
        torch.save({"model": net.state_dict(), "step": i + 1}, ckpt)
dist.destroy_process_group()
hpar_agent.detach()
with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
    json.dump({"attempt": attempt, "start": start}, f)
