"""CPU/NUMA binding on a GPU host: ``hpar_rank_info``'s labels against sources independent of NVML (the
GPU's PCI device in sysfs, ``os.sched_getaffinity``), doctor's NUMA line, and NumaMisbinding raised by a
process pinned off the GPU's ideal CPUs (where the host has such CPUs) and not by an unpinned one."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hpar_agent.affinity import cpu_list, parse_cpu_list
from tests.gpu.helpers import alert_events

PINNED = """
import sys, time, torch, hpar_agent
agent = hpar_agent.attach(metrics_port=-1, traces="none", run_dir=sys.argv[1], interval=0.2)
x = torch.ones(1 << 20, device="cuda")
for _ in range(20):
    x.mul_(1.0001); agent.step(); time.sleep(0.05)
hpar_agent.detach()
"""


def sysfs_gpu() -> dict[str, str]:
    """The GPU's PCI device in sysfs: its ideal CPUs and NUMA node, read without NVML ("" if unreadable)."""
    p = torch.cuda.get_device_properties(0)
    root = Path("/sys/bus/pci/devices") / f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    out = {}
    for name in ("local_cpulist", "numa_node"):
        try:
            out[name] = (root / name).read_text().strip()
        except OSError:
            out[name] = ""
    return out


def rank_info(agent: Any) -> dict[str, str]:
    for fam in agent.registry.collect():
        for s in fam.samples:
            if s.name == "hpar_rank_info":
                return dict(s.labels)
    return {}


def test_rank_info_binding_matches_sysfs_and_the_affinity(attached: Callable[..., Any]) -> None:
    torch.ones(1, device="cuda")
    agent = attached(metrics_port=-1, traces="none", interval=0.2)
    agent.tick()
    info = rank_info(agent)
    assert info.get("cpu_affinity") == cpu_list(set(os.sched_getaffinity(0))), info
    sysfs = sysfs_gpu()
    if sysfs["local_cpulist"]:
        assert info.get("gpu_cpu_affinity") == cpu_list(parse_cpu_list(sysfs["local_cpulist"])), (info, sysfs)
    if sysfs["numa_node"] not in ("", "-1"):  # -1: the platform does not say (common in VMs)
        assert info.get("gpu_numa_node") == sysfs["numa_node"], (info, sysfs)
    assert not alert_events(agent.run_dir, "NumaMisbinding"), "NumaMisbinding fired in an unpinned process"
    doctor = subprocess.run(
        [sys.executable, "-m", "hpar_agent", "doctor"], capture_output=True, text=True, timeout=120
    )
    assert "GPU ideal CPUs" in doctor.stdout + doctor.stderr, doctor.stdout[-2000:]


def test_a_process_pinned_off_the_gpus_cpus_raises_numa_misbinding(tmp_path: Path) -> None:
    ideal = sysfs_gpu()["local_cpulist"]
    if not ideal:
        pytest.skip("sysfs gives no local_cpulist for this GPU")
    off = set(os.sched_getaffinity(0)) - parse_cpu_list(ideal)
    if not off:
        pytest.skip(
            f"every CPU of this process ({cpu_list(set(os.sched_getaffinity(0)))}) is ideal for the GPU"
        )
    res = subprocess.run(
        ["taskset", "-c", cpu_list(off), sys.executable, "-c", PINNED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert alert_events(tmp_path, "NumaMisbinding"), "NumaMisbinding did not fire off the GPU's ideal CPUs"
