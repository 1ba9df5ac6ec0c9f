"""The GPU health collector on a real GPU: its NVML reads equal what ``nvidia-smi`` reports of the same
GPU, and every NVML call it makes comes from the agent thread (never the training thread). A throttle,
an Xid event, a retired page or a failed row remap cannot be caused here: those are tested at the NVML
boundary with a fake module (``tests/unit/test_gpu_health.py``); here their series are read as the GPU
reports them, and written to ``$OUT/gpu-health.json`` with the rest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from hpar_agent.collectors.gpu_health import GpuHealthCollector

SMI_FIELDS = (
    "index",
    "clocks.max.sm",
    "enforced.power.limit",
    "pcie.link.gen.max",
    "pcie.link.width.max",
    "pcie.link.width.current",
)


class Recording:
    """pynvml, recording the thread of every call."""

    def __init__(self, nv: Any) -> None:
        self._nv, self.threads = nv, set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nv, name)
        if not (callable(attr) and name.startswith("nvml")):
            return attr
        threads = self.threads

        def call(*args: Any, **kwargs: Any) -> Any:
            threads.add(threading.current_thread().name)
            return attr(*args, **kwargs)

        return call


def _smi(index: int) -> dict[str, float]:
    out = subprocess.run(
        [
            "nvidia-smi",
            f"--query-gpu={','.join(SMI_FIELDS)}",
            "--format=csv,noheader,nounits",
            "-i",
            str(index),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {k: float(v) for k, v in zip(SMI_FIELDS, (x.strip() for x in out.split(",")), strict=True)}


@pytest.mark.skipif(not shutil.which("nvidia-smi"), reason="nvidia-smi not found")
def test_health_reads_equal_nvidia_smi_and_come_from_the_agent_thread(attached: Callable[..., Any]) -> None:
    import pynvml
    import torch

    torch.ones(1, device="cuda")
    agent = attached(traces="none", interval=0.2, metrics_port=-1)
    old = agent.component("gpu_health")
    rec = Recording(pynvml)
    with agent.loop.lock:  # between two passes
        old.uninstall()
        agent.components.remove(old)
        comp = GpuHealthCollector(nvml=rec)
        agent.add_component(comp)
    deadline = time.time() + 30
    while not comp.values and time.time() < deadline:  # waiting for the agent thread's first read
        time.sleep(0.1)
    assert comp.up and comp.values, comp.summary()
    assert rec.threads == {"hpar-agent"}, rec.threads  # never the training thread
    smi = _smi(int(comp.gpu))
    v = comp.values
    get = agent.registry.get_sample_value
    labels = {"rank": "0", "pp_stage": "0", "gpu": comp.gpu}
    assert get("hpar_gpu_clock_max_hertz", {**labels, "clock": "sm"}) == smi["clocks.max.sm"] * 1e6
    assert v["power_limit"] == pytest.approx(smi["enforced.power.limit"], abs=1.0)
    assert v["pcie_gen"]["max"] == smi["pcie.link.gen.max"]
    assert v["pcie_width"]["max"] == smi["pcie.link.width.max"]
    assert v["pcie_width"]["current"] == smi["pcie.link.width.current"]
    assert 1 <= v["pcie_gen"]["current"] <= v["pcie_gen"]["max"]
    if "remapped" in v:  # Ampere and later
        assert v["remapped"]["failed"] == 0, v
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu-health.json"), "w") as f:
            json.dump({"summary": comp.summary(), "nvidia_smi": smi}, f, indent=1)
