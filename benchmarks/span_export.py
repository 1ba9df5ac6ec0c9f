"""Span export to ``testkit/otlp_receiver.py``'s OTLP/HTTP receiver in a subprocess (counting, not
keeping, spans), answering at once ("fast") or after ``--slow-delay`` s per request ("slow"):

a. throughput (fast receiver): a thread drives the agent's ``Tracing.export_step`` flat out with 17-span
   steps (the 8-rank shape: 4 pp.forward, 4 pp.backward, 4 send, 4 recv, train.step), so the bounded
   queue overflows: spans/s accepted, spans the agent counted as dropped, CPU per span to build (agent
   side) and to encode and post (exporter thread);
b. the training thread while the exporter is saturated: a one-stage ``torch.distributed.pipelining``
   schedule (8 microbatches: 17 spans a step through the real pipeline hooks) on a small MLP, every
   step traced, arms interleaved: no agent, tracing off, fast receiver, slow receiver (warmed up until
   its span queue is full). Step time and ``optimizer.step()`` time (the step hook) per arm: a training
   thread that waited on the exporter would show steps as long as the receiver's delay. Which threads
   build and export spans is recorded by wrapping ``export_step`` and the exporter.

    python -m benchmarks.span_export --json spans-cpu.json
    python -m benchmarks.span_export --device cuda --json spans-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    CONFIGS,
    GcWatch,
    finish,
    full_gc_ms,
    need_device,
    results,
    summarize,
    task_cpu,
    time_ticks,
    title,
)

SPANS_PER_STEP = 17  # 8-rank steady step: 4 pp.forward, 4 pp.backward, 4 send, 4 recv, 1 train.step
MICROBATCHES = 8  # one-stage pipeline: 8 forward + 8 backward + 1 step = 17 spans
LONG_STEP_TEXT = "max(50 ms, 10x median)"


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
        cmd = [sys.executable, "-m", "benchmarks.span_export", "--child-receiver"]
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
    (the slow receiver's case is the training-thread test, b)."""
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


def print_report(r: dict[str, Any]) -> None:
    print(title(r, "span export"))
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
    ap.add_argument("--span-seconds", type=float, default=4.0, help="seconds of the export-capacity test")
    ap.add_argument("--span-reps", type=int, default=2, help="interleaved rounds of the training-thread arms")
    ap.add_argument("--arm-seconds", type=float, default=4.0, help="measured seconds per training-thread arm")
    ap.add_argument("--slow-delay", type=float, default=2.0, help="slow receiver: seconds before each answer")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    cfg = CONFIGS[a.device]
    work = tempfile.mkdtemp(prefix="hpar-spans-")
    r = results("span_export", a.device, argv)
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
    finish(r, a.json)
    print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(child_receiver() if sys.argv[1:2] == ["--child-receiver"] else main())
