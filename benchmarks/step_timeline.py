"""Where long steps come from: the training thread's step boundaries beside every agent-thread pass.

Runs the trainer in this process (world size 1) with the agent attached before the first step, as
users do, and records with ``perf_counter_ns``: each optimizer step's end (a global post hook
registered before the trainer starts), and the start and end of everything the agent does off the
training thread: each ``tick``, each component's ``poll``/``on_step``, span export, the span
exporter thread's batches and each ``/metrics`` collection. Then prints the steps at or above the
p99 with the agent passes that overlapped them, and how much agent time overlapped long steps
against ordinary ones. ``--arm off`` runs the same trainer without the agent (the same timeline of
steps, for the baseline p99). ``--gc-census STEP`` lists, by type, the objects that reached the
collector's oldest generation between STEP and the end (what brings on the next full collection).

    python -m benchmarks.step_timeline --arm off --arm on --steps 300 --json timeline.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

GPU_ARGS = ["--compile", "inductor", "--dtype", "bf16", "--layers", "12", "--dim", "2048", "--heads", "16",
            "--seq-len", "1024", "--global-batch", "8", "--vocab", "8192", "--lr", "3e-4", "--device", "cuda"]
CPU_ARGS = ["--compile", "aot_eager", "--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32",
            "--global-batch", "8", "--device", "cpu"]

EVENTS: list[tuple[str, str, int, int]] = []  # (thread, what, start_ns, end_ns)
STEP_ENDS: list[int] = []


def _timed(label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((threading.current_thread().name, label, t0, time.perf_counter_ns()))
    return wrapper


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def instrument() -> None:
    """Wrap the agent's off-thread work at class level, before the trainer attaches it."""
    import hpar_agent.agent as agent_mod
    import hpar_agent.collectors.anatomy
    import hpar_agent.collectors.collectives
    import hpar_agent.collectors.compile
    import hpar_agent.collectors.gradsync
    import hpar_agent.collectors.memory
    import hpar_agent.collectors.pipeline
    import hpar_agent.collectors.steps
    import hpar_agent.detectors  # noqa: F401
    from hpar_agent.component import Component
    from hpar_agent.exporters import otel

    agent_mod.Agent.tick = _timed("tick", agent_mod.Agent.tick)  # type: ignore[method-assign]
    agent_mod.Agent._export_steps = _timed("export_steps", agent_mod.Agent._export_steps)  # type: ignore[method-assign]
    for cls in _subclasses(Component):
        for meth in ("poll", "on_step", "collect"):
            if meth in vars(cls):
                setattr(cls, meth, _timed(f"{getattr(cls, 'name', cls.__name__)}.{meth}", vars(cls)[meth]))
    otel._CountingExporter.export = _timed("span_exporter.export", otel._CountingExporter.export)  # type: ignore[method-assign]
    otel.Tracing.export_step = _timed("tracing.export_step", otel.Tracing.export_step)  # type: ignore[method-assign]
    for cls in _subclasses(Component):
        if "step_hook" in vars(cls):
            cls.step_hook = _timed(f"{getattr(cls, 'name', cls.__name__)}.step_hook", vars(cls)["step_hook"])
    gc.callbacks.append(_gc_event)


_GC_START: dict[str, int] = {}


def _gc_event(phase: str, info: dict[str, Any]) -> None:
    """Python's collector: which thread collected, which generation, for how long."""
    if phase == "start":
        _GC_START["t"] = time.perf_counter_ns()
    elif "t" in _GC_START:
        EVENTS.append((threading.current_thread().name, f"gc.gen{info.get('generation')}", _GC_START.pop("t"),
                       time.perf_counter_ns()))


def gen2_census() -> dict[int, str]:
    """id -> type name of every object in the collector's oldest generation."""
    return {id(o): type(o).__name__ for o in gc.get_objects(generation=2)}


def census_diff(before: dict[int, str], after: dict[int, str]) -> dict[str, Any]:
    """What reached generation 2 between two censuses (objects there now that were not then)."""
    new = Counter(name for i, name in after.items() if i not in before)
    return {"before": len(before), "after": len(after), "new": sum(new.values()), "new_by_type": dict(new.most_common(12))}


def run(arm: str, args: list[str], steps: int, work: str, census_at: int = 0) -> dict[str, Any]:
    import hpar_agent
    from hpar_trainer.train import main as train_main

    EVENTS.clear()
    STEP_ENDS.clear()
    census: dict[str, dict[int, str]] = {}

    def on_step(*_: Any) -> None:
        if census_at and len(STEP_ENDS) == census_at:  # the census's time hides in this step, left out below
            census["start"] = gen2_census()
        STEP_ENDS.append(time.perf_counter_ns())

    hook = register_optimizer_step_post_hook(on_step)
    env = {"HPAR_RUN_DIR": os.path.join(work, arm), "HPAR_JOB_ID": f"timeline-{arm}", "HPAR_TRACES": "file",
           "HPAR_METRICS_PORT": "0"}
    os.environ.update(env)
    argv = [*args, "--steps", str(steps), "--log-every", "100000", "--out", os.path.join(work, f"{arm}.json")]
    if arm == "off":
        argv.append("--no-agent")
    try:
        rc = train_main(argv)
        if "start" in census:
            census["end"] = gen2_census()  # the agent still attached: what it keeps is there
    finally:
        hook.remove()
        hpar_agent.detach()
        torch._dynamo.reset()
    if rc:
        raise RuntimeError(f"trainer exited {rc}")
    out = analyse(arm, list(STEP_ENDS), list(EVENTS), skip=census_at + 1 if census_at else 10)
    if census:
        out["gen2_census"] = {"from_step": census_at, "to_step": len(STEP_ENDS),
                              **census_diff(census["start"], census.get("end", {}))}
    return out


def analyse(arm: str, ends: list[int], events: list[tuple[str, str, int, int]], skip: int = 10) -> dict[str, Any]:
    steps = [(i, ends[i - 1], ends[i]) for i in range(max(1, skip), len(ends))]
    durs = sorted(e - s for _, s, e in steps)
    p50, p99 = durs[len(durs) // 2], durs[min(len(durs) - 1, int(len(durs) * 0.99))]
    long_steps = [(i, s, e) for i, s, e in steps if e - s >= p99]

    def overlap(s: int, e: int) -> list[tuple[str, str, float, float]]:
        return [(th, what, (a - s) / 1e6, (b - a) / 1e6) for th, what, a, b in events if a < e and b > s]

    per_label: dict[str, list[float]] = {}
    for _, what, a, b in events:
        per_label.setdefault(what, []).append((b - a) / 1e6)
    out: dict[str, Any] = {
        "arm": arm, "steps": len(steps), "median_ms": p50 / 1e6, "p99_ms": p99 / 1e6, "max_ms": durs[-1] / 1e6,
        "agent_work": {k: {"n": len(v), "total_ms": sum(v), "max_ms": max(v), "median_ms": statistics.median(v)}
                       for k, v in sorted(per_label.items(), key=lambda kv: -sum(kv[1]))},
        "long_steps": [{"step": i, "ms": (e - s) / 1e6, "overlapping": overlap(s, e)} for i, s, e in long_steps],
    }
    # agent time (ticks, exporter batches) per step: long steps against the rest
    def busy(s: int, e: int) -> float:
        return sum(min(b, e) - max(a, s) for th, what, a, b in events
                   if what in ("tick", "span_exporter.export") and a < e and b > s) / 1e6

    def main_thread_ms(s: int, e: int) -> float:
        return sum(min(b, e) - max(a, s) for th, what, a, b in events
                   if th == "MainThread" and a < e and b > s) / 1e6
    normal = [busy(s, e) for i, s, e in steps if e - s < p99]
    out["agent_ms_in_long_steps"] = [busy(s, e) for _, s, e in long_steps]
    out["training_thread_agent_ms_per_step"] = statistics.fmean(main_thread_ms(s, e) for _, s, e in steps)
    out["agent_ms_in_other_steps_mean"] = statistics.fmean(normal) if normal else 0.0
    out["step_ms"] = [(e - s) / 1e6 for _, s, e in steps]
    return out


def show(r: dict[str, Any]) -> None:
    print(f"== {r['arm']}: {r['steps']} steps, median {r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
          f"max {r['max_ms']:.2f} ms")
    for k, v in list(r["agent_work"].items())[:14]:
        print(f"   {k:34} n={v['n']:5} total {v['total_ms']:8.1f} ms  median {v['median_ms']:7.3f}  max {v['max_ms']:7.2f}")
    print(f"   agent busy ms in long steps {[round(x, 1) for x in r['agent_ms_in_long_steps']]}, "
          f"other steps mean {r['agent_ms_in_other_steps_mean']:.2f}; on the training thread "
          f"{r['training_thread_agent_ms_per_step']:.3f} ms/step (hooks, gc)")
    if "gen2_census" in r:
        g = r["gen2_census"]
        print(f"   generation 2 from step {g['from_step']} to {g['to_step']}: {g['before']} -> {g['after']} objects, "
              f"{g['new']} new: {g['new_by_type']}")
    for ls in r["long_steps"][:8]:
        ov = sorted(ls["overlapping"], key=lambda o: -o[3])[:6]
        print(f"   step {ls['step']:4} {ls['ms']:7.2f} ms: "
              + "; ".join(f"{w}[{th[:6]}] {d:.1f}ms@{t:+.0f}" for th, w, t, d in ov))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", choices=("off", "on"), help="repeatable; default: off on")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cpu", action="store_true", help="tiny CPU model (to test the script)")
    ap.add_argument("--extra", default="", help="more trainer arguments")
    ap.add_argument("--gc-census", type=int, default=0, metavar="STEP",
                    help="list what reaches generation 2 from STEP to the end (steps before STEP+1 left out)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    instrument()
    args = (CPU_ARGS if a.cpu else GPU_ARGS) + a.extra.split()
    work = tempfile.mkdtemp(prefix="hpar-timeline-")
    results = []
    for arm in a.arm or ["off", "on"]:
        r = run(arm, args, a.steps, work, a.gc_census)
        show(r)
        results.append(r)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
