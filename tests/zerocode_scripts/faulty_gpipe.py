"""A plain pipeline program (torch.distributed.pipelining, GPipe, one stage per rank, gloo, CPU, SGD) that
knows nothing of hpar_agent, with one planted fault.

``python faulty_gpipe.py STEPS [--dp N] [--sleep-rank R --at S] [--slow-rank R --slow-ms N --slow-from S]
[--heavy-last-ms N] [--timeout-s T] [--schedule NAME] [--eval-at S --eval-batches N]``: ``--schedule`` another of torch's schedules (the
class name less ``Schedule``); a multi-stage one (``InterleavedZeroBubble``, ``Interleaved1F1B``,
``LoopedBFS``) gets two stages a rank, the looped placement (rank r: stages r and r + ranks of the
pipeline). ``--dp`` pipeline replicas (rank = replica * stages + stage) whose
stages all-reduce their gradients; at step S rank R sleeps before its pipeline step (the stage after it
waits for its activations, the stage before it for its gradients, its replicas in the all-reduce).
``--slow-rank``: from step ``--slow-from`` on, that rank's stage works N ms more a step (spread over its
forwards); ``--heavy-last-ms``: every last stage works N ms more a step from the start (slower by design).
``--timeout-s``: the process group's timeout. ``--eval-at``: before step S every rank evaluates N
batches (``schedule.eval()`` under ``no_grad``, 20 ms of work in each of stage 0's forwards) and prints
``rank R: evaluated for SECONDS s``.
"""

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--dp", type=int, default=1)
p.add_argument("--sleep-rank", type=int, default=-1)
p.add_argument("--at", type=int, default=40)
p.add_argument("--slow-rank", type=int, default=-1)
p.add_argument("--slow-ms", type=float, default=0.0)
p.add_argument("--slow-from", type=int, default=0)
p.add_argument("--heavy-last-ms", type=float, default=0.0)
p.add_argument("--timeout-s", type=float, default=1800)
p.add_argument("--schedule", default="GPipe")
p.add_argument("--eval-at", type=int, default=-1)
p.add_argument("--eval-batches", type=int, default=0)
a = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
stages = world // a.dp
replica, stage_idx = divmod(rank, stages)
timeout = datetime.timedelta(seconds=a.timeout_s)
pipes = [dist.new_group([d * stages + s for s in range(stages)], timeout=timeout) for d in range(a.dp)]
dps = [dist.new_group([d * stages + s for d in range(a.dp)], timeout=timeout) for s in range(stages)]
cls = getattr(schedules, "Schedule" + a.schedule)
per_rank = 2 if issubclass(cls, schedules.PipelineScheduleMulti) else 1
torch.manual_seed(stage_idx)
blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(per_rank)]
MICRO = 4 * per_rank
now = {"step": 0, "eval": False}


def _work(_module, _inputs):  # extra work in every forward of this stage, between its p2p ops
    ms = a.heavy_last_ms if stage_idx == stages - 1 else 0.0
    if rank == a.slow_rank and now["step"] >= a.slow_from:
        ms += a.slow_ms
    if now["eval"] and stage_idx == 0:
        _ = [torch.randn(64, 64) @ torch.randn(64, 64) for _ in range(4)]  # the CPU works, as an eval does
        ms += 20.0 * per_rank
    if ms:
        time.sleep(ms / 1000 / MICRO)


blocks[0].register_forward_pre_hook(_work)
built = [
    PipelineStage(b, stage_idx + j * stages, stages * per_rank, torch.device("cpu"), group=pipes[replica])
    for j, b in enumerate(blocks)
]
loss_fn = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
schedule = cls(built if per_rank > 1 else built[0], n_microbatches=MICRO, loss_fn=loss_fn)
params = [p for b in blocks for p in b.parameters()]
opt = torch.optim.SGD(params, lr=1e-3)
for step in range(a.steps):
    if step == a.at and rank == a.sleep_rank:
        time.sleep(3600)
    now["step"] = step
    if step == a.eval_at:
        now["eval"], t_eval = True, time.time()
        with torch.no_grad():
            for _ in range(a.eval_batches):
                x, y = torch.randn(16, 32), torch.randn(16, 32)
                if stage_idx == 0:
                    schedule.eval(x)
                elif stage_idx == stages - 1:
                    schedule.eval(target=y, losses=[])
                else:
                    schedule.eval()
        now["eval"] = False
        print(f"rank {rank}: evaluated for {time.time() - t_eval:.3f} s", flush=True)
    opt.zero_grad()
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    if stage_idx == 0:
        schedule.step(x)
    elif stage_idx == stages - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    if a.dp > 1:
        for p in params:
            dist.all_reduce(p.grad, group=dps[stage_idx])
    opt.step()
dist.destroy_process_group()
