"""The GPU health collector at its NVML boundary, with a fake ``pynvml``: this machine has no GPU, and a
throttle, an Xid event, a retired page or a failed row remap cannot be caused on a real one. The real
reads are checked on a GPU by ``tests/gpu/test_health.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from hpar_agent.agent import Agent
from hpar_agent.collectors.gpu_health import GpuHealthCollector

L = {"rank": "0", "pp_stage": "0", "gpu": "1"}


class NotSupported(Exception):
    pass


class Timeout(Exception):
    pass


class FakeNvml:
    NVMLError_NotSupported = NotSupported
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERRORS = 1
    NVML_NVLINK_MAX_LINKS = 4
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT, NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.xids: list[int] = []  # events waiting in the set
        self.waits: list[int] = []  # the timeout of every wait: the agent thread must never block
        self.inits = self.shutdowns = 0
        self.remap_calls = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("dev", i)

    def nvmlDeviceGetIndex(self, h):
        return h[1]

    def nvmlDeviceGetMaxClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000  # mW

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 8  # downtrained

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return [0x1000, 0x2000] if cause == 1 else []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return 1

    def nvmlDeviceGetRemappedRows(self, h):
        self.remap_calls += 1
        raise NotSupported()  # pre-Ampere: asked once, then left out

    def nvmlDeviceGetNvLinkState(self, h, link):
        return link < 2  # links 0 and 1 active

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return {0: 3, 1: 0, 2: 1, 3: 0}[counter]

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, kinds, es):
        assert kinds == self.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, es, timeout_ms):
        self.waits.append(timeout_ms)
        if not self.xids:
            raise Timeout()
        return SimpleNamespace(eventData=self.xids.pop(0), eventType=8)

    def nvmlEventSetFree(self, es):
        pass


@pytest.fixture
def agent(tmp_path):
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    a.start()
    a.device = a.context.device = torch.device("cuda", 1)
    try:
        yield a
    finally:
        a.stop()


def _with(agent: Agent, comp: GpuHealthCollector) -> GpuHealthCollector:
    old = agent.component(comp.name)
    old.uninstall()
    agent.components.remove(old)
    agent.add_component(comp)
    return comp


def test_health_series_from_nvml(agent, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nv = FakeNvml()
    _with(agent, GpuHealthCollector(nvml=nv))
    nv.xids += [79, 48, 79]
    agent.tick()
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_gpu_clock_max_hertz", {**L, "clock": "sm"}) == 1980e6
    assert get("hpar_gpu_power_limit_watts", L) == 700.0
    assert get("hpar_gpu_pcie_link_width", {**L, "which": "current"}) == 8
    assert get("hpar_gpu_pcie_link_width", {**L, "which": "max"}) == 16
    assert get("hpar_gpu_pcie_link_generation", {**L, "which": "max"}) == 5
    assert get("hpar_gpu_retired_pages", {**L, "cause": "double_bit"}) == 2
    assert get("hpar_gpu_retired_pages", {**L, "cause": "single_bit"}) == 0
    assert get("hpar_gpu_retired_pages_pending", L) == 1
    assert get("hpar_gpu_xid_events_total", {**L, "xid": "79"}) == 2
    assert get("hpar_gpu_xid_events_total", {**L, "xid": "48"}) == 1
    assert get("hpar_gpu_nvlink_errors_total", {**L, "kind": "replay"}) == 6  # 3 on each active link
    assert get("hpar_gpu_nvlink_errors_total", {**L, "kind": "crc_flit"}) == 2
    assert get("hpar_gpu_remapped_rows", {**L, "kind": "pending"}) is None  # not supported: absent
    assert nv.remap_calls == 1  # asked once
    assert set(nv.waits) == {0}  # polled, never waited on
    nvml = agent.component("nvml")
    nvml.values = {"throttle": {"hw_slowdown": 1, "gpu_idle": 0}, "clocks": {"sm": 1410e6}}
    agent.tick()
    comp = agent.component("gpu_health")
    assert set(comp.throttled_since) == {"hw_slowdown"}
    assert comp.describe().startswith("GPU 1: hw_slowdown since ")
    assert comp.describe().endswith("SM clock 1,410 MHz against 1,980")


def test_no_gpu_means_no_health_series(agent, monkeypatch):
    agent.device = agent.context.device = torch.device("cpu")
    nv = FakeNvml()
    _with(agent, GpuHealthCollector(nvml=nv))
    agent.tick()
    text = generate_latest(agent.registry).decode()
    assert "hpar_steps_total{" in text  # the exposition is there, without any health series
    for name in ("hpar_gpu_clock_max_hertz", "hpar_gpu_xid_events_total", "hpar_gpu_power_limit_watts"):
        assert f"\n{name}{{" not in text and f"\n{name} " not in text
    assert nv.inits == 0  # NVML is not even opened for a CPU rank


def test_health_is_read_on_the_agent_thread_only(agent, monkeypatch):
    """Attaching opens nothing: the first NVML call comes from a pass (the agent thread's work)."""
    nv = FakeNvml()
    comp = GpuHealthCollector(nvml=nv)
    _with(agent, comp)
    assert nv.inits == 0 and not comp.up
    agent.tick()
    assert nv.inits == 1 and comp.up
    comp.uninstall()
    assert nv.shutdowns == 1
