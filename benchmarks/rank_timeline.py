"""Long steps of a multi-rank run, per rank, and what overlapped them (``step_timeline`` for torchrun).

Runs the reference trainer under torchrun (default: the 4-rank CPU configuration of ``overhead.py``),
every rank through this file's ``--child`` wrapper, which records with ``perf_counter_ns``: each
optimizer step's end (and the training thread's CPU time there), each agent pass (``Agent.tick``), each full flight-recorder read (the dump that
returns entries, not the ``pg_status`` probe) and each generation-2 garbage collection with its
thread. Then, per rank, it sorts the steps after ``--skip`` by what overlapped them (a full read, else
a full collection, else a pass, else nothing) and prints the median step of each class, the p99, and
the full collections after the first step, and the training thread's CPU time per step. ``--arm off``
runs the same trainer with ``--no-agent``. ``--py-spy STEP:SECONDS[:RATE]`` samples rank 0 with py-spy and
charges the training thread's busy samples to the agent (its hooks), the trainer or torch.

    python -m benchmarks.rank_timeline --arm on --arm off --steps 300 --json rank-timeline.json
"""

from __future__ import annotations

import argparse
import atexit
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.overhead import CONFIGS, agent_notes

EVENTS: list[tuple[str, str, int, int]] = []  # (what, thread, start_ns, end_ns)
STEP_ENDS: list[int] = []
STEP_CPU: list[int] = []  # the training thread's CPU time (thread_time_ns) at each step end
PASSES: list[dict[str, int]] = []  # per agent pass: CPU ns of the agent thread, by component and in all
THREADS: list[tuple[int, dict[str, int]]] = []  # every THREAD_EVERY steps: (perf ns, CPU ns by thread class)
THREAD_EVERY = 25
#: Thread classes by name (``/proc/self/task/*/comm``): torch's worker server answers the reader
#: process's full flight-recorder dumps on its own threads, outside the GIL and the agent thread's CPU.
THREAD_CLASSES = (("worker server", ("pt_workerserver",)), ("gloo", ("gloo", "pt_gloo")),
                  ("agent thread", ("hpar-agent",)))


def _timed(what: str, fn: Any, keep: Any = None) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if keep is None or keep(out):
            EVENTS.append((what, threading.current_thread().name, t0, time.perf_counter_ns()))
        return out
    return wrapper


def _cpu_costed(tick: Any) -> Any:
    """``Agent.tick`` recording the agent thread's CPU time (``thread_time``: what a pass can hold the GIL
    for, without the time it handed back) per component (poll, on_step, end_pass), for the span schedule
    and span export, and two parts of the collectives' (``collectives:read``: a full read, which is the
    dump, its decoding and the ledger on the agent thread with ``HPAR_FR_READER=inline`` and only a
    request and a wait for the reader process by default; ``collectives:apply``: the read's update
    applied), and the detectors' (``detectors:exchange``, ``detectors:<name>``: each one's evaluate).
    The reader process's own CPU is in the rank's summary (``reader_cpu_s``)."""
    costs: dict[str, int] = {}

    def charge(key: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                costs[key] = costs.get(key, 0) + time.thread_time_ns() - t0
        return wrapper

    from hpar_agent.component import Component

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_bench_costed", False):
            self._bench_costed = True
            for comp in self.components:
                for meth in ("poll", "on_step", "end_pass"):
                    if getattr(type(comp), meth) is getattr(Component, meth):
                        continue  # the no-op: wrapping it would make the agent call it (see Agent._pass)
                    fn = getattr(comp, meth)
                    setattr(comp, meth, charge(comp.name, charge(f"{comp.name}:{meth}", fn) if meth != "poll" else fn))
                if hasattr(comp, "take_completed"):
                    comp.take_completed = charge(comp.name, comp.take_completed)
                if comp.name == "collectives":  # parts of its cost: the read and applying its update
                    comp._full_read = charge("collectives:read", comp._full_read)
                    comp._apply = charge("collectives:apply", comp._apply)
                if comp.name == "detectors":  # the exchange, and each detector's judgement
                    comp._exchange = charge("detectors:exchange", comp._exchange)
                    for d in comp.detectors:
                        d.evaluate = charge(f"detectors:{d.name}", d.evaluate)
            for meth in ("add_step", "watermark", "due"):
                setattr(self.span_schedule, meth, charge("span_schedule", getattr(self.span_schedule, meth)))
            if self.tracing is not None:
                self.tracing.export_step = charge("tracing", self.tracing.export_step)
        costs.clear()
        t0 = time.thread_time_ns()
        try:
            return tick(self, *args, **kwargs)
        finally:
            PASSES.append({"total": time.thread_time_ns() - t0, **costs})
    return wrapper


def thread_cpu(main_tid: int) -> dict[str, int]:
    """CPU ns so far of this process's threads by class (``schedstat``, Linux; {} elsewhere)."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    py_names = {t.native_id: t.name for t in threading.enumerate()}  # Python names are not the OS's (3.11-3.13)
    for tid in tids:
        try:
            name = py_names.get(int(tid)) or Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
        cls = "training thread" if int(tid) == main_tid else next(
            (c for c, prefixes in THREAD_CLASSES if name.startswith(prefixes)), "other")
        out[cls] = out.get(cls, 0) + ns
    return out


#: Shortest GC pause or agent-thread unit (CPU between two hand-backs of the GIL) recorded as an event.
LONG_NS = 2_000_000


def _record_long_units() -> None:
    """Every unit of agent-thread work between two hand-backs of the GIL (``gil.Yielder``) that took
    ``LONG_NS`` of CPU or more, as an event ``unit:<check point before> -> <after>`` ending at its
    hand-back and as long as its CPU time (a unit that also waited with the GIL released, for the reader
    process say, held it no longer than that): what a training thread waiting for the GIL then waited for."""
    import traceback

    from hpar_agent import gil

    hand_back, enter = gil.Yielder.__call__, gil.running.__enter__
    last: dict[int, tuple[int, int, str]] = {}  # thread id -> (wall ns, CPU ns, site) at the last hand-back

    def site() -> str:
        f = traceback.extract_stack(limit=4)[0]
        return f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"

    def call(y: Any) -> None:
        if time.perf_counter_ns() - y.since < y.hold_ns:
            return
        tid, now, cpu = threading.get_ident(), time.perf_counter_ns(), time.thread_time_ns()
        w0, c0, where = last.get(tid, (now, cpu, "?"))
        if cpu - c0 >= LONG_NS:  # its last ``cpu - c0`` ns of wall time (a unit may wait with the GIL released)
            EVENTS.append((f"unit:{where} -> {site()}", threading.current_thread().name, max(w0, now - (cpu - c0)), now))
        hand_back(y)
        last[tid] = (time.perf_counter_ns(), time.thread_time_ns(), site())

    def entered(r: Any) -> Any:
        last[threading.get_ident()] = (time.perf_counter_ns(), time.thread_time_ns(), "pass start")
        return enter(r)

    gil.Yielder.__call__ = call  # type: ignore[method-assign]
    gil.running.__enter__ = entered  # type: ignore[method-assign]


def instrument(out_dir: str) -> None:
    """Step ends, agent passes (with their CPU time by component), full FR reads and full collections of
    this rank, dumped at exit."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    spy = os.environ.get("HPAR_BENCH_PYSPY", "")  # "<first step>:<seconds>[:<rate>]", rank 0 only
    spy_at, spy_s, spy_rate = [*spy.split(":"), "250"][:3] if spy else ("0", "0", "0")

    def step_end(*_: Any, **__: Any) -> None:
        STEP_ENDS.append(time.perf_counter_ns())
        STEP_CPU.append(time.thread_time_ns())
        if len(STEP_ENDS) % THREAD_EVERY == 1:
            THREADS.append((time.perf_counter_ns(), thread_cpu(main_tid)))
        if spy and len(STEP_ENDS) == int(spy_at) and os.environ.get("RANK", "0") == "0":
            try:  # never let the sampler break the run it samples
                subprocess.Popen(["py-spy", "record", "-p", str(os.getpid()), "-d", spy_s, "-r", spy_rate, "--threads",
                                  "--nonblocking", "-f", "raw", "-o", os.path.join(out_dir, "pyspy.rank0.txt")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except OSError as exc:
                print(f"rank_timeline: py-spy did not start: {exc}", file=sys.stderr)

    main_tid = threading.get_native_id()
    register_optimizer_step_post_hook(step_end)
    import hpar_agent.agent as agent_mod
    import hpar_agent.collectors.collectives as coll

    agent_mod.Agent.tick = _timed("pass", _cpu_costed(agent_mod.Agent.tick))  # type: ignore[method-assign]
    coll.CollectiveCollector._read = _timed(  # type: ignore[method-assign]
        "fr_read", coll.CollectiveCollector._read, keep=lambda out: out[1] is not None)
    started: dict[str, int] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter_ns()
            return
        gen, t1 = info.get("generation"), time.perf_counter_ns()
        if gen == 2:
            EVENTS.append(("gc2", threading.current_thread().name, started.get("t", 0), t1))
        elif t1 - started.get("t", t1) >= LONG_NS:  # a young collection long enough to stall a step
            EVENTS.append((f"gc{gen}", threading.current_thread().name, started.get("t", 0), t1))

    gc.callbacks.append(on_gc)
    _record_long_units()
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"steps": STEP_ENDS, "step_cpu": STEP_CPU, "events": EVENTS, "passes": PASSES,
                    "threads": THREADS})))


def child(argv: list[str]) -> int:
    out_dir, rest = argv[0], argv[2:] if argv[1:2] == ["--"] else argv[1:]
    instrument(out_dir)
    from hpar_trainer.train import main as train_main

    return train_main(rest)


def classify(a: int, b: int, events: list[list[Any]]) -> str:
    over = {e[0] for e in events if e[2] < b and e[3] > a}
    for what in ("fr_read", "gc2", "pass"):
        if what in over:
            return what
    return "none"


def analyse(path: Path, skip: int) -> dict[str, Any]:
    data = json.loads(path.read_text())
    ends, events = data["steps"], data["events"]
    steps = list(itertools.pairwise(ends))[skip:]
    ms = [(b - a) / 1e6 for a, b in steps]
    cpu = [(b - a) / 1e6 for a, b in list(itertools.pairwise(data.get("step_cpu") or []))[skip:]]
    groups: dict[str, list[float]] = {}
    for (a, b), d in zip(steps, ms, strict=True):
        groups.setdefault(classify(a, b, events), []).append(d)
    first = ends[0] if ends else 0
    gc2 = [{"after_first_step_s": round((e[2] - first) / 1e9, 2), "ms": round((e[3] - e[2]) / 1e6, 1), "thread": e[1]}
           for e in events if e[0] == "gc2"]
    return {
        "steps": len(ms),
        "run_s": (ends[-1] - ends[0]) / 1e9 if len(ends) > 1 else 0.0,
        "median_ms": statistics.median(ms),
        "p99_ms": statistics.quantiles(ms, n=100, method="inclusive")[98],
        "train_cpu_ms": statistics.median(cpu) if cpu else None,
        "by_overlap": {k: {"steps": len(v), "median_ms": statistics.median(v)} for k, v in sorted(groups.items())},
        "fr_reads": sum(1 for e in events if e[0] == "fr_read"),
        "gc2_after_first_step": [g for g in gc2 if g["after_first_step_s"] > 0],
        "gc2_before": sum(1 for g in gc2 if g["after_first_step_s"] <= 0),
        "pass_cpu_ms": pass_costs(data.get("passes") or []),
        "thread_cpu_ms_per_s": threads_per_s(data.get("threads") or [], ends[skip] if len(ends) > skip else 0),
    }


def _event_class(what: str) -> str:
    return what if not what.startswith("unit:") else "unit:" + what.split(" -> ")[0][5:].rsplit(":", 1)[-1]


def long_steps(paths: list[Path], skip: int, over_ms: float, show: int = 12) -> dict[str, Any]:
    """Steps of any rank longer than its median by ``over_ms``, against what ran meanwhile on every rank
    (ranks share ``perf_counter``'s clock): per class of event (a full read, a pass, a collection of
    each generation, a long agent unit by where it started), how many long steps it overlapped against
    how many steps of all; and rank 0's first ``show`` long steps with their events."""
    ranks = [json.loads(p.read_text()) for p in paths]
    events = [(r, e[0], e[2], e[3]) for r, d in enumerate(ranks) for e in d["events"]]
    out: dict[str, Any] = {"over_ms": over_ms, "ranks": {}, "classes": {}, "rank0": []}
    hit: dict[str, list[int]] = {}  # class -> [long steps overlapped, steps overlapped]
    for r, d in enumerate(ranks):
        steps = list(itertools.pairwise(d["steps"]))[skip:]
        if not steps:
            continue
        med = statistics.median(b - a for a, b in steps)
        n_long = 0
        for a, b in steps:
            is_long = b - a > med + over_ms * 1e6
            n_long += is_long
            over = [(er, what, s0, s1) for er, what, s0, s1 in events if s0 < b and s1 > a]
            for cls in {_event_class(w) for _, w, _, _ in over}:
                hit.setdefault(cls, [0, 0])[0 if is_long else 1] += 1
            if is_long and r == 0 and len(out["rank0"]) < show:
                out["rank0"].append({"ms": round((b - a) / 1e6, 1), "events": sorted(
                    {f"r{er} {w} {(s1 - s0) / 1e6:.1f} ms" for er, w, s0, s1 in over if s1 - s0 >= 1e6})})
        out["ranks"][f"rank{r}"] = {"steps": len(steps), "long": n_long, "median_ms": med / 1e6}
    n_long = sum(v["long"] for v in out["ranks"].values()) or 1
    n_all = sum(v["steps"] for v in out["ranks"].values()) or 1
    out["classes"] = {k: {"long_share": v[0] / n_long, "other_share": v[1] / max(n_all - n_long, 1)}
                      for k, v in sorted(hit.items(), key=lambda kv: -kv[1][0])}
    return out


def threads_per_s(samples: list[list[Any]], from_ns: int) -> dict[str, float]:
    """CPU ms a second of each thread class between the first sample at or after ``from_ns`` and the last."""
    kept = [s for s in samples if s[0] >= from_ns]
    if len(kept) < 2:
        return {}
    (t0, a), (t1, b) = kept[0], kept[-1]
    return {k: (b[k] - a.get(k, 0)) / (t1 - t0) * 1e3 for k in sorted(b, key=lambda k: -b[k]) if k in a}


def pass_costs(passes: list[dict[str, int]]) -> dict[str, dict[str, float]]:
    """Per component (and ``total``): median and max CPU ms of the agent thread per pass, and its share
    of the agent thread's CPU over the run; the first pass (attach-time reads) left out."""
    passes = passes[1:]
    grand = sum(p["total"] for p in passes) or 1
    keys = sorted({k for p in passes for k in p}, key=lambda k: -sum(p.get(k, 0) for p in passes))
    return {k: {"median": statistics.median(p.get(k, 0) for p in passes) / 1e6,
                "max": max(p.get(k, 0) for p in passes) / 1e6,
                "share": sum(p.get(k, 0) for p in passes) / grand} for k in keys}


#: Leaf frames of an agent thread that waits (a paced pass's sleep, the reader's reply, its tick).
IDLE = ("Yielder.__call__", "Condition.wait", "Event.wait", "_read_exact")
#: Where a sampled frame's file belongs (py-spy prints paths relative to the entry of sys.path).
OWNERS = (("agent", ("hpar_agent/", "agent/", "exporters/")), ("trainer", ("hpar_trainer/", "trainer/")),
          ("torch", ("torch/", "<eval_with_key>", "codegen(")))


def training_thread_samples(path: Path) -> dict[str, Any]:
    """py-spy's raw samples of rank 0's main (training) thread, each charged to the deepest frame that
    belongs to the agent, the trainer or torch: the agent's share of the training thread's busy samples
    (its hooks), and the agent functions that hold it."""
    owners: dict[str, int] = {}
    funcs: dict[str, int] = {}
    agent_work: dict[str, int] = {}
    total = agent_total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit():
            continue
        if "hpar-agent" in frames[0] and len(frames) > 1 and not frames[-1].startswith(IDLE):
            agent_total += int(n)  # the agent thread at work (not waiting): what it spends that on
            for name in {f.partition(" (")[0] for f in frames[1:]}:
                agent_work[name] = agent_work.get(name, 0) + int(n)
        if "MainThread" not in frames[0]:
            continue
        total += int(n)
        for frame in reversed(frames[1:]):
            name, _, where = frame.partition(" (")
            owner = next((o for o, marks in OWNERS if any(m in where for m in marks)), None)
            if owner:
                owners[owner] = owners.get(owner, 0) + int(n)
                if owner == "agent":
                    key = f"{name} ({where.rsplit(':', 1)[0]})"
                    funcs[key] = funcs.get(key, 0) + int(n)
                break
    top = sorted(funcs.items(), key=lambda kv: -kv[1])[:8]
    frame = ("Thread.", "Agent._run", "Agent.tick", "Agent._pass")  # every pass's outer frames
    work = sorted(((k, v) for k, v in agent_work.items() if "." in k and not k.startswith(frame)),
                  key=lambda kv: -kv[1])[:24]
    return {"samples": total, "share": {k: v / max(total, 1) for k, v in owners.items()},
            "agent_functions": {k: v / max(total, 1) for k, v in top},
            "agent_thread_work_samples": agent_total,
            "agent_thread_work": {k: round(v / max(agent_total, 1), 3) for k, v in work}}


def run_arm(arm: str, nproc: int, args: list[str], timeout: float, skip: int,
            agent_env: dict[str, str], long_ms: float = 0.0, raw: str = "") -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"hpar-rank-timeline-{arm}-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if arm == "on":
        env.update(HPAR_RUN_DIR=os.path.join(work, "agent"), HPAR_TRACES="file", HPAR_METRICS_PORT="0", **agent_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "benchmarks.rank_timeline", "--child", work, "--",
           *args, "--out", os.path.join(work, "trainer.json"), *([] if arm == "on" else ["--no-agent"])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode:
        raise RuntimeError(f"{arm}: torchrun exit {res.returncode}\n{res.stderr[-3000:]}")
    out = {f"rank{r}": {**analyse(Path(work, f"rank{r}.json"), skip),
                        "reader": agent_notes(os.path.join(work, "agent"), r)} for r in range(nproc)}
    if long_ms:
        out["long_steps"] = long_steps([Path(work, f"rank{r}.json") for r in range(nproc)], skip, long_ms)
    if raw:  # every rank's record as it came, for analyses this script does not print
        Path(raw).write_text(json.dumps({f"rank{r}": json.loads(Path(work, f"rank{r}.json").read_text())
                                         for r in range(nproc)}))
    spy = Path(work, "pyspy.rank0.txt")
    if spy.exists():
        out["rank0"]["py_spy"] = training_thread_samples(spy)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", choices=("on", "off"), help="repeatable; default: on off")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip", type=int, default=30, help="steps left out at the start (compile, warm-up)")
    ap.add_argument("--nproc", type=int, default=CONFIGS["cpu"]["nproc"])
    ap.add_argument("--extra", default="", help="more trainer arguments (later ones win)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="agent setting for the on arm, repeatable (e.g. HPAR_FR_READER=inline)")
    ap.add_argument("--py-spy", default="", metavar="STEP:SECONDS[:RATE]",
                    help="sample rank 0's threads with py-spy for SECONDS from step STEP, RATE a second "
                         "(default 250; the agent thread works ~1 %% of the time: 1000 sees it better), every arm")
    ap.add_argument("--long-ms", type=float, default=0.0,
                    help="also attribute the steps this many ms over their rank's median to what overlapped them")
    ap.add_argument("--raw", default="", metavar="FILE.json",
                    help="also write every rank's raw record of each arm (FILE-<arm>.json)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.py_spy:
        parts = a.py_spy.split(":")
        if not (2 <= len(parts) <= 3 and all(p.isdigit() for p in parts)):
            ap.error(f"--py-spy {a.py_spy!r}: expected STEP:SECONDS[:RATE] (integers)")
        if shutil.which("py-spy") is None:
            ap.error("--py-spy: no py-spy on PATH")
        os.environ["HPAR_BENCH_PYSPY"] = a.py_spy
    args = [*CONFIGS["cpu"]["args"], "--steps", str(a.steps), "--log-every", "100000", *a.extra.split()]
    result: dict[str, Any] = {"trainer_args": args, "nproc": a.nproc, "date": time.strftime("%Y-%m-%d")}
    for arm in a.arm or ["on", "off"]:
        agent_env = dict(kv.split("=", 1) for kv in a.env)
        result["agent_env"] = agent_env
        raw = a.raw.replace(".json", f"-{arm}.json") if a.raw else ""
        ranks = result[arm] = run_arm(arm, a.nproc, args, a.timeout, a.skip, agent_env, a.long_ms, raw)
        print(f"== {arm}")
        longs = ranks.pop("long_steps", None)
        for name, r in ranks.items():
            classes = ", ".join(f"{k} {v['steps']} x {v['median_ms']:.1f} ms" for k, v in r["by_overlap"].items())
            gcs = ", ".join(f"{g['ms']} ms @ {g['after_first_step_s']} s ({g['thread']})" for g in r["gc2_after_first_step"])
            print(f"   {name}: median {r['median_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, training thread's CPU "
                  f"{r['train_cpu_ms']:.2f} ms/step; {classes}; "
                  f"full FR reads {r['fr_reads']}; gen-2 collections: {r['gc2_before']} before the first step, "
                  f"after it: {gcs or 'none'}")
            costs = ", ".join(f"{k} {v['median']:.2f}/{v['max']:.1f} ms ({v['share']:.0%})"
                              for k, v in r["pass_cpu_ms"].items())
            if costs:
                print(f"      agent-thread CPU per pass, median/max (share): {costs}")
            if r.get("py_spy"):
                sp = r["py_spy"]
                print(f"      py-spy, training thread ({sp['samples']} busy samples): "
                      + ", ".join(f"{k} {v:.1%}" for k, v in sp["share"].items()) + "; agent: "
                      + ", ".join(f"{k} {v:.2%}" for k, v in sp["agent_functions"].items()))
                print(f"      py-spy, agent thread at work ({sp['agent_thread_work_samples']} samples), inclusive: "
                      + ", ".join(f"{k} {v:.0%}" for k, v in list(sp["agent_thread_work"].items())[:14]))
            if r.get("thread_cpu_ms_per_s"):
                print("      CPU by thread, ms a second: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in r["thread_cpu_ms_per_s"].items()))
            if r.get("reader"):
                rd = r["reader"]
                span_s = r["run_s"] or 1.0
                print(f"      full reads: {rd} (the reader process: {rd.get('cpu_s', 0) / span_s * 1e3:.1f} ms of CPU a "
                      f"second over the {span_s:.0f} s from the first step, {rd.get('reads', 0) / span_s:.2f} reads a second)")
        if longs:
            print(f"   steps {longs['over_ms']:g} ms over their rank's median: "
                  + ", ".join(f"{k} {v['long']} of {v['steps']}" for k, v in longs["ranks"].items()))
            print("   what overlapped them (share of long steps / of the other steps, any rank's event): "
                  + ", ".join(f"{k} {v['long_share']:.0%}/{v['other_share']:.0%}" for k, v in longs["classes"].items()))
            for st in longs["rank0"]:
                print(f"      rank0 {st['ms']} ms: " + "; ".join(st["events"]))
            ranks["long_steps"] = longs
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
