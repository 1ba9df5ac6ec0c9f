"""The health of this rank's GPU from NVML, read on the agent thread only (never the training thread).

What ``NvmlCollector`` (``memory``) already exports stays there: throttle reasons, SM clock, temperature,
power draw, ECC counts. This adds what tells a throttled or failing GPU from a waiting one: the SM clock's
maximum, the enforced power limit, retired pages (single/double-bit, and a retirement pending a reset),
remapped rows (Ampere and later: correctable, uncorrectable, pending, failed), Xid critical errors
(an NVML event set, polled with a zero timeout every pass: never blocks), the PCIe link's generation and
width against their maximum, and the NVLink error counters summed over the active links. Every series
carries the ``gpu`` label (the NVML index). A query NVML does not support on this GPU is asked once,
then left out; on a host without a GPU (or without nvidia-ml-py) nothing is exported: the series are
absent, not zero.

Reads: the Xid event set every pass (one call while no event waits); the rest every ``READ_EVERY_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from prometheus_client.core import Metric

from hpar_agent.collectors.memory import NvmlCollector, device_handle, nvml_init
from hpar_agent.component import Component

READ_EVERY_S = 10.0
#: Throttle reasons that slow a GPU down (idle is no slowdown). The power cap is among them, since a
#: culprit's line compares it with its peers', but it is normal at full load: GpuThrottled leaves it out.
SLOWING = frozenset({"hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake", "sw_power_cap"})
MAX_XIDS = 16  # distinct Xid codes a rank keeps a series for (the label's bound)
MAX_EVENTS_A_PASS = 64
NVLINK_COUNTERS = (
    ("replay", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("recovery", "NVML_NVLINK_ERROR_DL_RECOVERY"),
    ("crc_flit", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
)
RETIRED = (
    ("single_bit", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
    ("double_bit", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERRORS"),
)


def _nv(nv: Any, fn: str, *args: Any) -> Any:
    """``nv.<fn>(*args)``, each ``str`` argument the NVML constant of that name."""
    return getattr(nv, fn)(*(getattr(nv, a) if isinstance(a, str) else a for a in args))


class GpuHealthCollector(Component):
    name = "gpu_health"

    def __init__(self, nvml: Any = None) -> None:
        super().__init__()
        self._nvml = nvml  # injectable for tests; else ``import pynvml`` on the first pass
        self._handle: Any = None
        self._tried = False
        self.up = False
        self.gpu = ""
        self._unsupported: set[str] = set()
        self._events: Any = None  # the Xid event set
        self._read_at = 0.0
        self.values: dict[str, Any] = {}  # what the last read gave: name -> value or {label: value}
        self.xids: dict[int, int] = {}  # Xid code -> events seen
        self.last_xid: tuple[int, float] | None = None  # (code, epoch s) of the last Xid event
        self.throttled_since: dict[str, float] = {}  # throttle reason -> epoch s it became active

    # ------------------------------------------------------------------------------------ agent thread
    def _start(self) -> None:
        """NVML and this rank's GPU handle, on the first pass (the agent thread)."""
        self._tried = True
        ctx = self.require_ctx()
        if getattr(ctx.device, "type", "cpu") != "cuda":
            return
        try:
            nv = self._nvml = nvml_init(self._nvml)
        except Exception:  # no driver or no nvidia-ml-py: a normal state, nothing to export
            return
        try:
            self._handle = device_handle(nv, ctx.device)
            self.gpu = str(nv.nvmlDeviceGetIndex(self._handle))
        except Exception as exc:
            self.record_error(exc)
            nv.nvmlShutdown()
            return
        self.up = True
        try:
            events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(self._handle, nv.nvmlEventTypeXidCriticalError, events)
            self._events = events
        except Exception:  # not supported here (e.g. some containers): no Xid series
            self._events = None

    def _get(self, field: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None when NVML cannot tell (asked no more once it says it does not support it)."""
        if field in self._unsupported:
            return None
        try:
            return fn()
        except Exception as exc:
            nv = self._nvml
            if isinstance(
                exc,
                (getattr(nv, "NVMLError_NotSupported", ()), getattr(nv, "NVMLError_FunctionNotFound", ())),
            ):
                self._unsupported.add(field)
            return None

    def poll(self, now: float) -> None:
        if not self._tried:
            self._start()
        if not self.up:
            return
        self._poll_xids()
        self._note_throttles(now)
        if now - self._read_at >= READ_EVERY_S or self.require_ctx().stopping:
            self._read_at = now
            self.values = self._read()

    def _note_throttles(self, now: float) -> None:
        """Since when each slowing throttle reason has been active (the memory collector reads them)."""
        nv = self.require_ctx().find(NvmlCollector)
        active = {r for r, on in ((nv.values.get("throttle") or {}) if nv is not None else {}).items() if on}
        for reason in SLOWING & active:
            self.throttled_since.setdefault(reason, now)
        for reason in set(self.throttled_since) - active:
            del self.throttled_since[reason]

    def describe(self) -> str:
        """One line on this GPU's state, e.g. ``GPU 5: hw_slowdown since 14:02:11, SM clock 1,410 MHz
        against 1,980``: what a verdict naming this rank can quote."""
        nv = self.require_ctx().find(NvmlCollector)
        sm = ((nv.values.get("clocks") or {}).get("sm") if nv is not None else None) or 0.0
        top = (self.values.get("clock_max") or {}).get("sm") or 0.0
        parts = [
            f"{r} since {time.strftime('%H:%M:%S', time.localtime(t))}"
            for r, t in sorted(self.throttled_since.items())
        ]
        if sm and top:
            parts.append(f"SM clock {sm / 1e6:,.0f} MHz against {top / 1e6:,.0f}")
        return f"GPU {self.gpu}: " + (", ".join(parts) or "no reading")

    def _poll_xids(self) -> None:
        nv, events = self._nvml, self._events
        if events is None:
            return
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        for _ in range(MAX_EVENTS_A_PASS):
            try:
                data = wait(events, 0)  # 0 ms: returns at once (NVMLError_Timeout when none waits)
            except Exception:
                return
            code = int(getattr(data, "eventData", 0))
            if code in self.xids or len(self.xids) < MAX_XIDS:
                self.xids[code] = self.xids.get(code, 0) + 1
            self.last_xid = (code, time.time())

    def _read(self) -> dict[str, Any]:
        nv, h = self._nvml, self._handle
        v: dict[str, Any] = {}
        clocks = {}
        for label, const in (("sm", "NVML_CLOCK_SM"), ("mem", "NVML_CLOCK_MEM")):
            mhz = self._get(f"max_{label}", partial(_nv, nv, "nvmlDeviceGetMaxClockInfo", h, const))
            if mhz is not None:
                clocks[label] = float(mhz) * 1e6
        v["clock_max"] = clocks
        limit = self._get("power_limit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h))
        if limit is not None:
            v["power_limit"] = float(limit) / 1000.0
        for key, cur, top in (
            ("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration"),
            ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth"),
        ):
            link = {}
            for which, fn in (("current", cur), ("max", top)):
                val = self._get(f"{key}_{which}", partial(_nv, nv, fn, h))
                if val is not None:
                    link[which] = float(val)
            v[key] = link
        pages = {}
        for cause, const in RETIRED:
            got = self._get(f"retired_{cause}", partial(_nv, nv, "nvmlDeviceGetRetiredPages", h, const))
            if got is not None:
                pages[cause] = float(len(got))
        v["retired"] = pages
        pending = self._get("retired_pending", lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        if pending is not None:
            v["retired_pending"] = float(bool(pending))
        rows = self._get("remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, is_pending, failed = rows
            v["remapped"] = {
                "correctable": float(corr),
                "uncorrectable": float(unc),
                "pending": float(bool(is_pending)),
                "failed": float(bool(failed)),
            }
        v["nvlink"] = self._nvlink(nv, h)
        return v

    def _nvlink(self, nv: Any, h: Any) -> dict[str, float]:
        """NVLink error counters summed over the active links ({} without NVLink)."""
        if "nvlink" in self._unsupported:
            return {}
        out: dict[str, float] = {}
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if not nv.nvmlDeviceGetNvLinkState(h, link):
                    continue
            except Exception:
                if link == 0:
                    self._unsupported.add("nvlink")
                break
            for kind, const in NVLINK_COUNTERS:
                n = self._get(
                    f"nvlink_{kind}", partial(_nv, nv, "nvmlDeviceGetNvLinkErrorCounter", h, link, const)
                )
                if n is not None:
                    out[kind] = out.get(kind, 0.0) + float(n)
        return out

    def uninstall(self) -> None:
        nv = self._nvml
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except Exception:
                pass
            self._events = None
        if self.up:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass
        self.up = False

    # ------------------------------------------------------------------------------------ outputs
    def collect(self) -> Iterable[Metric]:
        if not self.up:
            return
        f = self.require_ctx().families
        v, gpu = self.values, self.gpu

        def labelled(name: str, key: str) -> Metric:
            fam = f.counter(name) if name.endswith("_total") else f.gauge(name)
            for label, value in sorted((v.get(key) or {}).items()):
                f.add(fam, [gpu, label], value)
            return fam

        def single(name: str, key: str) -> Metric:
            fam = f.gauge(name)
            if key in v:
                f.add(fam, [gpu], v[key])
            return fam

        yield labelled("hpar_gpu_clock_max_hertz", "clock_max")
        yield single("hpar_gpu_power_limit_watts", "power_limit")
        yield labelled("hpar_gpu_pcie_link_generation", "pcie_gen")
        yield labelled("hpar_gpu_pcie_link_width", "pcie_width")
        yield labelled("hpar_gpu_retired_pages", "retired")
        yield single("hpar_gpu_retired_pages_pending", "retired_pending")
        yield labelled("hpar_gpu_remapped_rows", "remapped")
        yield labelled("hpar_gpu_nvlink_errors_total", "nvlink")
        xid = f.counter("hpar_gpu_xid_events_total")
        if self._events is not None:
            for code, n in sorted(self.xids.items()):
                f.add(xid, [gpu, str(code)], n)
        yield xid

    def summary(self) -> dict[str, Any]:
        if not self.up:
            return {"up": False}
        return {
            "up": True,
            "gpu": self.gpu,
            **{k: v for k, v in self.values.items() if v not in ({}, None)},
            "xid_events": {str(k): n for k, n in sorted(self.xids.items())},
            "xid_events_watched": self._events is not None,
            "last_xid": None if self.last_xid is None else {"xid": self.last_xid[0], "at": self.last_xid[1]},
            "throttled_since": dict(self.throttled_since),
            "state": self.describe(),
        }
