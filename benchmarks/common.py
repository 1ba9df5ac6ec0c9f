"""What the component benchmarks share: the trainer's arguments per device, ``/proc`` readers, the
garbage-collector watch, a hook at the reference trainer's end of training, and the results header.

Each component benchmark isolates one cost, so it shows up where it is paid instead of inside a noisy
end-to-end step-time ratio (``overhead.py``); garbage-collector pauses are recorded alongside (a
collection holds the GIL, so allocation by any agent thread can stall the training thread):

1. ``hook_cost.py``: the training thread's hooks, µs per optimizer step;
2. ``agent_cpu.py``: the agent threads' CPU (fraction of one core, µs per step);
3. ``metrics_render.py``: ``/metrics`` render and scrape time against the series count;
4. ``agent_rss.py``: the resident memory the agent adds;
5. ``span_export.py``: span export with the exporter saturated, and the training thread meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# Trainer arguments per device (agent_cpu, agent_rss, metrics_render's one-rank run), span-test stage per
# device (span_export).
CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {
        "trainer": ["--compile", "aot_eager", "--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32",
                    "--global-batch", "8", "--device", "cpu"],
        "window_s": 10.0,
        "rss_steps": 60,
        "span_stage": {"dim": 64, "hidden": 256, "batch": 32, "dtype": torch.float32},
    },
    "cuda": {
        "trainer": ["--compile", "inductor", "--dtype", "bf16", "--layers", "4", "--dim", "1024", "--heads", "8",
                    "--seq-len", "512", "--global-batch", "8", "--lr", "3e-4", "--device", "cuda"],
        "window_s": 10.0,
        "rss_steps": 40,
        "span_stage": {"dim": 1024, "hidden": 4096, "batch": 64, "dtype": torch.bfloat16},
    },
}  # fmt: skip
SKIP_STEPS = 5


# ------------------------------------------------------------------------------------------ small helpers
def summarize(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """Median / p99 / max / mean (times ``scale``) of a list of samples."""
    v = sorted(values)
    if not v:
        return {}
    return {"n": len(v), "median": statistics.median(v) * scale, "p99": v[min(len(v) - 1, int(0.99 * len(v)))] * scale,
            "max": v[-1] * scale, "mean": statistics.fmean(v) * scale}  # fmt: skip


def task_cpu() -> dict[int, tuple[str, float, float | None]]:
    """Every task of this process: tid -> (comm, utime+stime seconds from stat, seconds from schedstat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid_s in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid_s}/stat").read_text()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
            try:
                sched = int(Path(f"/proc/self/task/{tid_s}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                sched = None
        except (OSError, ValueError):
            continue  # the task exited while we read
        out[int(tid_s)] = (comm, ticks, sched)
    return out


def process_cpu() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / VmSize of this process (or ``pid``) in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSize"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class GcWatch:
    """The garbage collector's pauses (any thread; a collection holds the GIL) while inside the block."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (start, end, generation), perf_counter
        self._t: float | None = None

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.pauses.append((self._t, time.perf_counter(), info["generation"]))
            self._t = None

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            d = [e - b for b, e, g in self.pauses if g == gen]
            if d:
                out[f"gen{gen}"] = {"count": len(d), "max_ms": max(d) * 1e3, "total_ms": sum(d) * 1e3}
        return out

    def overlapping(self, t0: float, t1: float) -> float:
        """Seconds of collection inside [t0, t1]."""
        return sum(max(0.0, min(e, t1) - max(b, t0)) for b, e, _g in self.pauses)


def full_gc_ms() -> float:
    """Time of one forced full collection of this process now (what a generation-2 pause costs)."""
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def before_detach(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` in the trainer right after its last step, before it detaches the agent."""
    import hpar_trainer.train as train

    orig = train.detach_observability

    def patched(timeout: float = 15.0) -> None:
        try:
            fn()
        finally:
            orig(timeout)

    train.detach_observability = patched
    try:
        yield
    finally:
        train.detach_observability = orig


def current_agent() -> Any:
    import hpar_agent

    agent = hpar_agent.agent.current()
    return agent if agent is not None and agent.started else None


def time_ticks(agent: Any, record: Callable[[float, float], None]) -> None:
    """Report (start, end) of each agent pass: ``tick`` wrapped as an instance attribute (the agent
    thread's loop calls ``self.tick()``)."""
    orig_tick = agent.tick

    def tick(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_tick(*args, **kwargs)
        finally:
            record(t0, time.perf_counter())

    agent.tick = tick


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:+.1f} MiB"


# ------------------------------------------------------------------------------------------ results
def need_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a GPU")


def results(script: str, device: str, argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """The header of every component benchmark's results: machine, torch, date, command, load."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": f"python -m benchmarks.{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        **extra, "load_avg_start": os.getloadavg(), "t_start": time.time(),
    }  # fmt: skip


def finish(r: dict[str, Any], json_path: str | None) -> None:
    """Close the results (wall time, load) and write them to ``json_path`` when given."""
    r["load_avg_end"] = os.getloadavg()
    r["wall_s"] = time.time() - r["t_start"]
    if json_path:
        Path(json_path).write_text(json.dumps(r, indent=1, default=str))


def title(r: dict[str, Any], what: str) -> str:
    return f"\n=== {what} ({r['device']}, torch {r['torch']}, {r['cpu_count']} cores, {r['wall_s']:.0f} s) ==="
