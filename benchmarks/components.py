"""Component costs of the agent in one report: hooks, agent threads, /metrics, memory, span export.

Each figure isolates one component, so a cost shows up where it is paid instead of inside a noisy
end-to-end step-time ratio (``overhead.py``). Garbage-collector pauses are recorded alongside (gc
callbacks): a collection holds the GIL, so allocation by any agent thread can stall the training thread.

1. **hook cost** (training thread, µs per optimizer step): ``hook_cost.py`` run as a subprocess
   (interleaved attached/detached blocks of ``optimizer.step()`` on a tiny model).
2. **agent-thread CPU** (fraction of one core, and µs per step): the reference trainer in-process (world
   size 1, ``overhead.run_inprocess``, its "on" arm: defaults, ``HPAR_TRACES=file``), once at the default
   sampling and once with every step traced. utime+stime and the ns ``schedstat`` of every task in
   ``/proc/self/task`` are read after warm-up and when training ends; the agent's threads are matched by
   name through ``threading.enumerate()`` native ids: ``hpar-agent`` (polls, builds spans),
   ``OtelBatchSpanRecordProcessor`` (encodes and writes spans), prometheus_client's ``serve_forever``.
   The agent thread's CPU is also split by component (``poll``/``on_step``/``export_step`` wrapped on
   the instances, ``time.thread_time``).
3. **/metrics render**: (a) the one-rank run's real registry: ``generate_latest`` (text and
   OpenMetrics) in-process and GET over HTTP as Prometheus asks (OpenMetrics, gzip); (b) rank 0 of a
   torchrun gloo run at the multi-rank series count (8 ranks dp2 x tp2 x pp2, BENCHMARKS.md's 265-series
   configuration, with >= 8 cores; else 2 ranks pp2), rendered in the rank after its last step and
   scraped from this process; (c) the one-rank registry scaled k-fold (the agent's collectors run k
   times, copies relabelled) up to the every-cap worst case of ``series_count.worst_case``: the slope
   is the cost per series, the last point the worst case measured rather than extrapolated.
4. **resident memory the agent adds**: the trainer (one rank) as subprocesses with and without the
   agent, same arguments, each pair side by side, a few pairs; VmRSS / VmHWM from ``/proc/self/status``
   after the last step (before detach), and on a GPU the caching allocator's bytes (expect 0).
5. **span export** to ``testkit/otlp_receiver.py``'s OTLP/HTTP receiver in a subprocess (counting, not
   keeping, spans), answering at once ("fast") or after ``--slow-delay`` s per request ("slow"):
   a. throughput (fast receiver): a thread drives the agent's ``Tracing.export_step`` flat out with 17-span steps (the
      8-rank shape: 4 pp.forward, 4 pp.backward, 4 send, 4 recv, train.step), so the bounded queue
      overflows: spans/s accepted, spans the agent counted as dropped, CPU per span to build (agent
      side) and to encode and post (exporter thread);
   b. the training thread while the exporter is saturated: a one-stage ``torch.distributed.pipelining``
      schedule (8 microbatches: 17 spans a step through the real pipeline hooks) on a small MLP, every
      step traced, arms interleaved: no agent, tracing off, fast receiver, slow receiver (warmed up
      until its span queue is full). Step time and ``optimizer.step()`` time (the step hook) per arm: a
      training thread that waited on the exporter would show steps as long as the receiver's delay.
      Which threads build and export spans is recorded by wrapping ``export_step`` and the exporter.

    python -m benchmarks.components --json components-cpu.json
    python -m benchmarks.components --device cuda --json components-gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# Trainer arguments per device (measurements 2 and 4), span-test stage per device (5b), render layouts (3).
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
RENDER_LAYOUTS = {
    8: ["--dp", "2", "--tp", "2", "--pp", "2"],  # BENCHMARKS.md "Series per rank": 265 per rank
    2: ["--dp", "1", "--tp", "1", "--pp", "2"],
}
RENDER_TRAINER = ["--schedule", "1f1b", "--compile", "aot_eager", "--layers", "4", "--dim", "64", "--heads", "4",
                  "--seq-len", "32", "--global-batch", "16", "--steps", "10", "--log-every", "1000",
                  "--device", "cpu"]  # fmt: skip
PROM_HEADERS = {  # what Prometheus 2.x sends
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}
AGENT_THREADS = {"hpar-agent": "agent", "OtelBatchSpanRecordProcessor": "span exporter", "serve_forever": "metrics server"}
SKIP_STEPS = 5
SPANS_PER_STEP = 17  # 8-rank steady step: 4 pp.forward, 4 pp.backward, 4 send, 4 recv, 1 train.step
MICROBATCHES = 8  # one-stage pipeline: 8 forward + 8 backward + 1 step = 17 spans
LONG_STEP_TEXT = "max(50 ms, 10x median)"


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


def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / VmSize of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSize"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def thread_label(name: str) -> str:
    for key, label in AGENT_THREADS.items():
        if key in name:
            return label
    return "training (main)" if name == "MainThread" else "other python"


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


# ------------------------------------------------------------------------------------------ 1. hook cost
def measure_hook_cost(steps: int, blocks: int) -> dict[str, Any]:
    """``hook_cost.py`` as a subprocess (a fresh process: no agent state left from the other parts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "hook.json")
        cmd = [sys.executable, str(ROOT / "benchmarks" / "hook_cost.py"), "--steps", str(steps),
               "--blocks", str(blocks), "--json", out_json]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if res.returncode:
            raise RuntimeError(f"hook_cost.py failed: {res.stderr[-2000:]}")
        out: dict[str, Any] = json.loads(Path(out_json).read_text())
    out.update(command=" ".join(cmd[1:-2]), output=res.stdout.strip().splitlines())
    return out


# ------------------------------------------------------------------------------------------ 2. agent-thread CPU
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


def measure_agent_cpu(cfg: dict[str, Any], work: str, window_s: float, render_n: int) -> dict[str, Any]:
    """Warm-up run (compile caches, step time), then one run per sampling with a sampled steady window.
    The every-step run also times the /metrics render of its registry (the one-rank point of 3)."""
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
        render: dict[str, Any] = {}

        def at_end(sampler: Sampler = sampler, render: dict[str, Any] = render, every: str | None = every) -> None:
            sampler.end()
            agent = current_agent()
            if every and agent is not None:
                from benchmarks.series_count import worst_case

                render.update(render_direct(agent.registry, render_n))
                worst = sum(worst_case(render["by_metric"]).values())
                render["scaled"] = render_scaled(agent.registry, render["series"], worst, render_n)
                if agent.metrics_url:
                    render["http"] = http_bench(agent.metrics_url, render_n)
                trace = getattr(agent, "tracing", None)
                render["tracing"] = trace.summary() if trace is not None else None

        sampler.start()
        t1 = time.perf_counter()
        with before_detach(at_end):
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
        if render:
            result["render_one_rank"] = render
        result["runs"][label] = run
        steps = steps_for(run["steps_per_s"])  # the next run from this run's rate (the warm-up's includes compiles)
    return result


# ------------------------------------------------------------------------------------------ 3. /metrics render
def count_series(text: str) -> dict[str, Any]:
    from benchmarks.series_count import count_series as count

    return count(text)


def render_direct(registry: Any, n: int) -> dict[str, Any]:
    """Series in the registry and the time of ``generate_latest`` (text 0.0.4 and OpenMetrics), in this thread."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    text = generate_latest(registry).decode()
    counted = count_series(text)
    out: dict[str, Any] = {"series": counted["total"], "by_metric": counted["by_metric"], "text_bytes": len(text)}
    for key, fn in (("text", generate_latest), ("openmetrics", generate_openmetrics)):
        fn(registry)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            body = fn(registry)
            times.append(time.perf_counter() - t0)
        out[f"direct_{key}_ms"] = summarize(times, 1e3)
        out[f"{key}_bytes"] = len(body)
    out["openmetrics_gzip_bytes"] = len(gzip.compress(generate_openmetrics(registry)))
    return out


def http_bench(url: str, n: int) -> dict[str, Any]:
    """Client-side time of GET /metrics: as Prometheus asks (OpenMetrics, gzip) and plain text."""
    out: dict[str, Any] = {}
    for key, headers in (("prometheus", PROM_HEADERS), ("plain", {})):
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read()
            times.append(time.perf_counter() - t0)
        out[f"{key}_ms"] = summarize(times, 1e3)
    return out


def settle(agent: Any) -> None:
    """Wait until the agent thread has drained every step and read the flight recorder in full once
    after the last step (full reads happen once per ``fr_interval``), so the registry is complete."""
    cfg = agent.config
    time.sleep(getattr(cfg, "fr_interval", 0.0) + 2 * cfg.interval)
    steps = agent.component("steps")
    deadline = time.time() + 10
    while steps is not None and steps.total < steps.count and time.time() < deadline:
        time.sleep(0.1)


def child_render(work: str, argv: list[str]) -> int:
    """torchrun entry of every rank: the trainer; rank 0 times its render after the last step and waits
    (bounded) while the parent scrapes it from outside."""
    from hpar_trainer.train import main as train_main

    def at_end() -> None:
        agent = current_agent()
        if agent is None or agent.topology.rank != 0:
            return
        settle(agent)
        d = render_direct(agent.registry, int(os.environ.get("COMPONENTS_RENDER_N", "200")))
        d["url"] = agent.metrics_url
        Path(work, "render-direct.json.tmp").write_text(json.dumps(d))
        os.replace(Path(work, "render-direct.json.tmp"), Path(work, "render-direct.json"))
        deadline = time.time() + 300
        while time.time() < deadline and not Path(work, "render-done").exists():
            time.sleep(0.05)

    with before_detach(at_end):
        return train_main(argv)


def measure_render(work: str, nproc: int, n: int, timeout: float) -> dict[str, Any]:
    """Rank 0 of a torchrun gloo run: direct render (in the rank) and client-side HTTP scrapes (here)."""
    from benchmarks.series_count import worst_case

    rdir = Path(work, f"render{nproc}")
    rdir.mkdir(parents=True, exist_ok=True)
    args = [*RENDER_LAYOUTS[nproc], *RENDER_TRAINER]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HPAR_RUN_DIR": str(rdir),
           "HPAR_JOB_ID": f"comp-render{nproc}", "HPAR_METRICS_PORT": "0", "HPAR_METRICS_ADDR": "127.0.0.1",
           "COMPONENTS_RENDER_N": str(n)}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "benchmarks.components", "--child", "render", str(rdir), "--", *args]  # fmt: skip
    t0 = time.perf_counter()
    with open(rdir / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            ready = rdir / "render-direct.json"
            while not ready.exists():
                if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"render run ended before rank 0 was ready:\n{(rdir / 'torchrun.log').read_text()[-3000:]}")
                time.sleep(0.2)
            direct = json.loads(ready.read_text())
            url = direct.pop("url")
            http = http_bench(url, n) if url else {}
            scrape = urllib.request.urlopen(url, timeout=10).read().decode() if url else ""
        except BaseException:
            proc.terminate()  # torchrun passes SIGTERM on to the ranks
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            Path(rdir, "render-done").write_text("")
        rc = proc.wait(timeout)
    observed = count_series(scrape)["by_metric"] if scrape else direct["by_metric"]
    worst = worst_case(observed)
    return {"nproc": nproc, "trainer_args": args, "trainer_rc": rc, "run_s": time.perf_counter() - t0,
            **direct, "http": http, "worst_case_series": sum(worst.values())}  # fmt: skip


class ScaledRegistry:
    """The agent's registry ``k`` times over: ``collect()`` runs the agent's collectors ``k`` times and
    relabels copy ``i``'s samples with ``rank="<rank>x<i>"``, so every family carries ``k`` times the
    series (the label-value growth the caps allow), built and formatted by the real code paths."""

    def __init__(self, registry: Any, k: int) -> None:
        self.registry, self.k = registry, k

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        fams: dict[str, Any] = {}
        for i in range(self.k):
            for fam in self.registry.collect():
                out = fams.get(fam.name)
                if out is None:
                    out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    out.samples.append(smp._replace(labels={**smp.labels, "rank": f"{smp.labels.get('rank', '')}x{i}"}))
        yield from fams.values()


def render_scaled(registry: Any, series: int, worst: int, n: int) -> dict[str, Any]:
    """Render time against series count, in one process: the registry scaled 1x, 8x and up to the
    every-cap worst case; the slope is the cost per series, the last point the worst case measured."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    ks = sorted({1, 8, max(1, -(-worst // max(1, series)))})
    points = []
    for k in ks:
        reg = ScaledRegistry(registry, k)
        reps = max(10, n // k)
        point: dict[str, Any] = {"k": k, "series": series * k, "reps": reps}
        for key, fn in (("text", generate_latest), ("openmetrics", generate_openmetrics)):
            fn(reg)
            times = []
            with GcWatch() as gcw:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(reg)
                    times.append(time.perf_counter() - t0)
            point[f"{key}_ms"] = summarize(times, 1e3)
            point[f"{key}_gc_ms_per_render"] = sum(e - b for b, e, _g in gcw.pauses) * 1e3 / reps
        points.append(point)
    out: dict[str, Any] = {"worst_case_series": worst, "points": points}
    lo, hi = points[0], points[-1]
    for key in ("text", "openmetrics"):
        if hi["series"] > lo["series"]:
            slope = (hi[f"{key}_ms"]["median"] - lo[f"{key}_ms"]["median"]) / (hi["series"] - lo["series"])
            out[f"{key}_us_per_series"] = slope * 1e3
        out[f"{key}_worst_ms"] = hi[f"{key}_ms"]["median"]
    return out


# ------------------------------------------------------------------------------------------ 4. resident memory
def child_rss(out: str, argv: list[str]) -> int:
    """One trainer process (world size 1); memory read after the last step, before the agent detaches."""
    from hpar_trainer.train import main as train_main

    def at_end() -> None:
        d: dict[str, Any] = {**proc_status(), "threads": threading.active_count()}  # read first: no import before
        d["agent"] = "hpar_agent" in sys.modules and current_agent() is not None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            d.update(cuda_allocated=torch.cuda.memory_allocated(), cuda_max_allocated=torch.cuda.max_memory_allocated(),
                     cuda_reserved=torch.cuda.memory_reserved(), cuda_max_reserved=torch.cuda.max_memory_reserved())  # fmt: skip
        Path(out).write_text(json.dumps(d))

    with before_detach(at_end):
        return train_main(argv)


def measure_rss(cfg: dict[str, Any], work: str, repeats: int, steps: int) -> dict[str, Any]:
    """Pairs of trainer processes (agent / --no-agent, same arguments) started together, ``repeats`` times."""
    from benchmarks.overhead import arm_env

    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        procs = []
        for arm in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            out = os.path.join(work, f"rss{rep}-{arm}.json")
            args = [*cfg["trainer"], "--steps", str(steps), "--log-every", "100000"]
            if arm == "off":
                args.append("--no-agent")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   **arm_env(arm, os.path.join(work, f"rss{rep}"), f"comp-rss{rep}")}  # fmt: skip
            cmd = [sys.executable, "-m", "benchmarks.components", "--child", "rss", out, "--", *args]
            procs.append((arm, out, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                     stdin=subprocess.DEVNULL, text=True)))  # fmt: skip
        for arm, out, p in procs:
            _o, err = p.communicate(timeout=900)
            if p.returncode or not os.path.exists(out):
                raise RuntimeError(f"rss {arm} run failed (rc {p.returncode}): {err[-2000:]}")
            runs.append({"rep": rep, "arm": arm, **json.loads(Path(out).read_text())})
    result: dict[str, Any] = {"steps": steps, "repeats": repeats, "runs": runs}
    for key in ("VmRSS", "VmHWM", "cuda_allocated", "cuda_max_allocated", "cuda_max_reserved"):
        diffs = []
        for rep in range(repeats):
            pair = {r["arm"]: r for r in runs if r["rep"] == rep}
            if key in pair.get("on", {}) and key in pair.get("off", {}):
                diffs.append(pair["on"][key] - pair["off"][key])
        if diffs:
            result[f"{key}_added_bytes"] = {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs),
                                            "pairs": diffs}  # fmt: skip
    for arm in ("on", "off"):
        vals = [r["VmRSS"] for r in runs if r["arm"] == arm]
        result[f"VmRSS_{arm}_median"] = statistics.median(vals)
    return result


# ------------------------------------------------------------------------------------------ 5. span export
def child_receiver() -> int:
    """The OTLP/HTTP receiver of testkit/otlp_receiver.py, counting spans instead of keeping them.
    stdin: ``up`` | ``slow <seconds>`` | ``stats``; stdout: the port, then one JSON line per ``stats``."""
    from testkit.otlp_receiver import HttpReceiver

    class CountingReceiver(HttpReceiver):
        count = 0

        def _accept(self, request: Any) -> None:
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with self._cond:
                self.requests += 1
                self.count += n

    rec = CountingReceiver()
    rec.__enter__()
    print(rec.port, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "slow":
            rec.delay = float(cmd[1])
            rec.set_mode("slow")
        elif cmd[0] == "up":
            rec.set_mode("up")
        elif cmd[0] == "stats":
            with rec._cond:
                print(json.dumps({"requests": rec.requests, "spans": rec.count, "t": time.time()}), flush=True)
    rec.__exit__()
    return 0


class Receiver:
    """Parent side of ``child_receiver``."""

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "benchmarks.components", "--child", "receiver"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.proc.stdout is not None
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}/v1/traces"

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        assert self.proc.stdout is not None
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def attach_traced(model: Any, optimizer: Any, work: str, tag: str, receiver: Receiver | None) -> Any:
    """The agent with its defaults, every step traced over OTLP/HTTP to ``receiver`` (None: tracing off)."""
    import hpar_agent
    from benchmarks.overhead import patched_env

    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint} if receiver else {}
    with patched_env(env):
        return hpar_agent.attach(model, optimizer=optimizer, run_dir=os.path.join(work, tag), metrics_port=0,
                                 traces="otlp" if receiver else "none", trace_every=1)  # fmt: skip


def instrument_tracing(agent: Any) -> dict[str, Any]:
    """Wrap ``export_step`` and the exporter of this agent's Tracing (instance attributes only) to see
    which threads build and export spans and for how long one call takes; and ``tick`` (each agent pass)."""
    seen: dict[str, Any] = {"build_threads": set(), "detach_build_threads": set(), "export_threads": set(),
                            "export_step_s": [], "export_s": [], "detaching": False, "ticks": []}  # fmt: skip
    time_ticks(agent, lambda t0, t1: seen["ticks"].append((t0, t1)))
    tracing = getattr(agent, "tracing", None)
    if tracing is None:
        return seen
    orig_step = tracing.export_step

    def export_step(rec: Any) -> bool:
        t0 = time.perf_counter()
        try:
            return orig_step(rec)
        finally:
            name = threading.current_thread().name
            if seen["detaching"]:  # detach's final drain runs on the caller's thread
                seen["detach_build_threads"].add(name)
            else:
                seen["export_step_s"].append(time.perf_counter() - t0)
                seen["build_threads"].add(name)

    tracing.export_step = export_step
    counting = getattr(tracing, "_exporter", None)  # _CountingExporter; its .inner is the OTLP exporter
    inner = getattr(counting, "inner", None)
    if inner is not None:
        orig_export = inner.export

        def export(spans: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_export(spans)
            finally:
                seen["export_s"].append(time.perf_counter() - t0)
                seen["export_threads"].add(threading.current_thread().name)

        inner.export = export
    return seen


def exporter_thread_gone(timeout: float) -> float | None:
    """Seconds until no span-exporter thread is left (None: still there after ``timeout``)."""
    t0 = time.perf_counter()
    while any(t.name.startswith("OtelBatch") for t in threading.enumerate()):
        if time.perf_counter() - t0 > timeout:
            return None
        time.sleep(0.02)
    return time.perf_counter() - t0


def named_threads_cpu(prefix: str) -> float:
    """CPU seconds of this process's python threads whose name starts with ``prefix`` (schedstat)."""
    tasks = task_cpu()
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id in tasks:
            _c, ticks, sched = tasks[t.native_id]
            total += sched if sched is not None else ticks
    return total


def measure_export_capacity(receiver: Receiver, work: str, seconds: float, slow_delay: float) -> dict[str, Any]:
    """A thread drives ``Tracing.export_step`` flat out with 17-span steps against the fast receiver
    (the slow receiver's case is the training-thread test, 5b)."""
    import hpar_agent
    from hpar_agent import catalogue as cat
    from hpar_agent.spans import SpanRecord, StepRecord

    out: dict[str, Any] = {}
    for mode in ("fast",):
        receiver.send("up")
        agent = attach_traced(None, None, work, f"capacity-{mode}", receiver)
        tracing = agent.tracing
        if tracing is None:
            hpar_agent.detach()
            raise RuntimeError(f"no tracing (agent errors {dict(agent.errors)})")
        res: dict[str, Any] = {}

        def produce(tracing: Any = tracing, res: dict[str, Any] = res) -> None:
            step, n_steps, end = 1_000_000, 0, time.perf_counter() + seconds
            c0 = time.thread_time()
            while time.perf_counter() < end:
                t = time.time_ns()
                rec = StepRecord(step=step, start_ns=t - 10_000_000, end_ns=t)
                for i in range(4):
                    a = t - 9_000_000 + i * 2_000_000
                    pp = {cat.ATTR_PP_STAGE: 0, cat.ATTR_MICROBATCH: i, cat.ATTR_STREAM: "cpu"}
                    rec.children.append(SpanRecord(cat.SPAN_PP_FORWARD, a, a + 500_000, step, dict(pp)))
                    rec.children.append(SpanRecord(cat.SPAN_PP_BACKWARD, a + 500_000, a + 1_500_000, step, dict(pp)))
                    for op in ("send", "recv"):
                        coll = {cat.ATTR_PG: "pp", cat.ATTR_OP: op, cat.ATTR_SEQ: step * 8 + i, cat.ATTR_BYTES: 65536,
                                cat.ATTR_STREAM: "cpu", cat.ATTR_PEER: 1, cat.ATTR_BUSBW: 1.0e9}  # fmt: skip
                        rec.children.append(SpanRecord(cat.SPAN_COLLECTIVE_PREFIX + op, a, a + 200_000, step, coll))
                tracing.export_step(rec)
                step += 1
                n_steps += 1
            res["producer_cpu_s"] = time.thread_time() - c0
            res["steps"] = n_steps

        s0, d0, c0 = receiver.stats(), tracing.dropped, tracing.spans_created
        x0 = named_threads_cpu("OtelBatch")
        t0 = time.perf_counter()
        th = threading.Thread(target=produce, name="capacity-producer")
        th.start()
        th.join()
        wall = time.perf_counter() - t0
        s1, d1, c1 = receiver.stats(), tracing.dropped, tracing.spans_created
        x1 = named_threads_cpu("OtelBatch")
        t1 = time.perf_counter()
        hpar_agent.detach()
        res["exporter_thread_after_detach_s"] = exporter_thread_gone(slow_delay + 10)
        created = c1 - c0
        accepted = s1["spans"] - s0["spans"]
        res.update(window_s=wall, spans_offered=created, offered_per_s=created / wall, spans_accepted=accepted,
                   accepted_per_s=accepted / wall, requests=s1["requests"] - s0["requests"], spans_dropped=d1 - d0,
                   dropped_total_after_detach=tracing.dropped, detach_s=time.perf_counter() - t1,
                   build_us_per_span=res["producer_cpu_s"] / created * 1e6 if created else None,
                   exporter_cores=(x1 - x0) / wall,
                   exporter_us_per_accepted_span=(x1 - x0) / accepted * 1e6 if accepted else None)  # fmt: skip
        out[mode] = res
    out["slow_delay_s"] = slow_delay
    return out


def span_stage(device: torch.device, spec: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any]:
    """A one-stage pipelining schedule (GPipe, 8 microbatches) on a small MLP, world size 1."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    dim, hidden, batch, dtype = spec["dim"], spec["hidden"], spec["batch"], spec["dtype"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
    model = model.to(device, dtype)
    stage = PipelineStage(model, 0, 1, device)
    sched = ScheduleGPipe(stage, n_microbatches=MICROBATCHES,
                          loss_fn=lambda o, t: torch.nn.functional.mse_loss(o.float(), t.float()))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    y = torch.randn(batch, dim, device=device, dtype=dtype)
    return model, sched, opt, x, y


def training_arm(arm: str, rep: int, receiver: Receiver, model: Any, sched: Any, opt: Any, one_step: Callable[[], float],
                 work: str, arm_s: float, slow_delay: float) -> dict[str, Any]:  # fmt: skip
    """One arm: attach (unless noagent), warm up (the slow arm until its span queue is full), time
    ``arm_s`` seconds of steps with the garbage collector watched, detach."""
    import hpar_agent

    rx = receiver if arm in ("fast", "slow") else None
    receiver.send(f"slow {slow_delay}" if arm == "slow" else "up")
    agent = attach_traced(model, opt, work, f"train-{arm}{rep}", rx) if arm != "noagent" else None
    seen: dict[str, Any] = {}
    if agent is not None:
        agent.watch_pipeline(schedule=sched)
        seen = instrument_tracing(agent)
    tracing = getattr(agent, "tracing", None)
    t_warm = time.perf_counter()
    n = 0
    while n < 10 or (arm == "slow" and tracing is not None and time.perf_counter() - t_warm < 30
                     and tracing.in_flight < 0.75 * tracing.max_queue_size and tracing.dropped == 0):  # fmt: skip
        one_step()
        n += 1
    run: dict[str, Any] = {"rep": rep, "arm": arm, "warmup_s": time.perf_counter() - t_warm}
    s0 = receiver.stats()
    d0, c0 = (tracing.dropped, tracing.spans_created) if tracing is not None else (0, 0)
    step_s: list[float] = []
    opt_s: list[float] = []
    spans_at: list[tuple[float, float]] = []
    inflight: list[int] = []
    with GcWatch() as gcw:
        t_start = time.perf_counter()
        while time.perf_counter() - t_start < arm_s:
            t0 = time.perf_counter()
            opt_s.append(one_step())
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            spans_at.append((t0, t1))
            if tracing is not None and len(step_s) % 16 == 0:
                inflight.append(tracing.in_flight)
        wall = time.perf_counter() - t_start
    s1 = receiver.stats()
    med = statistics.median(step_s)
    long_thr = max(0.05, 10 * med)  # a step this long is a stall, not noise around the median
    long = [(a, b) for a, b in spans_at if b - a > long_thr]
    gcs = gcw.summary()
    run.update(steps=len(step_s), window_s=wall, step_ms=summarize(step_s, 1e3), opt_step_us=summarize(opt_s, 1e6),
               long_step_threshold_ms=long_thr * 1e3, long_steps=len(long),
               long_steps_with_gc=sum(gcw.overlapping(a, b) > 0.5 * (b - a - med) for a, b in long),
               long_steps_with_tick=sum(any(tb < b and te > a for tb, te in seen.get("ticks", ())) for a, b in long),
               tick_ms=summarize([e - b for b, e in seen.get("ticks", ()) if b >= t_start and e <= t_start + wall], 1e3),
               gc=gcs, gen2_collections=gcs.get("gen2", {}).get("count", 0),
               gc_max_ms=max((g["max_ms"] for g in gcs.values()), default=0.0))  # fmt: skip
    if tracing is not None:
        created = tracing.spans_created - c0
        full = tracing.max_queue_size - 16
        run.update(spans_offered_per_s=created / wall, spans_accepted_per_s=(s1["spans"] - s0["spans"]) / wall,
                   spans_dropped=tracing.dropped - d0, queue_max=tracing.max_queue_size,
                   in_flight_max=max(inflight, default=0),
                   queue_full_fraction=sum(i >= full for i in inflight) / max(1, len(inflight)))  # fmt: skip
    if agent is not None:
        run["buffer_drops"] = sum(b.dropped for c in agent.components for b in getattr(c, "buffers", ()))
        seen["detaching"] = True
        t1 = time.perf_counter()
        hpar_agent.detach()
        run["detach_s"] = time.perf_counter() - t1
        if tracing is not None:
            run["exporter_thread_after_detach_s"] = exporter_thread_gone(slow_delay + 10)
        if seen.get("export_step_s"):
            run["build_threads"] = sorted(seen["build_threads"])
            run["detach_build_threads"] = sorted(seen["detach_build_threads"])
            run["export_threads"] = sorted(seen["export_threads"])
            run["export_step_ms"] = summarize(seen["export_step_s"], 1e3)
            run["export_call_ms"] = summarize(seen["export_s"], 1e3)
    return run


def measure_training_under_export(receiver: Receiver, device: torch.device, spec: dict[str, Any], work: str,
                                  reps: int, arm_s: float, slow_delay: float) -> dict[str, Any]:  # fmt: skip
    """Interleaved arms (no agent, tracing off, fast receiver, slow receiver), every step traced."""
    import torch.distributed as dist

    import hpar_agent

    own_pg = not dist.is_initialized()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if own_pg:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)  # fmt: skip
    model, sched, opt, x, y = span_stage(device, spec)

    def one_step() -> float:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(x, target=y, losses=losses)
        t1 = time.perf_counter()
        opt.step()
        opt_s = time.perf_counter() - t1
        float(torch.stack([v.detach() for v in losses]).mean())  # host sync, as the trainer's loss logging does
        return opt_s

    for _ in range(20):  # warm-up without the agent
        one_step()
    full_gc = [full_gc_ms() for _ in range(3)]
    arms = ("noagent", "off", "fast", "slow")
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(reps):
            for arm in arms:
                runs.append(training_arm(arm, rep, receiver, model, sched, opt, one_step, work, arm_s, slow_delay))
    finally:
        hpar_agent.detach()
        if own_pg:
            dist.destroy_process_group()
    by_arm: dict[str, dict[str, Any]] = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        agg: dict[str, Any] = {
            "step_ms_median": statistics.median(r["step_ms"]["median"] for r in rs),
            "step_ms_p99": max(r["step_ms"]["p99"] for r in rs),
            "step_ms_max": max(r["step_ms"]["max"] for r in rs),
            "opt_step_us_median": statistics.median(r["opt_step_us"]["median"] for r in rs),
            "opt_step_us_max": max(r["opt_step_us"]["max"] for r in rs),
        }
        for key in ("spans_offered_per_s", "spans_accepted_per_s", "queue_full_fraction", "detach_s"):
            if key in rs[0]:
                agg[key] = statistics.median(r[key] for r in rs)
        lingered = [r.get("exporter_thread_after_detach_s") for r in rs if "exporter_thread_after_detach_s" in r]
        if lingered:
            gone = [x for x in lingered if x is not None]
            agg["exporter_thread_after_detach_s_max"] = max(gone) if len(gone) == len(lingered) else None
        for key in ("spans_dropped", "buffer_drops", "long_steps", "long_steps_with_gc", "long_steps_with_tick",
                    "gen2_collections"):
            if key in rs[0]:
                agg[key] = sum(r[key] for r in rs)
        agg["gc_max_ms"] = max(r["gc_max_ms"] for r in rs)
        ticks = [r["tick_ms"] for r in rs if r.get("tick_ms")]
        if ticks:
            agg["tick_ms_median"] = statistics.median(t["median"] for t in ticks)
            agg["tick_ms_max"] = max(t["max"] for t in ticks)
        for key in ("build_threads", "detach_build_threads", "export_threads"):
            if key in rs[0]:
                agg[key] = sorted({t for r in rs for t in r.get(key, ())})
        if "export_step_ms" in rs[0]:
            agg["export_step_ms_max"] = max(r["export_step_ms"]["max"] for r in rs)
            agg["export_call_ms_max"] = max(r["export_call_ms"].get("max", 0.0) for r in rs)
        by_arm[arm] = agg
    base = by_arm["noagent"]["step_ms_median"]
    for agg in by_arm.values():
        agg["step_ratio_vs_noagent"] = agg["step_ms_median"] / base
    stage = {k: (str(v) if k == "dtype" else v) for k, v in spec.items()}
    return {"stage": {**stage, "microbatches": MICROBATCHES, "device": str(device)}, "reps": reps, "arm_s": arm_s,
            "slow_delay_s": slow_delay, "full_gc_ms": full_gc, "arms": by_arm, "runs": runs}  # fmt: skip


# ------------------------------------------------------------------------------------------ report
def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:+.1f} MiB"


def print_report(r: dict[str, Any]) -> None:
    print(f"\n=== components ({r['device']}, torch {r['torch']}, {r['cpu_count']} cores, {r['wall_s']:.0f} s) ===")
    if "hook_cost" in r:
        h = r["hook_cost"]
        hooks = ", ".join(f"{k} {v:.2f}" for k, v in h["step_hooks_us"].items())
        print(f"1. hook cost per optimizer step: {h['hook_cost_us']:.2f} us (bare step {h['detached_us']:.2f} us, "
              f"attached {h['attached_us']:.2f} us); StepCollector.mark() {h['mark_us']:.2f} us ({hooks})")  # fmt: skip
    if "agent_cpu" in r:
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
    if "render" in r:
        print("3. /metrics render (median / p99 ms):")
        for key in ("one_rank", "multi_rank"):
            p = r["render"].get(key)
            if not p:
                continue
            where = "1-rank in-process run" if key == "one_rank" else f"rank 0 of {p['nproc']}-rank gloo run"
            http = p.get("http", {})
            hp = http.get("prometheus_ms", {})
            hpl = http.get("plain_ms", {})
            print(f"   {where}: {p['series']} series, {p['text_bytes']} B text; direct text "
                  f"{p['direct_text_ms']['median']:.2f}/{p['direct_text_ms']['p99']:.2f}, OpenMetrics "
                  f"{p['direct_openmetrics_ms']['median']:.2f}/{p['direct_openmetrics_ms']['p99']:.2f}; HTTP GET "
                  f"(OpenMetrics+gzip) {hp.get('median', float('nan')):.2f}/{hp.get('p99', float('nan')):.2f}, "
                  f"plain {hpl.get('median', float('nan')):.2f}/{hpl.get('p99', float('nan')):.2f}")  # fmt: skip
        sc = (r["render"].get("one_rank") or {}).get("scaled")
        if sc:
            pts = "; ".join(f"{p['series']} series {p['text_ms']['median']:.1f} / {p['openmetrics_ms']['median']:.1f} ms "
                            f"(GC {p['text_gc_ms_per_render']:.1f} / {p['openmetrics_gc_ms_per_render']:.1f})"
                            for p in sc["points"])  # fmt: skip
            print(f"   registry scaled k-fold (text / OpenMetrics, median): {pts}")
            print(f"   -> {sc.get('text_us_per_series', float('nan')):.2f} / {sc.get('openmetrics_us_per_series', float('nan')):.2f} "
                  f"us per series; at the every-cap worst case ({sc['worst_case_series']} series): "
                  f"{sc['text_worst_ms']:.1f} / {sc['openmetrics_worst_ms']:.1f} ms")  # fmt: skip
    if "rss" in r:
        m = r["rss"]
        line = (f"4. memory the agent adds (median of {m['repeats']} pairs): VmRSS {fmt_bytes(m['VmRSS_added_bytes']['median'])} "
                f"(pairs {', '.join(fmt_bytes(d) for d in m['VmRSS_added_bytes']['pairs'])}; off {m['VmRSS_off_median'] / 2**20:.0f} MiB), "
                f"VmHWM {fmt_bytes(m['VmHWM_added_bytes']['median'])}")  # fmt: skip
        if "cuda_max_reserved_added_bytes" in m:
            line += (f"; CUDA allocated {m['cuda_allocated_added_bytes']['median']:+.0f} B, "
                     f"max reserved {m['cuda_max_reserved_added_bytes']['median']:+.0f} B")  # fmt: skip
        print(line)
    if "spans" in r:
        s = r["spans"]
        cap = s.get("capacity")
        if cap:
            print(f"5a. span export, producer flat out ({SPANS_PER_STEP}-span steps through Tracing.export_step):")
            for mode in ("fast",):
                c = cap[mode]
                extra = ""
                per = c["exporter_us_per_accepted_span"]
                print(f"   {mode}{extra}: offered {c['offered_per_s']:.0f} spans/s, accepted {c['accepted_per_s']:.0f} "
                      f"spans/s ({c['requests']} requests), dropped {c['spans_dropped']}; build "
                      f"{c['build_us_per_span']:.1f} us CPU/span (agent side), exporter thread {c['exporter_cores']:.2f} cores"
                      + (f" = {per:.1f} us CPU/exported span" if per else "") + f"; detach {c['detach_s']:.2f} s")  # fmt: skip
        tr = s.get("training")
        if tr:
            st = tr["stage"]
            print(f"5b. training thread while exporting (one-stage pipeline, {st['microbatches']} microbatches, "
                  f"MLP {st['dim']}x{st['hidden']} {st['dtype']}, every step traced; slow = {tr['slow_delay_s']} s per request):")  # fmt: skip
            for arm, a in tr["arms"].items():
                line = (f"   {arm:8}: step {a['step_ms_median']:.3f} ms (x{a['step_ratio_vs_noagent']:.3f}), "
                        f"p99 {a['step_ms_p99']:.3f}, max {a['step_ms_max']:.2f} ms; optimizer.step "
                        f"{a['opt_step_us_median']:.0f} us (max {a['opt_step_us_max'] / 1e3:.2f} ms)")  # fmt: skip
                if "spans_offered_per_s" in a:
                    line += (f"; spans offered {a['spans_offered_per_s']:.0f}/s, accepted {a['spans_accepted_per_s']:.0f}/s, "
                             f"dropped {a['spans_dropped']}, queue full {a['queue_full_fraction']:.0%} of samples")  # fmt: skip
                if "detach_s" in a:
                    line += f"; detach {a['detach_s']:.2f} s"
                if "exporter_thread_after_detach_s_max" in a:
                    lg = a["exporter_thread_after_detach_s_max"]
                    line += " (exporter thread gone " + (f"{lg:.2f} s later)" if lg is not None else "NOT gone)")
                line += (f"; steps > {LONG_STEP_TEXT}: {a['long_steps']} ({a['long_steps_with_gc']} inside a GC pause, "
                         f"{a['long_steps_with_tick']} overlapping an agent pass), gen2 GCs {a['gen2_collections']}, "
                         f"longest GC {a['gc_max_ms']:.0f} ms")  # fmt: skip
                if "tick_ms_max" in a:
                    line += f"; agent pass {a['tick_ms_median']:.1f} ms (max {a['tick_ms_max']:.0f})"
                print(line)
            fast = tr["arms"].get("fast", {})
            print(f"   spans built on: {fast.get('build_threads')} (detach's final drain: "
                  f"{fast.get('detach_build_threads')}); exported on: {fast.get('export_threads')}; longest export_step "
                  f"{max(tr['arms'][a].get('export_step_ms_max', 0) for a in ('fast', 'slow')):.1f} ms, longest export "
                  f"call {tr['arms'].get('slow', {}).get('export_call_ms_max', 0):.0f} ms; a forced full GC of this "
                  f"process takes {statistics.median(tr['full_gc_ms']):.0f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--parts", default="hook,cpu,render,rss,spans", help="comma-separated subset to run")
    ap.add_argument("--hook-steps", type=int, default=10_000, help="hook_cost.py --steps")
    ap.add_argument("--hook-blocks", type=int, default=20, help="hook_cost.py --blocks")
    ap.add_argument("--window", type=float, default=0.0, help="steady window of each agent-CPU run, s (default per device)")
    ap.add_argument("--render-n", type=int, default=200, help="renders / scrapes timed per format")
    ap.add_argument("--render-nproc", type=int, choices=(2, 8), default=0,
                    help="ranks of the render run (default 8 with >= 8 cores, else 2)")
    ap.add_argument("--rss-repeats", type=int, default=2)
    ap.add_argument("--span-seconds", type=float, default=4.0, help="seconds per export-capacity test")
    ap.add_argument("--span-reps", type=int, default=2, help="interleaved rounds of the training-thread arms")
    ap.add_argument("--arm-seconds", type=float, default=4.0, help="measured seconds per training-thread arm")
    ap.add_argument("--slow-delay", type=float, default=2.0, help="slow receiver: seconds before each answer")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the render run")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a GPU")
    cfg = CONFIGS[a.device]
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    render_nproc = a.render_nproc or (8 if (os.cpu_count() or 1) >= 8 else 2)
    work = tempfile.mkdtemp(prefix="hpar-components-")
    t_start = time.time()
    r: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime(t_start)),
        "command": "python -m benchmarks.components " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trainer_args": cfg["trainer"], "load_avg_start": os.getloadavg(),
    }  # fmt: skip

    def save(part: str) -> None:
        r["wall_s"] = time.time() - t_start
        r.setdefault("part_s", {})[part] = round(time.time() - t_part, 1)
        print(f"[{r['wall_s']:6.1f} s] {part} done ({r['part_s'][part]} s)", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(r, indent=1, default=str))

    if "hook" in parts:
        t_part = time.time()
        r["hook_cost"] = measure_hook_cost(a.hook_steps, a.hook_blocks)
        save("hook")
    if "cpu" in parts:
        t_part = time.time()
        res = measure_agent_cpu(cfg, work, a.window or cfg["window_s"], a.render_n)
        r.setdefault("render", {})["one_rank"] = res.pop("render_one_rank", None)
        r["agent_cpu"] = res
        save("cpu")
    if "render" in parts:
        t_part = time.time()
        r.setdefault("render", {})["multi_rank"] = measure_render(work, render_nproc, a.render_n, a.timeout)
        save("render")
    if "rss" in parts:
        t_part = time.time()
        r["rss"] = measure_rss(cfg, work, a.rss_repeats, cfg["rss_steps"])
        save("rss")
    if "spans" in parts:
        t_part = time.time()
        receiver = Receiver()
        try:
            r["spans"] = {"capacity": measure_export_capacity(receiver, work, a.span_seconds, a.slow_delay)}
            device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
            if a.device == "cpu":
                torch.set_num_threads(1)
            r["spans"]["training"] = measure_training_under_export(
                receiver, device, cfg["span_stage"], work, a.span_reps, a.arm_seconds, a.slow_delay)
        finally:
            receiver.close()
        save("spans")
    r["load_avg_end"] = os.getloadavg()
    r["wall_s"] = time.time() - t_start
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1, default=str))
    print_report(r)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "receiver":
            sys.exit(child_receiver())
        target, trainer_argv = rest[0], rest[2:] if len(rest) > 1 and rest[1] == "--" else rest[1:]
        sys.exit(child_render(target, trainer_argv) if kind == "render" else child_rss(target, trainer_argv))
    sys.exit(main())
