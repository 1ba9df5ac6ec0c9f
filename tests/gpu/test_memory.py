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
#: The CUDA caching allocator's block rules (c10/cuda/CUDACachingAllocator.cpp): requests over 1 MiB
#: (kSmallSize) are served from the large pool; a request under 10 MiB (kMinLargeAlloc) gets a new
#: 20 MiB segment (kLargeBuffer) split between requests, a larger one a segment of its size rounded
#: up to 2 MiB (kRoundLarge); every block is a multiple of 512 bytes (kMinBlockSize).
SMALL_SIZE, MIN_LARGE_ALLOC, LARGE_BUFFER, ROUND_LARGE, MIN_BLOCK = MiB, 10 * MiB, 20 * MiB, 2 * MiB, 512
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


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def growth_per_step(nbytes: int, source: str) -> float:
    """Bytes a step that keeping one ``nbytes`` tensor a step adds to a MemoryLeak source, by the
    allocator's block rules: the allocated bytes grow by the block; the reserved bytes (and the
    process's memory NVML reports) by whole segments, one per ``segment // block`` tensors. Expandable
    segments grow a segment in 2 MiB pages instead."""
    assert nbytes > SMALL_SIZE, "the large pool's rules only"
    block = _round_up(nbytes, MIN_BLOCK)
    if source == "allocator":
        return float(block)
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        return float(_round_up(block, ROUND_LARGE))
    segment = LARGE_BUFFER if block < MIN_LARGE_ALLOC else _round_up(block, ROUND_LARGE)
    return segment / (segment // block)


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
    assert firing, "no firing event"
    details = firing[0]["details"]
    # 8 MiB a step is 8 MiB of allocated bytes but 10 MiB of reserved ones (two 8 MiB blocks to a 20
    # MiB segment): the worst source fires, whichever the card's timing made it
    expected = growth_per_step(8 * MiB, details["source"])
    assert firing[0]["value"] == pytest.approx(expected, rel=0.05), (details["source"], firing[0]["value"])
    sites = snapshot_sites([p for e in firing for p in e.get("evidence", [])], r"_leak_cuda_tensor")
    assert sites, "the allocator snapshot does not name the leak site"
    line = _leak_cuda_tensor.__code__.co_firstlineno + 2
    assert details["site"] == f"{os.path.basename(__file__)}:{line} in _leak_cuda_tensor", details
    assert details["site_live_bytes"] % (8 * MiB) == 0
    assert abs(details["site_live_bytes"] // (8 * MiB) - details["site_steps"]) <= 1, details


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
