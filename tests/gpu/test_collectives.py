"""The collectives collector on NCCL (one GPU, world size 1): with no timing variable set, the agent
switches timing on, counts and times every all-reduce and all-gather, and the flight recorder's
durations it reports agree with torch.profiler's device time of the same ops.

At world size 1 NCCL runs no ring: an all-reduce SUM does no device work, AVG runs ``oneRankReduce``,
an all-gather a device-to-device copy. At 128 MiB those take ~60-180 µs, and the flight recorder's
CUDA-event pair (~7-15 µs of its own) is a small part of it: there the two must agree.
"""

from __future__ import annotations

import json
import pickle
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.gpu.helpers import sample_sum

MiB = 1 << 20
REPS = 10
#: Device events that are the op's own work (NCCL kernels, or what NCCL runs at world size 1); the
#: profiler's ``nccl:<op>`` annotations span them and are left out.
COMM_KERNEL = re.compile(r"ncclDevKernel|ncclKernel|onerank", re.I)
COPY = re.compile(r"memcpy|memset", re.I)


def nccl_entries() -> list[dict[str, Any]]:
    """The NCCL flight recorder's entries, read from torch directly (not through the agent)."""
    raw = torch._C._distributed_c10d._dump_nccl_trace(includeStackTraces=False)
    return list(pickle.loads(raw).get("entries", []))


def device_us(prof: Any) -> float | None:
    """Device time of the op's own work in a profile (kernels, else copies), µs in total."""
    events = [
        (e.name, float(e.time_range.elapsed_us()))
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    work = [us for n, us in events if COMM_KERNEL.search(n)] or [us for n, us in events if COPY.search(n)]
    return sum(work) if work else None


@pytest.mark.parametrize(
    ("op", "reduce"), [("all_reduce", "sum"), ("all_reduce", "avg"), ("all_gather", None)]
)
def test_every_collective_is_timed_and_agrees_with_the_profiler(
    nccl_group: torch.device, attached: Callable[..., Any], op: str, reduce: str | None
) -> None:
    agent = attached(metrics_port=-1, traces="none", interval=3600.0)  # passes run here, by tick()
    last_id = max((e["record_id"] for e in nccl_entries()), default=-1)
    for nbytes in (1 * MiB, 16 * MiB, 128 * MiB):
        x = torch.ones(nbytes // 4, device=nccl_group)
        out = torch.empty_like(x)
        red = dist.ReduceOp.AVG if reduce == "avg" else dist.ReduceOp.SUM

        def collective(x: torch.Tensor = x, out: torch.Tensor = out, red: Any = red) -> None:
            if op == "all_gather":
                dist.all_gather_into_tensor(out, x)
            else:
                dist.all_reduce(x, op=red)

        agent.tick()  # whatever the recorder held before is read now, not counted below
        before = sample_sum(agent, "hpar_collective_duration_seconds_count", op=op)
        collective()  # warm-up, outside the profile
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(REPS):
                collective()
            torch.cuda.synchronize()
        deadline = time.monotonic() + 15
        while True:  # the watchdog stamps duration_ms a poll after completion
            agent.tick()
            entries = [e for e in nccl_entries() if e["record_id"] > last_id]
            timed = [e for e in entries if e.get("duration_ms") is not None]
            counted = sample_sum(agent, "hpar_collective_duration_seconds_count", op=op) - before
            if (
                len(timed) == len(entries) == REPS + 1 and counted >= REPS + 1
            ) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(entries) == REPS + 1, (nbytes, [e.get("profiling_name") for e in entries])
        assert len(timed) == len(entries), (
            f"{op} {nbytes}: {len(timed)}/{len(entries)} flight-recorder entries timed"
        )
        assert counted == REPS + 1, f"{op} {nbytes}: the agent timed {counted} of {REPS + 1}"
        last_id = max(e["record_id"] for e in entries)
        work_us = device_us(prof)
        if nbytes == 128 * MiB and reduce != "sum":  # device work that dwarfs the timing events' own
            assert work_us is not None, "no device work in the profile"
            ratio = statistics.median(e["duration_ms"] for e in timed) * 1e3 / (work_us / REPS)
            assert 0.7 < ratio < 1.6, f"{op} {nbytes}: flight recorder / profiler device time {ratio:.3f}"
    assert not agent.errors, dict(agent.errors)


UNNAMED = """
import json, sys, time
import torch, torch.distributed as dist
import hpar_agent
from tests.gpu.helpers import sample_sum

torch.cuda.set_device(0)
dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # no backend named
agent = hpar_agent.attach(None, metrics_port=-1, traces="none", interval=3600.0, run_dir=sys.argv[1])
x = torch.ones(1 << 20, device="cuda")
agent.tick()  # the group is seen and timed from here, before its first collective
before = sample_sum(agent, "hpar_collective_duration_seconds_count", op="all_reduce")
for _ in range(10):
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
torch.cuda.synchronize()
deadline, counted = time.monotonic() + 15, 0.0
while counted < 10 and time.monotonic() < deadline:
    time.sleep(0.1)
    agent.tick()
    counted = sample_sum(agent, "hpar_collective_duration_seconds_count", op="all_reduce") - before
print(json.dumps({"torch": str(dist.get_backend()), "agent": agent.topology.backend, "counted": counted,
                  "errors": dict(agent.errors)}))
hpar_agent.detach()
dist.destroy_process_group()
"""


def test_a_group_made_without_naming_a_backend_is_timed_as_the_nccl_one_it_is(tmp_path: Path) -> None:
    """A bare ``init_process_group()`` (and ``init_device_mesh``) leaves the backend "undefined" to
    ``dist.get_backend``; on CUDA its collectives run through NCCL, and the agent labels and times
    them as NCCL's (a group read as not NCCL gets no timing: nothing would be counted)."""
    proc = subprocess.run(
        [sys.executable, "-c", UNNAMED, str(tmp_path / "agent")],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch"] == "undefined", got  # what the agent must see through
    assert got["agent"] == "nccl" and got["errors"] == {}, got
    assert got["counted"] == 10, got
