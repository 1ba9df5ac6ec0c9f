"""The memory collectors and the MemoryLeak detector on a GPU: NVML's series are real and the endpoint
serves what the registry holds; CUDA memory held every step fires MemoryLeak from the allocator, and
the allocator snapshot it keeps as evidence names the code that allocated it, in-process and in the
reference trainer's injected leaks."""

from __future__ import annotations

import os
import pickle
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpar_trainer.launch import run_torchrun
from tests.gpu.helpers import alert_events, sample_sum

MiB = 1 << 20
GPU_SERIES = (
    "hpar_gpu_memory_used_bytes",
    "hpar_gpu_memory_total_bytes",
    "hpar_gpu_process_memory_bytes",
    "hpar_gpu_utilization_ratio",
    "hpar_gpu_power_watts",
    "hpar_gpu_temperature_celsius",
    "hpar_gpu_clock_hertz",
)
#: A training step's pace in the in-process leak (the agent samples the allocator at most every 50 ms).
STEP_S = 0.06
SMALL = "--layers 2 --dim 64 --heads 4 --seq-len 32 --global-batch 8 --device cuda".split()


def snapshot_sites(paths: list[str], pattern: str) -> dict[str, int]:
    """Frames (``file:line name``) of the allocator snapshots' blocks and traces that match ``pattern``."""
    hits: dict[str, int] = {}
    for p in (p for p in paths if p.endswith(".pickle")):
        snap = pickle.loads(Path(p).read_bytes())
        frame_lists = [b.get("frames", []) for seg in snap.get("segments", []) for b in seg.get("blocks", [])]
        frame_lists += [t.get("frames", []) for dev in snap.get("device_traces", []) for t in dev]
        for f in (f for frames in frame_lists for f in frames):
            site = f"{os.path.basename(f.get('filename', ''))}:{f.get('line', '')} {f.get('name', '')}"
            if re.search(pattern, f"{f.get('filename', '')} {site}"):
                hits[site] = hits.get(site, 0) + 1
    return hits


def test_nvml_series_are_real_and_served(attached: Callable[..., Any]) -> None:
    held = torch.ones(64 * MiB // 4, device="cuda")  # this process's memory on the GPU
    agent = attached(metrics_port=0, metrics_addr="127.0.0.1", traces="none", interval=3600.0)
    agent.tick()
    values = {n: sample_sum(agent, n) for n in GPU_SERIES}
    for name in (
        "hpar_gpu_memory_used_bytes",
        "hpar_gpu_memory_total_bytes",
        "hpar_gpu_process_memory_bytes",
        "hpar_gpu_power_watts",
        "hpar_gpu_clock_hertz",
    ):
        assert values[name] > 0, (name, values)
    assert values["hpar_gpu_process_memory_bytes"] >= held.numel() * 4
    assert agent.metrics_url
    text = urllib.request.urlopen(agent.metrics_url, timeout=5).read().decode()
    served = {m.group(1) for m in re.finditer(r"^(hpar_gpu_[a-z_]+)\{", text, re.M)}
    assert set(GPU_SERIES) <= served, set(GPU_SERIES) - served
    assert not agent.errors, dict(agent.errors)


def _leak_cuda_tensor(kept: list[torch.Tensor], nbytes: int) -> None:
    """The leak site the allocator snapshot must name."""
    kept.append(torch.ones(nbytes // 4, device="cuda"))


def test_held_cuda_memory_fires_memory_leak_naming_the_site(attached: Callable[..., Any]) -> None:
    model = torch.nn.Linear(256, 256, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    agent = attached(metrics_port=-1, traces="none", interval=3600.0)
    kept: list[torch.Tensor] = []
    fired_at = None
    for step in range(40):
        t0 = time.perf_counter()
        model(torch.randn(64, 256, device="cuda")).sum().backward()
        _leak_cuda_tensor(kept, 8 * MiB)
        opt.step()  # the step boundary
        opt.zero_grad()
        agent.tick()
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - t0)))
        if fired_at is None and sample_sum(agent, "hpar_alert_active", alert="MemoryLeak") > 0:
            fired_at = step
    assert fired_at is not None, "MemoryLeak did not fire"
    firing = alert_events(agent.run_dir, "MemoryLeak")
    assert firing and firing[0]["value"] == pytest.approx(8 * MiB, rel=0.05), firing[:1]
    sites = snapshot_sites([p for e in firing for p in e.get("evidence", [])], r"_leak_cuda_tensor")
    assert sites, "the allocator snapshot does not name the leak site"


@pytest.mark.parametrize("inject", ["tensor-leak", "compile-leak"])
def test_the_trainers_injected_leak_fires_naming_the_inject_site(tmp_path: Path, inject: str) -> None:
    run = tmp_path / inject
    env = {
        "HPAR_RUN_DIR": str(run),
        "HPAR_TRACES": "none",
        "HPAR_METRICS_PORT": "0",
        "HPAR_INTERVAL": "0.2",
        "HPAR_JOB_ID": f"gpu-{inject}",
    }
    res = run_torchrun(
        1,
        [*SMALL, "--steps", "150", "--inject", inject, "--inject-rank", "0", "--log-every", "1000"],
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    firing = alert_events(run, "MemoryLeak")
    assert firing, f"{inject}: MemoryLeak did not fire"
    assert snapshot_sites([p for e in firing for p in e.get("evidence", [])], r"inject\.py"), (
        f"{inject}: the allocator snapshot does not name the trainer's inject module"
    )
