"""A user's own DDP program (not the reference trainer) with the agent attached (``test_multigpu.py``).

It does what users do: ``torch.cuda.set_device(local_rank)``, ``hpar_agent.attach(model)``,
``torch.compile``, DDP, and no agent settings at all (no TORCH_NCCL_ENABLE_TIMING). At ``--check-at``
every rank records ``torch.cuda.memory_allocated()`` read in that rank, lets the agent poll, scrapes its
own ``/metrics`` and writes both to ``<out>/user_ddp.rank<R>.json``; the last rank holds an extra
``--extra-gib`` GiB from ``--extra-at`` on, so NVML process memory must differ between ranks.

    torchrun --nproc-per-node 2 tests/gpu/user_ddp.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpar_agent


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample on the endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("rank", "pp_stage")
            )
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--extra-at", type=int, default=40)
    ap.add_argument("--extra-gib", type=float, default=1.0)
    ap.add_argument("--check-at", type=int, default=80)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.dim, args.dim), nn.GELU()) for _ in range(6)]).to(
        dev
    )
    agent = hpar_agent.attach(model)
    ddp = DDP(torch.compile(model), device_ids=[local])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x = torch.randn(64, args.dim, device=dev)
    extra = None
    result: dict = {"rank": rank, "world": world, "device": str(dev)}
    t_steps = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = ddp(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == args.extra_at and rank == world - 1:
            extra = torch.empty(int(args.extra_gib * (1 << 30)), dtype=torch.uint8, device=dev)
        if step == args.check_at:
            torch.cuda.synchronize(dev)
            result["allocated_in_rank"] = torch.cuda.memory_allocated(dev)
            time.sleep(2.5 * agent.config.interval)  # the agent polls; nothing allocates meanwhile
            result["metrics_url"] = agent.metrics_url
            result["scrape"] = scrape(agent.metrics_url) if agent.metrics_url else {}
        torch.cuda.synchronize(dev)
        t_steps.append(time.perf_counter() - t0)
    result["step_median_s"] = sorted(t_steps[20:])[len(t_steps[20:]) // 2]
    result["extra_bytes"] = 0 if extra is None else extra.numel()
    with open(os.path.join(args.out, f"user_ddp.rank{rank}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    dist.barrier()
    hpar_agent.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
