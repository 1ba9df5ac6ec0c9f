"""A training loop with one planted cause of lost time, for the goodput ledger's tests. argv[1], the cause:
``slow-data`` (every item of the dataset takes DELAY s), ``slow-rank`` (under torchrun: rank SLOW's
forward takes DELAY s longer, so the others wait in DDP's all-reduce), ``recompile`` (a compiled
function (aot_eager) given a new input length every step, without dynamic shapes: a recompile each step),
``checkpoint`` (torch.distributed.checkpoint.save of the model's state every CKPT_EVERY steps, then a
load). argv[2], the steps; argv[3], a directory. It attaches the agent itself (the model is found as the DDP wrapper or at
the first optimizer step) and writes ``result.rank<R>.json``
there: its first instant, its loop's start (after SETUP s of set-up) and the instants around its detach,
for the test to place the ledger's wall time, and the seconds its checkpoint calls took."""

import time

T0 = time.time()  # before any import that takes time

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

DELAY = 0.25
SLOW = 2
CKPT_EVERY = 4
SETUP = 1.0
cause, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import hpar_agent  # noqa: E402

torch.set_num_threads(1)
# before the process group: its flight recorder and the exchange's store are seen. The Straggler detector
# judges early (the test is of the accounting, not of how soon the culprit is named)
QUICK = {"Straggler.warmup_steps": 2, "Straggler.min_window_steps": 2, "Straggler.quiet_steps": 1}
hpar_agent.attach(thresholds=QUICK)
ranks = "WORLD_SIZE" in os.environ
if ranks:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ranks else 0


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return steps

    def __getitem__(self, i: int) -> torch.Tensor:
        if cause == "slow-data":
            time.sleep(DELAY)
        return torch.randn(64, 64)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cause == "slow-rank" and rank == SLOW:
            time.sleep(DELAY)
        return self.body(x)


def head(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum(-1)


net = Net()
model = DDP(net) if ranks else net
compiled = torch.compile(head, backend="aot_eager", dynamic=False)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
torch._dynamo.config.recompile_limit = steps + 8
ckpt_seconds = 0.0
time.sleep(SETUP)  # set-up after attach and before the first step (weights loaded, data prepared)
t_loop = time.time()
for i, x in enumerate(torch.utils.data.DataLoader(Data(), batch_size=None)):
    y = model(x)
    if cause == "recompile":
        y = compiled(y[:, : 8 + i])
    y.pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if cause == "checkpoint" and i % CKPT_EVERY == CKPT_EVERY - 1:
        import torch.distributed.checkpoint as dcp

        where = os.path.join(out, f"ckpt{i}")
        state = {"model": net.state_dict()}
        t = time.time()
        dcp.save(state, checkpoint_id=where)
        dcp.load(state, checkpoint_id=where)
        ckpt_seconds += time.time() - t
if ranks:
    dist.destroy_process_group()
t_detach = time.time()
hpar_agent.detach()
with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
    json.dump(
        {
            "t0": T0,
            "t_loop": t_loop,
            "t_detach": t_detach,
            "t_end": time.time(),
            "ckpt_seconds": ckpt_seconds,
        },
        f,
    )
