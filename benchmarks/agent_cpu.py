"""Agent-thread CPU (fraction of one core, and µs per step) of the reference trainer in-process.

World size 1, ``overhead.run_inprocess``'s "on" arm (defaults, ``HPAR_TRACES=file``), once at the
default sampling and once with every step traced. utime+stime and the ns ``schedstat`` of every task in
``/proc/self/task`` are read after warm-up and when training ends; the agent's threads are matched by
name through ``threading.enumerate()`` native ids: ``hpar-agent`` (polls, builds spans),
``OtelBatchSpanRecordProcessor`` (encodes and writes spans), prometheus_client's ``serve_forever``.
The agent thread's CPU is also split by component (``poll``/``on_step``/``export_step`` wrapped on the
instances, ``time.thread_time``).

    python -m benchmarks.agent_cpu --json agent-cpu-cpu.json
    python -m benchmarks.agent_cpu --device cuda --json agent-cpu-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONFIGS,
    SKIP_STEPS,
    GcWatch,
    before_detach,
    current_agent,
    finish,
    need_device,
    process_cpu,
    results,
    summarize,
    task_cpu,
    time_ticks,
    title,
)

AGENT_THREADS = {"hpar-agent": "agent", "OtelBatchSpanRecordProcessor": "span exporter", "serve_forever": "metrics server"}


def thread_label(name: str) -> str:
    for key, label in AGENT_THREADS.items():
        if key in name:
            return label
    return "training (main)" if name == "MainThread" else "other python"


def time_agent_parts(agent: Any, acc: dict[str, float], active: threading.Event, ticks: list[float]) -> None:
    """Wrap (on the instances) every component's ``poll``/``on_step`` and ``Tracing.export_step`` to add up
    the CPU time of the calling thread (the agent thread) spent in each while ``active`` is set, and
    ``tick`` to record the wall time of each agent pass."""

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            if not active.is_set():
                return fn(*args)
            c0 = time.thread_time()
            try:
                return fn(*args)
            finally:
                acc[name] = acc.get(name, 0.0) + time.thread_time() - c0

        return wrapper

    for comp in agent.components:
        comp.poll = timed(comp.name, comp.poll)
        comp.on_step = timed(comp.name, comp.on_step)
    if getattr(agent, "tracing", None) is not None:
        agent.tracing.export_step = timed("tracing (build spans)", agent.tracing.export_step)
    time_ticks(agent, lambda t0, t1: ticks.append(t1 - t0) if active.is_set() else None)


class Sampler(threading.Thread):
    """Marks the start of the steady window (first sample with >= ``skip`` steps); ``end()`` the end.
    Also times the agent thread's work per component inside the window (``time_agent_parts``)."""

    def __init__(self, skip: int) -> None:
        super().__init__(name="components-sampler", daemon=True)
        self.skip = skip
        self.start_snap: dict[str, Any] | None = None
        self.end_snap: dict[str, Any] | None = None
        self._stop_evt = threading.Event()
        self.gc: GcWatch | None = None
        self.parts: dict[str, float] = {}
        self.ticks: list[float] = []
        self._active = threading.Event()

    @staticmethod
    def snapshot(agent: Any) -> dict[str, Any]:
        steps = agent.component("steps") if agent is not None else None
        return {"wall": time.perf_counter(), "steps": getattr(steps, "count", 0), "tasks": task_cpu(),
                "process_cpu": process_cpu(), "names": {t.native_id: t.name for t in threading.enumerate()}}  # fmt: skip

    def run(self) -> None:
        wrapped = None
        while not self._stop_evt.wait(0.05):
            agent = current_agent()
            steps = agent.component("steps") if agent is not None else None
            if steps is not None and agent is not wrapped and getattr(steps, "count", 0) >= 1:  # attach() is done
                time_agent_parts(agent, self.parts, self._active, self.ticks)
                wrapped = agent
            if steps is not None and getattr(steps, "count", 0) >= self.skip:  # boundaries seen (training thread)
                self.start_snap = self.snapshot(agent)
                self._active.set()
                self.gc = GcWatch().__enter__()
                return

    def end(self) -> None:
        self._stop_evt.set()
        self._active.clear()
        self.end_snap = self.snapshot(current_agent())
        if self.gc is not None:
            self.gc.__exit__()


def cpu_window(a: dict[str, Any], b: dict[str, Any], exclude: int | None) -> dict[str, Any]:
    """CPU seconds per wall second of each task alive at both snapshots (but ``exclude``), grouped by label."""
    wall = b["wall"] - a["wall"]
    names = {**a["names"], **b["names"]}
    per_thread: dict[str, dict[str, Any]] = {}
    for tid, (comm, ticks1, sched1) in b["tasks"].items():
        if tid not in a["tasks"] or tid == exclude:
            continue
        _c, ticks0, sched0 = a["tasks"][tid]
        name = names.get(tid)
        label = thread_label(name) if name else "native (torch/gloo/...)"
        cpu = (sched1 - sched0) if sched0 is not None and sched1 is not None else ticks1 - ticks0
        d = per_thread.setdefault(label, {"cpu_s": 0.0, "stat_ticks_s": 0.0, "threads": []})
        d["cpu_s"] += cpu
        d["stat_ticks_s"] += ticks1 - ticks0
        d["threads"].append(name or comm)
    for d in per_thread.values():
        d["cores"] = d["cpu_s"] / wall
    agent_cpu = sum(per_thread[lab]["cpu_s"] for lab in AGENT_THREADS.values() if lab in per_thread)
    steps = b["steps"] - a["steps"]
    return {
        "window_s": wall, "steps": steps, "steps_per_s": steps / wall if wall else None,
        "per_thread": per_thread, "agent_threads_cores": agent_cpu / wall,
        "agent_threads_us_per_step": agent_cpu / steps * 1e6 if steps else None,
        "process_cores": (b["process_cpu"] - a["process_cpu"]) / wall,
    }  # fmt: skip


def trainer_steps_per_s(out: str) -> float:
    times = json.loads(Path(out).read_text())["step_times"][SKIP_STEPS:]
    return 1.0 / statistics.median(times)


def measure_agent_cpu(cfg: dict[str, Any], work: str, window_s: float) -> dict[str, Any]:
    """Warm-up run (compile caches, step time), then one run per sampling with a sampled steady window."""
    from benchmarks.overhead import arm_env, run_inprocess

    def args_for(steps: int, out: str) -> list[str]:
        return [*cfg["trainer"], "--steps", str(steps), "--log-every", "100000", "--out", out]

    warm_out = os.path.join(work, "warm.json")
    t0 = time.perf_counter()
    run_inprocess("on", args_for(SKIP_STEPS + 30, warm_out), arm_env("on", os.path.join(work, "warm"), "comp-warm"))
    rate = trainer_steps_per_s(warm_out)

    def steps_for(rate: float) -> int:
        return SKIP_STEPS + max(20, min(50_000, int(window_s * rate)))

    steps = steps_for(rate)
    result: dict[str, Any] = {"warmup_s": time.perf_counter() - t0, "warmup_steps_per_s": rate, "steps": steps, "runs": {}}
    for label, every in (("default sampling (HPAR_TRACE_EVERY=10)", None), ("every step traced", "1")):
        env = arm_env("on", os.path.join(work, f"cpu-{every or 10}"), f"comp-cpu-{every or 10}")
        if every:
            env["HPAR_TRACE_EVERY"] = every
        sampler = Sampler(SKIP_STEPS)
        sampler.start()
        t1 = time.perf_counter()
        with before_detach(sampler.end):
            run_inprocess("on", args_for(steps, os.path.join(work, f"cpu-{every or 10}.json")), env)
        if sampler.start_snap is None or sampler.end_snap is None:
            raise RuntimeError("the sampler saw no steady window (too few steps?)")
        run = cpu_window(sampler.start_snap, sampler.end_snap, sampler.native_id)
        run["run_s"] = time.perf_counter() - t1
        run["trainer_steps"] = steps
        run["agent_pass_ms"] = summarize(sampler.ticks, 1e3)
        run["gc"] = sampler.gc.summary() if sampler.gc is not None else {}
        run["agent_thread_cpu_by_part_us_per_s"] = {k: v / run["window_s"] * 1e6 for k, v in
                                                    sorted(sampler.parts.items(), key=lambda kv: -kv[1])}  # fmt: skip
        result["runs"][label] = run
        steps = steps_for(run["steps_per_s"])  # the next run from this run's rate (the warm-up's includes compiles)
    return result


def print_report(r: dict[str, Any]) -> None:
    print(title(r, "agent-thread CPU"))
    print("2. agent-thread CPU (fraction of one core over the steady window):")
    for label, run in r["agent_cpu"]["runs"].items():
        pt = run["per_thread"]
        parts = ", ".join(f"{lab} {pt[lab]['cores']:.4f}" for lab in AGENT_THREADS.values() if lab in pt)
        train = pt.get("training (main)", {}).get("cores", float("nan"))
        print(f"   {label}: agent threads {run['agent_threads_cores']:.4f} cores = "
              f"{run['agent_threads_us_per_step']:.0f} us/step at {run['steps_per_s']:.1f} steps/s ({parts}); "
              f"training thread {train:.3f}, process {run['process_cores']:.3f}; window {run['window_s']:.1f} s; "
              f"gen2 GCs {run['gc'].get('gen2', {}).get('count', 0)}; agent pass "
              f"{run['agent_pass_ms'].get('median', float('nan')):.1f} ms (max {run['agent_pass_ms'].get('max', float('nan')):.1f})")  # fmt: skip
        by_part = ", ".join(f"{k} {v:.0f}" for k, v in list(run["agent_thread_cpu_by_part_us_per_s"].items())[:6])
        print(f"      agent thread by part (us CPU per s): {by_part}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--window", type=float, default=0.0, help="steady window of each run, s (default per device)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    cfg = CONFIGS[a.device]
    r = results("agent_cpu", a.device, argv, trainer_args=cfg["trainer"])
    r["agent_cpu"] = measure_agent_cpu(cfg, tempfile.mkdtemp(prefix="hpar-agent-cpu-"), a.window or cfg["window_s"])
    finish(r, a.json)
    print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
