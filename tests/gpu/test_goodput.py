"""Where the time went on a GPU: a loop whose DataLoader sleeps 20 ms a batch against a few ms of GPU
work. The step anatomy's CUDA-event phases feed the ledger: the data wait is its largest loss after
startup, and the causes add up to the process's wall time."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STEPS, DELAY = 40, 0.02


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(DELAY)
        return torch.randn(256, 1024)


def test_a_slow_loader_on_cuda_is_data_wait(attached: Callable[..., Any], tmp_path: Path) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    agent = attached(model, traces="none", metrics_port=-1, detail_rate=0)
    opt = torch.optim.AdamW(model.parameters())
    for x in torch.utils.data.DataLoader(Slow(), batch_size=None):
        model(x.cuda(non_blocking=True)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    import hpar_agent

    hpar_agent.detach()
    led = json.loads((Path(agent.run_dir) / "summary.rank0.json").read_text())["components"]["goodput"]
    total = led["productive_seconds"] + sum(led["lost_seconds"].values())
    assert abs(total - led["wall_seconds"]) <= 0.01 * led["wall_seconds"], led
    lost = {k: v for k, v in led["lost_seconds"].items() if k != "startup"}
    assert max(lost, key=lost.__getitem__) == "data_wait", led
    assert lost["data_wait"] >= (STEPS - 2) * DELAY * 0.8, led
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "gpu-goodput.json").write_text(json.dumps(led, indent=1))
