"""What each part of the agent costs, measured where it is paid (``--only`` picks the parts):

cpu     the agent's threads' CPU on the reference trainer in-process (world size 1), at the default
        trace sampling and with every step traced: each thread's CPU per second and per step (its own
        CPU clock), the agent thread's by part (each component's ``poll``/``on_step``/``end_pass``,
        span building), the passes' wall time and the garbage collector's pauses;
render  ``/metrics``: the one-rank registry rendered in-process (text and OpenMetrics), scaled k-fold
        up to the every-cap worst case of ``scale.worst_case`` (the slope is the cost per series), and
        scraped over HTTP as Prometheus asks (OpenMetrics, gzip), one scrape at a time;
rss     the resident memory the agent adds: pairs of trainer processes with and without it, VmRSS and
        VmHWM after the last step, and on a GPU the caching allocator's bytes (expect +0);
spans   span export into an OTLP/HTTP receiver in a subprocess: (a) ``Tracing.export_step`` flat out
        with 17-span steps (the bounded queue overflows): spans/s accepted, dropped, CPU a span built
        and exported; (b) a one-stage pipeline's training thread, every step traced: no agent, a
        receiver answering at once, one answering after ``--slow-delay`` s (a training thread that
        waited on the exporter would show it).

  python -m benchmarks.components --json components-cpu.json
  python -m benchmarks.components --device cuda --only cpu,render,rss --json components-gpu.json
"""

from __future__ import annotations

import argparse
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

from benchmarks.common import (
    GcWatch,
    ThreadClocks,
    describe,
    finish,
    need_device,
    patched_env,
    proc_status,
    results,
    started_since,
    thread_group,
    time_parts,
    title,
)

TRAINER = {  # the reference trainer per device (world size 1)
    "cpu": "--compile aot_eager --layers 2 --dim 64 --heads 4 --seq-len 32 --global-batch 8 --device cpu".split(),
    "cuda": (
        "--compile inductor --dtype bf16 --layers 4 --dim 1024 --heads 8 "
        "--seq-len 512 --global-batch 8 --lr 3e-4 --device cuda"
    ).split(),
}
AGENT_ENV = {"HPAR_TRACES": "file", "HPAR_METRICS_PORT": "0"}
SKIP = 5  # steps before a steady window (compile, first passes)
PROM_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}


def current_agent() -> Any:
    from hpar_agent.agent import current

    return current()


def train_inprocess(args: list[str], env: dict[str, str], at_end: Callable[[], None] | None = None) -> None:
    """The reference trainer in this process (world size 1) with the agent; ``at_end`` runs after its
    last step, before the agent detaches. Dynamo is reset after it (the FX-graph cache stays warm)."""
    import hpar_trainer.train as train

    orig = train.detach_observability

    def detach(timeout: float = 15.0) -> None:
        try:
            if at_end is not None:
                at_end()
        finally:
            orig(timeout)

    train.detach_observability = detach
    try:
        with patched_env(env):
            rc = train.main(args)
    finally:
        train.detach_observability = orig
    torch._dynamo.reset()
    if rc:
        raise RuntimeError(f"trainer exited {rc}")


# ------------------------------------------------------------------------------------ cpu
class Window(threading.Thread):
    """Starts the steady window once the agent has seen ``SKIP`` steps: its threads' CPU clocks, the
    agent thread's parts (``time_parts``) and the passes' wall time; ``end()`` closes it."""

    def __init__(self, before: list[threading.Thread]) -> None:
        super().__init__(name="components-window", daemon=True)
        self.before, self.parts, self.passes = before, {}, []  # type: ignore[var-annotated]
        self.start_snap: dict[str, Any] = {}
        self.result: dict[str, Any] = {}
        self.clocks: ThreadClocks | None = None
        self.gc = GcWatch()
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(0.05):
            agent = current_agent()
            steps = agent.component("steps") if agent is not None else None
            if steps is not None and steps.count >= SKIP:
                time_parts(agent, self.parts)
                self.time_passes(agent)
                self.clocks = ThreadClocks(t for t in started_since(self.before) if t is not self)
                self.start_snap = {"t": time.perf_counter(), "steps": steps.count, "cpu": self.clocks.read()}
                self.gc.__enter__()
                return

    def time_passes(self, agent: Any) -> None:
        """Each agent pass's wall time: the agent thread's ``tick`` wrapped on the instance (the thread
        calls ``self.tick``)."""
        loop = agent.loop
        tick = loop.tick

        def timed_tick(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return tick(*a, **k)
            finally:
                self.passes.append(time.perf_counter() - t0)

        loop.tick = timed_tick

    def end(self) -> None:
        self._stop_evt.set()
        agent = current_agent()
        if self.clocks is None or agent is None:
            raise RuntimeError("no steady window (too few steps?)")
        self.gc.__exit__()
        wall = time.perf_counter() - self.start_snap["t"]
        steps = agent.component("steps").count - self.start_snap["steps"]
        threads: dict[str, float] = {}
        for name, c in self.clocks.read().items():
            group = thread_group(name)
            threads[group] = threads.get(group, 0.0) + c - self.start_snap["cpu"].get(name, c)
        self.result = {
            "window_s": wall,
            "steps": steps,
            "steps_per_s": steps / wall,
            "thread_cpu_ms_per_s": {
                k: v / wall * 1e3 for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
            },
            "thread_cpu_us_per_step": {k: v / steps * 1e6 for k, v in threads.items()},
            "agent_parts_ms_per_s": {
                k: v / wall * 1e3 for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1])
            },
            "pass_ms": describe(self.passes, 1e3),
            "gc": self.gc.summary(),
        }


def measure_cpu(device: str, work: str, window_s: float) -> dict[str, Any]:
    """A warm-up run (compile caches, the step rate), then a run per trace sampling with a window."""

    def args_for(steps: int, out: str) -> list[str]:
        return [*TRAINER[device], "--steps", str(steps), "--log-every", "100000", "--out", out]

    warm = os.path.join(work, "warm.json")
    train_inprocess(args_for(SKIP + 20, warm), {**AGENT_ENV, "HPAR_RUN_DIR": os.path.join(work, "warm")})
    rate = 1.0 / statistics.median(json.loads(Path(warm).read_text())["step_times"][SKIP:])
    out: dict[str, Any] = {"warmup_steps_per_s": rate, "runs": {}}
    for label, every in (("default sampling", None), ("every step traced", "1")):
        env = {**AGENT_ENV, "HPAR_RUN_DIR": os.path.join(work, f"cpu-{every or 'default'}")}
        if every:
            env["HPAR_TRACE_EVERY"] = every
        win = Window(threading.enumerate())
        win.start()
        steps = SKIP + max(20, int(window_s * rate))
        train_inprocess(args_for(steps, os.path.join(work, "cpu.json")), env, win.end)
        out["runs"][label] = win.result
        rate = win.result["steps_per_s"] or rate
    return out


def print_cpu(c: dict[str, Any]) -> None:
    print("cpu: the agent's threads on the reference trainer (steady window)")
    for label, run in c["runs"].items():
        threads = ", ".join(
            f"{k} {v:.2f} ms/s = {run['thread_cpu_us_per_step'][k]:.0f} us/step"
            for k, v in run["thread_cpu_ms_per_s"].items()
        )
        parts = ", ".join(f"{k} {v:.2f}" for k, v in list(run["agent_parts_ms_per_s"].items())[:6])
        print(f"  {label}: {run['steps_per_s']:.1f} steps/s over {run['window_s']:.1f} s; {threads}")
        print(
            f"    agent thread by part (ms CPU per s): {parts}; passes {run['pass_ms'].get('median', 0):.1f} ms "
            f"(max {run['pass_ms'].get('max', 0):.1f}); gen-2 GCs {run['gc'].get('gen2', {}).get('count', 0)}"
        )


# ------------------------------------------------------------------------------------ render
class Scaled:
    """A registry ``k`` times over: ``collect()`` runs its collectors ``k`` times, copy ``i``'s samples
    relabelled ``rank="<rank>x<i>"``, so every family carries ``k`` times the series, built and formatted
    by the real code paths."""

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
                for s in fam.samples:
                    out.samples.append(
                        s._replace(labels={**s.labels, "rank": f"{s.labels.get('rank', '')}x{i}"})
                    )
        yield from fams.values()


def time_render(registry: Any, reps: int) -> dict[str, Any]:
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    out: dict[str, Any] = {}
    for key, fn in (("text", generate_latest), ("openmetrics", generate_openmetrics)):
        body = fn(registry)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(registry)
            times.append(time.perf_counter() - t0)
        out[f"{key}_ms"], out[f"{key}_bytes"] = describe(times, 1e3), len(body)
    out["openmetrics_gzip_bytes"] = len(gzip.compress(generate_openmetrics(registry)))
    return out


def measure_render(device: str, work: str, reps: int) -> dict[str, Any]:
    """The one-rank trainer (every step traced); after its last step: the registry rendered directly,
    scaled k-fold up to the every-cap worst case, and scraped over HTTP."""
    from benchmarks.scale import count_series, worst_case

    out: dict[str, Any] = {}

    def at_end() -> None:
        agent = current_agent()
        from prometheus_client import generate_latest

        counted = count_series(generate_latest(agent.registry).decode())
        out.update(series=counted["total"], direct=time_render(agent.registry, reps))
        worst = sum(worst_case(counted["by_metric"]).values())
        points = []
        for k in sorted({1, 8, max(1, -(-worst // max(1, counted["total"])))}):
            points.append(
                {
                    "k": k,
                    "series": counted["total"] * k,
                    **time_render(Scaled(agent.registry, k), max(10, reps // k)),
                }
            )
        out.update(worst_case_series=worst, points=points)
        lo, hi = points[0], points[-1]
        for key in ("text", "openmetrics"):
            if hi["series"] > lo["series"]:
                out[f"{key}_us_per_series"] = (
                    (hi[f"{key}_ms"]["median"] - lo[f"{key}_ms"]["median"])
                    / (hi["series"] - lo["series"])
                    * 1e3
                )
        if agent.metrics_url:  # one scrape at a time, 50 ms apart: the endpoint paces back-to-back answers
            for key, headers in (("prometheus", PROM_HEADERS), ("plain", {})):
                times = []
                for _ in range(min(reps, 50)):
                    time.sleep(0.05)
                    t0 = time.perf_counter()
                    urllib.request.urlopen(
                        urllib.request.Request(agent.metrics_url, headers=headers), timeout=10
                    ).read()
                    times.append(time.perf_counter() - t0)
                out[f"http_{key}_ms"] = describe(times, 1e3)

    args = [*TRAINER[device], "--steps", "30", "--log-every", "100000"]
    train_inprocess(
        args, {**AGENT_ENV, "HPAR_RUN_DIR": os.path.join(work, "render"), "HPAR_TRACE_EVERY": "1"}, at_end
    )
    return out


def print_render(r: dict[str, Any]) -> None:
    d = r["direct"]
    print(
        f"render: {r['series']} series, {d['text_bytes']} B text; text {d['text_ms']['median']:.2f} ms (p99 "
        f"{d['text_ms']['p99']:.2f}), OpenMetrics {d['openmetrics_ms']['median']:.2f} ms; HTTP GET as Prometheus "
        f"{r.get('http_prometheus_ms', {}).get('median', float('nan')):.2f} ms, plain "
        f"{r.get('http_plain_ms', {}).get('median', float('nan')):.2f} ms"
    )
    pts = "; ".join(
        f"{p['series']} series {p['text_ms']['median']:.1f} / {p['openmetrics_ms']['median']:.1f} ms"
        for p in r["points"]
    )
    print(
        f"  scaled (text / OpenMetrics): {pts}; {r.get('text_us_per_series', float('nan')):.2f} / "
        f"{r.get('openmetrics_us_per_series', float('nan')):.2f} us per series; every-cap worst case "
        f"{r['worst_case_series']} series"
    )


# ------------------------------------------------------------------------------------ rss
def child_rss(out: str, argv: list[str]) -> int:
    """One trainer process; its memory after the last step, before the agent detaches."""

    def at_end() -> None:
        d: dict[str, Any] = {**proc_status(), "agent": current_agent() is not None}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            d.update(
                cuda_allocated=torch.cuda.memory_allocated(),
                cuda_max_reserved=torch.cuda.max_memory_reserved(),
            )
        Path(out).write_text(json.dumps(d))

    train_inprocess(argv, {}, at_end)
    return 0


def measure_rss(device: str, work: str, pairs: int, steps: int) -> dict[str, Any]:
    """Pairs of trainer processes (agent, --no-agent) started together, the order alternating."""
    runs: list[dict[str, Any]] = []
    for rep in range(pairs):
        procs = []
        for arm in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            out = os.path.join(work, f"rss{rep}-{arm}.json")
            args = [*TRAINER[device], "--steps", str(steps), "--log-every", "100000"] + (
                ["--no-agent"] if arm == "off" else []
            )
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                **AGENT_ENV,
                "HPAR_RUN_DIR": os.path.join(work, f"rss{rep}"),
            }
            cmd = [sys.executable, "-m", "benchmarks.components", "--child-rss", out, "--", *args]
            procs.append(
                (
                    arm,
                    out,
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    ),
                )
            )
        for arm, out, p in procs:
            _, err = p.communicate(timeout=900)
            if p.returncode or not os.path.exists(out):
                raise RuntimeError(f"rss {arm} run failed (rc {p.returncode}): {err[-2000:]}")
            d = json.loads(Path(out).read_text())
            if d["agent"] != (arm == "on"):
                raise RuntimeError(f"rss {arm} run had agent={d['agent']}")
            runs.append({"rep": rep, "arm": arm, **d})
    res: dict[str, Any] = {"pairs": pairs, "steps": steps, "runs": runs}
    for key in ("VmRSS", "VmHWM", "cuda_allocated", "cuda_max_reserved"):
        by = {(r["rep"], r["arm"]): r[key] for r in runs if r.get(key) is not None}
        diffs = [by[(i, "on")] - by[(i, "off")] for i in range(pairs) if (i, "on") in by and (i, "off") in by]
        if diffs:
            res[f"{key}_added"] = {"median": statistics.median(diffs), "pairs": diffs}
    res["VmRSS_off_median"] = statistics.median(r["VmRSS"] for r in runs if r["arm"] == "off")
    return res


def print_rss(r: dict[str, Any]) -> None:
    cuda = (
        (
            f"; CUDA allocated {r['cuda_allocated_added']['median']:+.0f} B, max reserved "
            f"{r['cuda_max_reserved_added']['median']:+.0f} B"
        )
        if "cuda_max_reserved_added" in r
        else ""
    )
    print(
        f"rss: the agent adds VmRSS {r['VmRSS_added']['median'] / 2**20:+.1f} MiB (pairs "
        f"{', '.join(f'{d / 2**20:+.1f}' for d in r['VmRSS_added']['pairs'])}; off {r['VmRSS_off_median'] / 2**20:.0f} "
        f"MiB), VmHWM {r['VmHWM_added']['median'] / 2**20:+.1f} MiB" + cuda
    )


# ------------------------------------------------------------------------------------ spans
def child_receiver() -> int:
    """testkit's OTLP/HTTP receiver, counting spans instead of keeping them. stdin: ``delay <s>`` (0: at
    once) | ``stats``; stdout: the port, then one JSON line per ``stats``."""
    from testkit.otlp_receiver import HttpReceiver

    class Counting(HttpReceiver):
        count = 0

        def _accept(self, request: Any) -> None:
            with self._cond:
                self.requests += 1
                self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)

    rec = Counting()
    with rec:
        print(rec.port, flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["delay"]:
                rec.delay = float(cmd[1])
                rec.set_mode("slow" if rec.delay else "up")
            elif cmd[:1] == ["stats"]:
                with rec._cond:
                    print(json.dumps({"requests": rec.requests, "spans": rec.count}), flush=True)
    return 0


class Receiver:
    """The parent's side of ``child_receiver``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.components", "--child-receiver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.endpoint = f"http://127.0.0.1:{int(self.stdout.readline())}/v1/traces"

    def send(self, line: str) -> None:
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        return json.loads(self.stdout.readline())

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(10)


def attach_traced(model: Any, optimizer: Any, run_dir: str, receiver: Receiver) -> Any:
    import hpar_agent

    with patched_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint}):
        return hpar_agent.attach(
            model, optimizer=optimizer, run_dir=run_dir, metrics_port=-1, traces="otlp", trace_every=1
        )


def exporter_gone(timeout: float) -> float | None:
    """Seconds until no span-exporter thread is left (None: still there after ``timeout``)."""
    t0 = time.perf_counter()
    while (
        any(t.name.startswith("OtelBatch") for t in threading.enumerate())
        and time.perf_counter() - t0 < timeout
    ):
        time.sleep(0.02)
    return (
        None
        if any(t.name.startswith("OtelBatch") for t in threading.enumerate())
        else time.perf_counter() - t0
    )


def measure_capacity(receiver: Receiver, work: str, seconds: float) -> dict[str, Any]:
    """``Tracing.export_step`` driven flat out by a thread with 17-span steps (4 pp.forward, 4
    pp.backward, 4 send, 4 recv, train.step: an 8-rank pipeline's step) into the fast receiver."""
    import hpar_agent
    from hpar_agent import catalogue as cat
    from hpar_agent.spans import SpanRecord, StepRecord

    receiver.send("delay 0")
    before = threading.enumerate()
    agent = attach_traced(None, None, os.path.join(work, "capacity"), receiver)
    tracing = agent.tracing
    if tracing is None:
        hpar_agent.detach()
        raise RuntimeError(f"no tracing (agent errors {dict(agent.errors)})")
    res: dict[str, Any] = {}

    def produce() -> None:
        step, end, c0 = 1_000_000, time.perf_counter() + seconds, time.thread_time()
        while time.perf_counter() < end:
            t = time.time_ns()
            rec = StepRecord(step=step, start_ns=t - 10_000_000, end_ns=t)
            for i in range(4):
                a = t - 9_000_000 + i * 2_000_000
                pp = {cat.ATTR_PP_STAGE: 0, cat.ATTR_MICROBATCH: i, cat.ATTR_STREAM: "cpu"}
                rec.children += [
                    SpanRecord(cat.SPAN_PP_FORWARD, a, a + 500_000, step, dict(pp)),
                    SpanRecord(cat.SPAN_PP_BACKWARD, a + 500_000, a + 1_500_000, step, dict(pp)),
                ]
                for op in ("send", "recv"):
                    attrs = {
                        cat.ATTR_PG: "pp",
                        cat.ATTR_OP: op,
                        cat.ATTR_SEQ: step * 8 + i,
                        cat.ATTR_BYTES: 65536,
                        cat.ATTR_STREAM: "cpu",
                        cat.ATTR_PEER: 1,
                    }
                    rec.children.append(
                        SpanRecord(cat.SPAN_COLLECTIVE_PREFIX + op, a, a + 200_000, step, attrs)
                    )
            tracing.export_step(rec)
            step += 1
        res["producer_cpu_s"] = time.thread_time() - c0

    exporters = ThreadClocks(t for t in started_since(before) if t.name.startswith("OtelBatch"))
    s0, d0, c0, x0 = receiver.stats(), tracing.dropped, tracing.spans_created, exporters.total()
    t0 = time.perf_counter()
    th = threading.Thread(target=produce, name="capacity-producer")
    th.start()
    th.join()
    wall = time.perf_counter() - t0
    s1, d1, c1, x1 = receiver.stats(), tracing.dropped, tracing.spans_created, exporters.total()
    t1 = time.perf_counter()
    hpar_agent.detach()
    created, accepted = c1 - c0, s1["spans"] - s0["spans"]
    res.update(
        window_s=wall,
        offered_per_s=created / wall,
        accepted_per_s=accepted / wall,
        dropped=d1 - d0,
        build_us_per_span=res["producer_cpu_s"] / created * 1e6 if created else None,
        export_us_per_span=(x1 - x0) / accepted * 1e6 if accepted else None,
        detach_s=time.perf_counter() - t1,
        exporter_gone_s=exporter_gone(10),
    )
    return res


def measure_training(
    receiver: Receiver, device: torch.device, work: str, reps: int, arm_s: float, slow_delay: float
) -> dict[str, Any]:
    """A one-stage pipeline (8 microbatches: 17 spans a step), every step traced; arms interleaved."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import hpar_agent

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    dim = 1024 if device.type == "cuda" else 64
    model = torch.nn.Sequential(
        torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
    ).to(device)
    sched = ScheduleGPipe(
        PipelineStage(model, 0, 1, device),
        n_microbatches=8,
        loss_fn=lambda o, t: torch.nn.functional.mse_loss(o, t),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, dim, device=device)
    opt_s: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        sched.step(x, target=x, losses=losses)
        t1 = time.perf_counter()
        opt.step()
        opt_s.append(time.perf_counter() - t1)
        float(torch.stack(losses).detach().mean())  # a host sync, as a loop that logs its loss

    for _ in range(20):
        step()
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for arm in ("noagent", "fast", "slow"):
            receiver.send(f"delay {slow_delay if arm == 'slow' else 0}")
            agent = (
                None
                if arm == "noagent"
                else attach_traced(model, opt, os.path.join(work, f"{arm}{rep}"), receiver)
            )
            if agent is not None:
                agent.watch_pipeline(schedule=sched)
            for _ in range(10):
                step()
            opt_s.clear()
            times, t_end = [], time.perf_counter() + arm_s
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            run: dict[str, Any] = {
                "arm": arm,
                "rep": rep,
                "step_ms": describe(times, 1e3),
                "opt_step_us": describe(opt_s, 1e6),
            }
            if agent is not None:
                tracing = agent.tracing
                t1 = time.perf_counter()
                hpar_agent.detach()
                run.update(
                    detach_s=time.perf_counter() - t1,
                    exporter_gone_s=exporter_gone(slow_delay + 10),
                    dropped=getattr(tracing, "dropped", None),
                )
            runs.append(run)
    dist.destroy_process_group()
    base = statistics.median(r["step_ms"]["median"] for r in runs if r["arm"] == "noagent")
    arms = {}
    for arm in ("noagent", "fast", "slow"):
        rs = [r for r in runs if r["arm"] == arm]
        med = statistics.median(r["step_ms"]["median"] for r in rs)
        arms[arm] = {
            "step_ms": med,
            "ratio": med / base,
            "step_ms_max": max(r["step_ms"]["max"] for r in rs),
            "opt_step_us_max": max(r["opt_step_us"]["max"] for r in rs),
            "detach_s_max": max((r.get("detach_s", 0.0) for r in rs), default=0.0),
            "dropped": sum(r.get("dropped") or 0 for r in rs),
            "exporter_gone_s": [r["exporter_gone_s"] for r in rs if "exporter_gone_s" in r],
        }
    return {"reps": reps, "arm_s": arm_s, "slow_delay_s": slow_delay, "arms": arms, "runs": runs}


def print_spans(s: dict[str, Any]) -> None:
    c = s["capacity"]
    print(
        f"spans (a): offered {c['offered_per_s']:.0f} spans/s, accepted {c['accepted_per_s']:.0f}/s, dropped "
        f"{c['dropped']}; build {c['build_us_per_span']:.1f} us CPU a span, export "
        f"{c['export_us_per_span'] or float('nan'):.1f} us; detach {c['detach_s']:.2f} s"
    )
    t = s["training"]
    print(
        f"spans (b): the training thread, every step traced (slow receiver: {t['slow_delay_s']} s a request):"
    )
    for arm, v in t["arms"].items():
        print(
            f"  {arm:8} step {v['step_ms']:.3f} ms (x{v['ratio']:.3f}), max {v['step_ms_max']:.2f} ms; "
            f"optimizer.step max {v['opt_step_us_max'] / 1e3:.2f} ms; dropped {v['dropped']}"
            + (
                f"; detach max {v['detach_s_max']:.2f} s, the exporter thread gone after (s; None: still there) "
                f"{[None if g is None else round(g, 3) for g in v['exporter_gone_s']]}"
                if arm != "noagent"
                else ""
            )
        )


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", default="cpu,render,rss,spans", help="comma-separated parts")
    ap.add_argument("--window", type=float, default=10.0, help="cpu: seconds of each steady window")
    ap.add_argument("--render-reps", type=int, default=200, help="render: renders / scrapes timed per format")
    ap.add_argument("--rss-pairs", type=int, default=2, help="rss: pairs of processes")
    ap.add_argument("--rss-steps", type=int, default=40, help="rss: trainer steps per process")
    ap.add_argument("--span-seconds", type=float, default=4.0, help="spans (a): seconds flat out")
    ap.add_argument("--span-reps", type=int, default=2, help="spans (b): rounds of the arms")
    ap.add_argument("--arm-seconds", type=float, default=4.0, help="spans (b): seconds a round per arm")
    ap.add_argument("--slow-delay", type=float, default=2.0, help="spans (b): the slow receiver's delay, s")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    parts = {p.strip() for p in a.only.split(",") if p.strip()}
    work = tempfile.mkdtemp(prefix="hpar-components-")
    r = results("components", a.device, argv, trainer_args=TRAINER[a.device])
    if "cpu" in parts:
        r["cpu"] = measure_cpu(a.device, work, a.window)
    if "render" in parts:
        r["render"] = measure_render(a.device, work, a.render_reps)
    if "rss" in parts:
        r["rss"] = measure_rss(a.device, work, a.rss_pairs, a.rss_steps)
    if "spans" in parts:
        device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
        receiver = Receiver()
        try:
            r["spans"] = {
                "capacity": measure_capacity(receiver, work, a.span_seconds),
                "training": measure_training(
                    receiver, device, work, a.span_reps, a.arm_seconds, a.slow_delay
                ),
            }
        finally:
            receiver.close()
    finish(r, a.json)
    print(title(r, "component costs"))
    for key, show in (
        ("cpu", print_cpu),
        ("render", print_render),
        ("rss", print_rss),
        ("spans", print_spans),
    ):
        if key in r:
            show(r[key])
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-receiver"]:
        sys.exit(child_receiver())
    if sys.argv[1:2] == ["--child-rss"]:
        rest = sys.argv[3:]
        sys.exit(child_rss(sys.argv[2], rest[1:] if rest[:1] == ["--"] else rest))
    sys.exit(main())
