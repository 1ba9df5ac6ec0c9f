"""Memory: RSS from /proc, the allocator behind a fake torch.cuda, post-step history, NVML degradation."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from hpar_agent.agent import Agent
from hpar_agent.collectors.memory import MemoryCollector, NvmlCollector, read_rss
from hpar_agent.device import resolve_device

L = {"rank": "0", "pp_stage": "0"}
PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc(tmp_path, rss_pages):
    d = tmp_path / "proc" / "self"
    d.mkdir(parents=True, exist_ok=True)
    (d / "statm").write_text(f"1000 {rss_pages} 50 10 0 300 0\n")
    return str(tmp_path / "proc")


def test_read_rss_from_fake_proc_root(tmp_path):
    assert read_rss(_proc(tmp_path, 25)) == 25 * PAGE
    assert read_rss(str(tmp_path / "missing")) is None


class FakeCuda:
    """torch.cuda's read API; records the device each read named (the agent thread's own is device 0)."""

    def __init__(self, initialized=True):
        self.initialized = initialized
        self.allocated = 1000
        self.reads = 0
        self.devices = set()

    def is_available(self):
        return True

    def is_initialized(self):
        return self.initialized

    def memory_allocated(self, device=None):
        self.reads += 1
        self.devices.add(device)
        return self.allocated

    def memory_reserved(self, device=None):
        self.devices.add(device)
        return 4096

    def memory_stats_as_nested_dict(self, device=None):
        self.reads += 1
        self.devices.add(device)
        return {
            "allocated_bytes": {"all": {"current": self.allocated}},
            "reserved_bytes": {"all": {"current": 4096}},
        }

    def memory_stats(self, device=None):
        self.reads += 1
        self.devices.add(device)
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": 5000,
            "reserved_bytes.all.current": 4096,
            "reserved_bytes.all.peak": 8192,
            "active_bytes.all.current": 900,
            "active_bytes.all.peak": 1200,
            "num_alloc_retries": 2,
            "num_ooms": 1,
        }


def _replace(agent, comp):
    """Swap the default component of the same name for ``comp`` (one family source per scrape)."""
    old = agent.component(comp.name)
    old.uninstall()
    agent.components.remove(old)
    if old in agent._step_hooks:
        agent._step_hooks.remove(old)
    agent.add_component(comp)


GPU1 = torch.device("cuda", 1)


@pytest.fixture
def agent(tmp_path):
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    a.start()
    a.device = a.context.device = GPU1  # as resolve_device fixes it at attach in local rank 1 of a GPU job
    try:
        yield a
    finally:
        a.stop()


def test_post_step_history_and_allocator(agent, tmp_path):
    root = _proc(tmp_path, 10)
    cuda = FakeCuda()
    mem = MemoryCollector(proc_root=root, cuda=cuda, history=3)
    _replace(agent, mem)
    for step in range(5):
        cuda.allocated = 1000 * (step + 1)
        _proc(tmp_path, 10 + step)
        agent.on_step_boundary(step, step * 100_000_000)  # 100 ms steps: every one reads the allocator
    agent.tick()
    assert list(mem.post_step["allocator"]) == [(2, 3000), (3, 4000), (4, 5000)]  # bounded history
    assert cuda.devices == {GPU1}  # every read names the rank's device, never the thread's current one
    assert [v for _, v in mem.post_step["rss"]] == [12 * PAGE, 13 * PAGE, 14 * PAGE]
    get = agent.registry.get_sample_value
    assert get("hpar_memory_post_step_bytes", {**L, "source": "allocator"}) == 5000
    assert get("hpar_memory_post_step_bytes", {**L, "source": "reserved"}) == 4096
    assert get("hpar_host_rss_bytes", L) == 14 * PAGE
    assert get("hpar_allocator_bytes", {**L, "kind": "active"}) == 900
    assert get("hpar_allocator_peak_bytes", {**L, "kind": "reserved"}) == 8192
    assert get("hpar_allocator_alloc_retries_total", L) == 2
    assert get("hpar_allocator_ooms_total", L) == 1


def test_fast_steps_read_the_allocator_once_per_gap(agent, tmp_path):
    """Steps 5 ms apart: the training thread reads the allocator on every 10th (50 ms gap), not on each."""
    cuda = FakeCuda()
    mem = MemoryCollector(proc_root=_proc(tmp_path, 10), cuda=cuda)
    _replace(agent, mem)
    t0 = 10**18
    for step in range(40):
        cuda.allocated = 1000 * (step + 1)
        agent.on_step_boundary(step, t0 + step * 5_000_000)
    agent.tick()
    assert [s for s, _ in mem.post_step["allocator"]] == [0, 10, 20, 30]
    assert [v for _, v in mem.post_step["allocator"]] == [1000, 11000, 21000, 31000]
    assert len(mem.post_step["rss"]) == 40  # host memory is still read every step


def test_allocator_untouched_until_cuda_is_initialized(agent, tmp_path):
    cuda = FakeCuda(initialized=False)
    mem = MemoryCollector(proc_root=_proc(tmp_path, 7), cuda=cuda)
    _replace(agent, mem)
    agent.on_step_boundary(0, 0)
    agent.tick()
    assert cuda.reads == 0
    assert "allocator" not in mem.post_step
    assert agent.registry.get_sample_value("hpar_allocator_bytes", {**L, "kind": "allocated"}) is None
    assert agent.registry.get_sample_value("hpar_memory_post_step_bytes", {**L, "source": "rss"}) == 7 * PAGE


def test_default_memory_reads_real_rss(agent):
    agent.tick()
    rss = agent.registry.get_sample_value("hpar_host_rss_bytes", L)
    assert rss is not None and rss > 10 * 2**20  # a Python process with torch loaded


def test_nvml_missing_is_down_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    a.start()
    try:
        a.tick()
        get = a.registry.get_sample_value
        assert get("hpar_agent_component_up", {**L, "component": "nvml"}) == 0
        assert get("hpar_agent_errors_total", {**L, "component": "nvml"}) == 0
        assert get("hpar_agent_component_up", {**L, "component": "memory"}) == 1
        assert get("hpar_host_rss_bytes", L) > 0
        assert get("hpar_gpu_memory_used_bytes", L) is None
    finally:
        a.stop()


class NotSupported(Exception):
    pass


class FakeNvml:
    NVMLError_NotSupported = NotSupported
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.power_calls = 0

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        self.index = i
        return ("dev", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.index = uuid
        return ("dev", uuid)

    def nvmlDeviceGetIndex(self, h):
        return 1

    def nvmlDeviceGetUUID(self, h):
        return b"GPU-5f1c0e2a-0000-4b1d-9a7e-000000000001"  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 3 << 30, "total": 80 << 30})()

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [type("P", (), {"pid": os.getpid(), "usedGpuMemory": 1 << 30})()]

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 75})()

    def nvmlDeviceGetPowerUsage(self, h):
        self.power_calls += 1
        raise NotSupported()

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetTotalEccErrors(self, h, etype, counter):
        return 4 if etype == self.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 | 0x40


def test_nvml_init_failing_is_down(agent):
    nv = NvmlCollector(nvml=FakeNvml(fail_init=True))
    _replace(agent, nv)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_agent_component_up", {**L, "component": "nvml"}) == 0


def test_nvml_is_down_in_a_process_that_sees_no_gpu(agent, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU rank on a GPU host must not report GPU 0
    agent.device = agent.context.device = resolve_device(None, None, 1)
    assert agent.device == torch.device("cpu")
    _replace(agent, NvmlCollector(nvml=FakeNvml()))
    agent.tick()
    assert agent.registry.get_sample_value("hpar_agent_component_up", {**L, "component": "nvml"}) == 0


@pytest.mark.parametrize(("visible", "expected"), [(None, 1), ("3,5", 5), ("GPU-aa,GPU-bb", "GPU-bb")])
def test_nvml_handle_is_the_ranks_device_through_cuda_visible_devices(agent, monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    fake = FakeNvml()
    _replace(agent, NvmlCollector(nvml=fake))
    assert fake.index == expected


def test_rank_info_carries_the_gpu_index_and_uuid(agent):
    """The labels a dashboard joins with dcgm-exporter's ``UUID`` / ``gpu`` labels."""
    _replace(agent, NvmlCollector(nvml=FakeNvml()))
    info = [s for m in agent.registry.collect() if m.name == "hpar_rank" for s in m.samples]
    assert len(info) == 1
    assert info[0].labels["gpu_uuid"] == "GPU-5f1c0e2a-0000-4b1d-9a7e-000000000001"
    assert info[0].labels["gpu_index"] == "1"


def test_resolve_device_prefers_the_models_cuda_parameters():
    class Model:
        def parameters(self):
            return iter([SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=GPU1)])

    assert resolve_device(Model(), None, 0) == GPU1
    assert resolve_device(None, SimpleNamespace(device_type="cpu"), 3) == torch.device("cpu")


def test_nvml_fields_degrade_one_by_one(agent):
    fake = FakeNvml()
    nv = NvmlCollector(nvml=fake)
    _replace(agent, nv)
    mem = MemoryCollector()
    _replace(agent, mem)
    agent.on_step_boundary(0, 0)
    agent.tick()
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_agent_component_up", {**L, "component": "nvml"}) == 1
    assert get("hpar_gpu_memory_used_bytes", L) == 3 << 30
    assert get("hpar_gpu_process_memory_bytes", L) == 1 << 30
    assert get("hpar_gpu_utilization_ratio", L) == 0.75
    assert get("hpar_gpu_power_watts", L) is None  # NotSupported: dropped ...
    assert fake.power_calls == 1  # ... and never asked again
    assert get("hpar_gpu_temperature_celsius", L) == 61
    assert get("hpar_gpu_clock_hertz", {**L, "clock": "sm"}) == 1980e6
    assert get("hpar_gpu_ecc_errors_total", {**L, "error_type": "corrected"}) == 4
    assert get("hpar_gpu_throttle_active", {**L, "reason": "hw_thermal"}) == 1
    assert get("hpar_gpu_throttle_active", {**L, "reason": "gpu_idle"}) == 0


def test_headroom_is_free_device_memory_plus_the_allocator_cache(agent, tmp_path):
    """NVML's total - used (80 - 3 GiB) plus what the allocator holds reserved but unallocated."""
    _replace(agent, NvmlCollector(nvml=FakeNvml()))
    cuda = FakeCuda()
    mem = MemoryCollector(proc_root=_proc(tmp_path, 10), cuda=cuda)
    _replace(agent, mem)  # after NVML: reads its values of the same pass
    agent.on_step_boundary(0, 0)
    agent.tick()
    headroom = (77 << 30) + 4096 - 1000
    assert agent.registry.get_sample_value("hpar_gpu_memory_headroom_bytes", L) == headroom
    assert list(mem.headroom_series) == [(0, headroom)] and mem.device_free == 77 << 30
    assert mem.summary()["headroom_bytes"] == headroom


def test_headroom_without_nvml_asks_cuda_and_is_absent_off_cuda(agent, tmp_path):
    _replace(agent, NvmlCollector(nvml=FakeNvml(fail_init=True)))
    cuda = FakeCuda()
    cuda.mem_get_info = lambda device=None: (5 << 30, 80 << 30)  # cudaMemGetInfo: (free, total)
    _replace(agent, MemoryCollector(proc_root=_proc(tmp_path, 10), cuda=cuda))
    agent.tick()
    assert agent.registry.get_sample_value("hpar_gpu_memory_headroom_bytes", L) == (5 << 30) + 4096 - 1000
    _replace(agent, MemoryCollector(proc_root=_proc(tmp_path, 10), cuda=FakeCuda(initialized=False)))
    agent.tick()
    assert agent.registry.get_sample_value("hpar_gpu_memory_headroom_bytes", L) is None


def test_series_holds_the_samples_not_drained_yet_once(agent, tmp_path):
    """What the out-of-memory record reads on the training thread: the steps since the last pass too."""
    cuda = FakeCuda()
    mem = MemoryCollector(proc_root=_proc(tmp_path, 10), cuda=cuda)
    _replace(agent, mem)
    for step in range(4):
        cuda.allocated = 1000 * (step + 1)
        agent.on_step_boundary(step, step * 100_000_000)
        if step == 1:
            agent.tick()
    mem.post_step["allocator"].append((2, 3000))  # drained while the series was read: counted once
    assert mem.series()["allocator"] == [(0, 1000), (1, 2000), (2, 3000), (3, 4000)]
