"""Memory: NVML (device and process), the CUDA caching allocator, host RSS, and post-step samples.

``NvmlCollector`` (component ``nvml``) owns NVML so its availability shows as
``hpar_agent_component_up{component="nvml"}``: 0 on hosts without a GPU or without nvidia-ml-py,
while everything else keeps working. Each NVML field degrades on its own: a field the device does not
support (NVMLError_NotSupported) is dropped for good, other errors skip one sample.

``MemoryCollector`` (component ``memory``) reads the allocator only once CUDA is initialized (it never
initializes CUDA itself) and RSS from ``/proc/self/statm``. Post-step samples (RSS, allocated and
reserved bytes: host-side reads) are taken in the step hook and kept per step for the leak detector.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent.affinity import Binding, read_binding
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.component import Component

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

#: NVML clock-event (throttle) reason bits -> ``reason`` label.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)
POST_STEP_HISTORY = 512
#: Least time between two allocator reads on the training thread (``MemoryCollector.step_hook``).
ALLOCATOR_GAP_NS = 50_000_000


def read_rss(proc_root: str = "/proc", pid: str = "self") -> int | None:
    """Resident set size in bytes from ``<proc_root>/<pid>/statm`` (second field, in pages)."""
    try:
        with open(os.path.join(proc_root, pid, "statm"), "rb") as fh:
            fields = fh.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class RssReader:
    """RSS through one kept-open ``statm`` descriptor: the post-step sample runs on the training
    thread, where a ``pread`` costs a fraction of open/read/close (docs/overhead.md)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.page = os.sysconf("SC_PAGE_SIZE")
        try:
            self.fd: int | None = os.open(os.path.join(proc_root, "self", "statm"), os.O_RDONLY)
        except OSError:
            self.fd = None

    def read(self) -> int | None:
        if self.fd is None:
            return None
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) * self.page
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _call(nv: Any, fn: str, handle: Any, *consts: str) -> Any:
    """``nv.<fn>(handle, nv.<const>...)``: NVML calls taking enum constants by name."""
    return getattr(nv, fn)(handle, *(getattr(nv, c) for c in consts))


def nvml_init(nv: Any = None) -> Any:
    """NVML started: ``nv`` (a stand-in in tests), else ``pynvml``; raises without a driver or the
    package (a normal state for the callers, not an error)."""
    if nv is None:
        import pynvml

        nv = pynvml
    nv.nvmlInit()
    return nv


def device_handle(nv: Any, device: Any) -> Any:
    """The NVML handle of this rank's device (``agent.device``, fixed at attach): never the reading
    thread's current device, which is device 0 on every thread the agent starts."""
    from hpar_agent.device import nvml_index

    if getattr(device, "type", "cpu") != "cuda":
        raise RuntimeError("this rank has no GPU")  # a CPU rank on a GPU host: no GPU series
    index = nvml_index(device)
    if isinstance(index, str):
        return nv.nvmlDeviceGetHandleByUUID(index)
    return nv.nvmlDeviceGetHandleByIndex(index)


class NvmlCollector(Component):
    """NVML device and process telemetry for this rank's GPU."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        super().__init__()
        self.up = False
        self._nvml = nvml  # injectable for tests; else ``import pynvml``
        self._handle: Any = None
        self._unsupported: set[str] = set()
        self.values: dict[str, Any] = {}  # field -> value (dicts for labelled fields)
        self.process_bytes: int | None = None
        self.gpu_index = ""  # hpar_rank_info's gpu_index / gpu_uuid; empty without a GPU handle
        self.gpu_uuid = ""
        self.binding: Binding | None = None  # CPU/NUMA binding against the GPU's ideal CPUs (read once)

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._install()
        try:
            self.binding = read_binding(self._nvml if self.up else None, self._handle)
        except Exception as exc:
            ctx.record_error(self.name, exc)

    def _install(self) -> None:
        ctx = self.require_ctx()
        try:
            nv = self._nvml = nvml_init(self._nvml)
            self._handle = device_handle(nv, ctx.device)
            self.up = True
            self._read_identity(nv, self._handle)
        except Exception:  # no driver, no GPU, no nvidia-ml-py: a normal state, not an error
            if self._nvml is not None and self._handle is None:
                try:
                    self._nvml.nvmlShutdown()  # initialised, but no handle: leave NVML as we found it
                except Exception:
                    pass
            self.up = False
            self._handle = None

    def _read_identity(self, nv: Any, handle: Any) -> None:
        """The GPU's NVML index and UUID, read once: labels of ``hpar_rank_info`` (the UUID is what
        dcgm-exporter's ``UUID`` label holds). A field NVML cannot give stays empty."""
        for attr, fn in (("gpu_index", "nvmlDeviceGetIndex"), ("gpu_uuid", "nvmlDeviceGetUUID")):
            try:
                value = getattr(nv, fn)(handle)
                setattr(self, attr, value.decode() if isinstance(value, bytes) else str(value))
            except Exception:
                pass

    def uninstall(self) -> None:
        if self.up and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self.up = False

    def _get(self, field: str, fn: Callable[[], Any]) -> Any:
        if field in self._unsupported:
            return None
        nv = self._nvml
        try:
            return fn()
        except Exception as exc:
            if nv is not None and isinstance(exc, getattr(nv, "NVMLError_NotSupported", ())):
                self._unsupported.add(field)
            return None

    def poll(self, now: float) -> None:
        if not self.up:
            return
        nv, h = self._nvml, self._handle
        v: dict[str, Any] = {}
        mem = self._get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            v["used"], v["total"] = int(mem.used), int(mem.total)
        procs = self._get("processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
        if procs is not None:
            pid = os.getpid()
            mine = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory is not None]
            self.process_bytes = int(sum(mine)) if mine else None
        util = self._get("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            v["utilization"] = util.gpu / 100.0
        power = self._get("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        if power is not None:
            v["power"] = power / 1000.0
        temp = self._get("temperature", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        if temp is not None:
            v["temperature"] = float(temp)
        clocks = {}
        for label, const in (("sm", "NVML_CLOCK_SM"), ("mem", "NVML_CLOCK_MEM")):
            mhz = self._get(
                f"clock_{label}", functools.partial(_call, nv, "nvmlDeviceGetClockInfo", h, const)
            )
            if mhz is not None:
                clocks[label] = mhz * 1e6
        v["clocks"] = clocks
        ecc = {}
        for label, const in (
            ("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
            ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
        ):
            n = self._get(
                f"ecc_{label}",
                functools.partial(_call, nv, "nvmlDeviceGetTotalEccErrors", h, const, "NVML_VOLATILE_ECC"),
            )
            if n is not None:
                ecc[label] = int(n)
        v["ecc"] = ecc
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        mask = self._get("throttle", lambda: reasons_fn(h)) if reasons_fn is not None else None
        v["throttle"] = (
            {} if mask is None else {name: int(bool(mask & bit)) for bit, name in THROTTLE_REASONS}
        )
        self.values = v

    def collect(self) -> Iterable[Metric]:
        if not self.up:
            return
        f = self.require_ctx().families
        v = self.values
        for name, key in (
            ("hpar_gpu_memory_used_bytes", "used"),
            ("hpar_gpu_memory_total_bytes", "total"),
            ("hpar_gpu_utilization_ratio", "utilization"),
            ("hpar_gpu_power_watts", "power"),
            ("hpar_gpu_temperature_celsius", "temperature"),
        ):
            g = f.gauge(name)
            if key in v:
                f.add(g, [], v[key])
            yield g
        g = f.gauge("hpar_gpu_process_memory_bytes")
        if self.process_bytes is not None:
            f.add(g, [], self.process_bytes)
        yield g
        clock = f.gauge("hpar_gpu_clock_hertz")
        for label, hz in sorted(v.get("clocks", {}).items()):
            f.add(clock, [label], hz)
        yield clock
        ecc = f.counter("hpar_gpu_ecc_errors_total")
        for label, n in sorted(v.get("ecc", {}).items()):
            f.add(ecc, [label], n)
        yield ecc
        thr = f.gauge("hpar_gpu_throttle_active")
        for label, on in sorted(v.get("throttle", {}).items()):
            f.add(thr, [label], on)
        yield thr

    def summary(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "process_bytes": self.process_bytes,
            **{k: self.values.get(k) for k in ("used", "total")},
        }


#: One step's reads: (step, RSS, allocated, reserved bytes; None: not read). A plain tuple: see ``buffer``.
PostStep = tuple[int, int | None, int | None, int | None]


class MemoryCollector(Component):
    """Allocator, RSS and the per-step memory history the MemoryLeak detector reads."""

    name = "memory"

    def __init__(self, proc_root: str = "/proc", cuda: Any = None, history: int = POST_STEP_HISTORY) -> None:
        super().__init__()
        self.proc_root = proc_root
        self._cuda = cuda  # injectable torch.cuda stand-in for tests
        self.buffer: BoundedBuffer[PostStep] = BoundedBuffer("memory", 4096)
        self.buffers = (self.buffer,)
        self.history = history
        self.post_step: dict[str, deque[tuple[int, int]]] = {}
        self.last_post: dict[str, int] = {}
        self.rss: int | None = None
        self.allocator: dict[str, float] = {}
        self.served: int | None = None  # allocations the allocator has served since the process began
        self.device_free: int | None = None  # device memory no process holds
        self.headroom: int | None = (
            None  # what this process can still allocate (hpar_gpu_memory_headroom_bytes)
        )
        self.headroom_series: deque[tuple[int, int]] = deque(maxlen=history)  # (last step, headroom) a pass
        self._rss = RssReader(proc_root)
        self._cuda_seen = False
        self._alloc_read_ns = -ALLOCATOR_GAP_NS  # step-boundary ns of the last allocator read
        self._device: Any = None

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._device = ctx.device
        if self._cuda is None:
            import torch

            self._cuda = torch.cuda

    def uninstall(self) -> None:
        self._rss.close()

    def _cuda_ready(self) -> bool:
        """CUDA in use by the program (never initialized by us); once true it stays true, cached."""
        if not self._cuda_seen:
            cuda = self._cuda
            on_gpu = getattr(self._device, "type", "cuda") == "cuda"  # a CPU rank reads no allocator
            self._cuda_seen = (
                on_gpu and cuda is not None and bool(cuda.is_initialized()) and bool(cuda.is_available())
            )
        return self._cuda_seen

    def step_hook(self, step: int, t_ns: int) -> None:
        """Training thread: host-side reads only (statm, the allocator's counters), then append.

        One ``memory_stats_as_nested_dict`` read (``memory_allocated`` and ``memory_reserved`` would
        each build the flat stats dict), and none within ``ALLOCATOR_GAP_NS`` of the last: even one read
        is a share of a fast loop's step (docs/overhead.md), and a leak's trend is per step either way."""
        rss = self._rss.read()
        alloc = reserved = None
        if self._cuda_ready() and abs(t_ns - self._alloc_read_ns) >= ALLOCATOR_GAP_NS:
            self._alloc_read_ns = t_ns
            stats = self._cuda.memory_stats_as_nested_dict(self._device)
            alloc = int(stats["allocated_bytes"]["all"]["current"])
            reserved = int(stats["reserved_bytes"]["all"]["current"])
        self.buffer.put((step, rss, alloc, reserved))

    def _post(self, source: str, step: int, value: int | None) -> None:
        if value is None:
            return
        self.post_step.setdefault(source, deque(maxlen=self.history)).append((step, value))
        self.last_post[source] = value

    def poll(self, now: float) -> None:
        last_step = None
        for step, rss, alloc, reserved in self.buffer.drain():
            self._post("rss", step, rss)
            self._post("allocator", step, alloc)
            self._post("reserved", step, reserved)
            last_step = step
        nvml = self.ctx.find(NvmlCollector) if self.ctx is not None else None
        if last_step is not None and nvml is not None and nvml.up:
            self._post("nvml", last_step, getattr(nvml, "process_bytes", None))
        self.rss = read_rss(self.proc_root)
        self._read_allocator()
        self._read_headroom(nvml, last_step)

    def _read_allocator(self) -> None:
        if self._cuda_ready():
            s = self._cuda.memory_stats(self._device)
            self.served = s.get("allocation.all.allocated")  # a count: progress's motion (steps.py)
            self.allocator = {
                key: float(s.get(stat, 0))
                for key, stat in (
                    ("allocated", "allocated_bytes.all.current"),
                    ("reserved", "reserved_bytes.all.current"),
                    ("active", "active_bytes.all.current"),
                    ("allocated_peak", "allocated_bytes.all.peak"),
                    ("reserved_peak", "reserved_bytes.all.peak"),
                    ("active_peak", "active_bytes.all.peak"),
                    ("retries", "num_alloc_retries"),
                    ("ooms", "num_ooms"),
                )
            }

    def _read_headroom(self, nvml: NvmlCollector | None, step: int | None) -> None:
        """Device memory free (NVML's total - used, every process counted; else cudaMemGetInfo) plus
        the allocator's cache (reserved - allocated), which it reuses, or frees and retries with, before
        it gives up: what this process can still allocate before an out-of-memory."""
        free = None
        v = nvml.values if nvml is not None and nvml.up else {}
        if "used" in v and "total" in v:
            free = int(v["total"]) - int(v["used"])
        elif self.allocator and hasattr(self._cuda, "mem_get_info"):
            free = int(self._cuda.mem_get_info(self._device)[0])
        if free is None or not self.allocator:
            return
        self.device_free = free
        self.headroom = free + max(0, int(self.allocator["reserved"] - self.allocator["allocated"]))
        if step is not None:
            self.headroom_series.append((step, self.headroom))

    def series(self) -> dict[str, list[tuple[int, int]]]:
        """Every source's post-step samples up to now, those the agent thread has not drained yet
        included, and the headroom of each pass (any thread: the out-of-memory record reads it there)."""
        pending = self.buffer.peek()  # before the copies: an item drained in between is then in both
        merged = {k: dict(v) for k, v in list(self.post_step.items())}
        for step, rss, alloc, reserved in pending:
            for source, value in (("rss", rss), ("allocator", alloc), ("reserved", reserved)):
                if value is not None:
                    merged.setdefault(source, {})[step] = value
        out = {k: sorted(v.items()) for k, v in merged.items()}
        out["headroom"] = list(self.headroom_series)
        return out

    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        rss = f.gauge("hpar_host_rss_bytes")
        if self.rss is not None:
            f.add(rss, [], self.rss)
        yield rss
        post = f.gauge("hpar_memory_post_step_bytes")
        for source, value in sorted(self.last_post.items()):
            f.add(post, [source], value)
        yield post
        if not self.allocator:
            return
        a = self.allocator
        cur, peak = f.gauge("hpar_allocator_bytes"), f.gauge("hpar_allocator_peak_bytes")
        for kind in ("allocated", "reserved", "active"):
            f.add(cur, [kind], a[kind])
            f.add(peak, [kind], a[f"{kind}_peak"])
        yield cur
        yield peak
        if self.headroom is not None:
            headroom = f.gauge("hpar_gpu_memory_headroom_bytes")
            f.add(headroom, [], self.headroom)
            yield headroom
        retries, ooms = (
            f.counter("hpar_allocator_alloc_retries_total"),
            f.counter("hpar_allocator_ooms_total"),
        )
        f.add(retries, [], a["retries"])
        f.add(ooms, [], a["ooms"])
        yield retries
        yield ooms

    def summary(self) -> dict[str, Any]:
        return {
            "rss_bytes": self.rss,
            "post_step_last": dict(self.last_post),
            "allocator": dict(self.allocator),
            "device_free_bytes": self.device_free,
            "headroom_bytes": self.headroom,
        }
