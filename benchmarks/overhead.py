"""Training-step overhead of the agent (and of torch.profiler / NCCL timing), measured side by side.

Arms:
  off       the trainer with no agent
  on        the agent with its defaults: every collector, detectors, tracing at the default sampling,
            traces to a local file (``HPAR_TRACES=file``), metrics endpoint on an ephemeral port
  profiler  no agent, inside ``torch.profiler.profile`` (CPU, plus CUDA activities on a GPU)
  aa        no agent, a second "off" (``--aa``): the A/A control, whose ratio to off is the noise floor
  burn      no agent, a thread holding the GIL in slices at the agent's shared instants (``--burn 1/100``:
            1 ms every 100 ms of wall clock; blocks only): what the slicing itself costs the job
  spin      no agent, a thread at nice 19 in each rank busy off the GIL for a burst at shared instants
            (``--spin 25/1000``; blocks only): what the CPU of the full reads' dumps costs the job by itself
  nccl      no agent, ``TORCH_NCCL_ENABLE_TIMING=1`` (CUDA only; ``--design runs`` only: the env is read
            when the process group starts)
  <name>    ``--variant NAME:K=V,...``: the agent with these settings over its defaults (an ablation:
            ``--variant nopass:HPAR_INTERVAL=3600,HPAR_FR_INTERVAL=86400`` leaves the hooks alone;
            ``HPAR_BENCH_DROP=anatomy,...`` leaves those components out, ``HPAR_BENCH_PACE=0.25/25``
            paces the passes in 0.25 ms slices every 25 ms)

Two designs, both interleaved so machine drift hits every arm alike:
  blocks (default)  ONE trainer process (torchrun ranks, or in-process at world size 1) runs
                    ``--block``-step blocks; before each block every rank attaches the agent (or starts
                    the profiler), after it detaches (stops) it. A pair is one block of every arm, the
                    order rotating from pair to pair; warm-up blocks of every arm come first (compile,
                    caches, the graphs Dynamo keeps for hooks on and off). A block's step time is the
                    median after its first ``--block-skip`` steps (the agent's first polls and
                    exchanges). One process means one compile, one memory layout and one set of
                    caches: the run-to-run spread of separate processes (5-7 % on the H200) would
                    otherwise swamp a sub-percent overhead.
  runs              one fresh trainer process per arm and pair, the agent attached before the first step:
                    what users get, warm-up included (needed for the nccl arm).
A pair's ratio is arm / off of the same pair. Printed: median ratio over pairs with its order-statistic
interval and that interval's exact coverage (95 % needs at least 6 pairs; fewer give [min, max] at
less), the mean with the standard error, min/max, and (runs) the median of the pairs' p99 step ratios.
Blocks also print the p99 of every arm's kept steps pooled over its blocks, and rank 0's training-thread
CPU per step (arm over off: what the hooks cost that thread, without the waits); ``--windows A:B,...``
the ratios on steps A..B-1 of each block alone (right after attach against later). ``--reference``
(blocks under torchrun) runs a second job of off blocks on the other half of the cores and divides each
block's median by that job's median step over the same seconds: a slowdown of the whole machine (a
neighbour, the clocks) falls on both jobs and cancels, while the on/off contrast stays within one job.

Configurations: ``--config cpu`` is 4 gloo ranks under torchrun (dp1 x tp2 x pp2, 1F1B, aot_eager, a small
model); ``--config gpu`` is world size 1 in-process (inductor, bf16, a model whose step takes >= 50 ms on
an H200). ``--cpu-smoke`` runs the gpu configuration's in-process path on CPU with a tiny model (to test
this script without a GPU).

    python benchmarks/overhead.py --config cpu --json overhead-cpu.json
    python benchmarks/overhead.py --config gpu --json overhead-gpu.json
    python benchmarks/overhead.py --config gpu --design runs --pairs 5 --json overhead-gpu-runs.json
    python benchmarks/overhead.py --config gpu --nproc 8 --extra "--dp 2 --tp 2 --pp 2" --aa   # 8 GPUs
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {
        "nproc": 4,
        "args": ["--dp", "1", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--compile", "aot_eager",
                 "--layers", "4", "--dim", "64", "--heads", "4", "--seq-len", "32", "--global-batch", "16",
                 "--device", "cpu"],
        "steps": 16,
        "skip": 4,
        "block": 20,
        "block_skip": 3,
        "pairs": 10,
    },
    "gpu": {
        "nproc": 1,
        "args": ["--compile", "inductor", "--dtype", "bf16", "--layers", "12", "--dim", "2048", "--heads", "16",
                 "--seq-len", "1024", "--global-batch", "8", "--vocab", "8192", "--lr", "3e-4", "--device", "cuda"],
        "steps": 25,
        "skip": 5,
        "block": 30,
        "block_skip": 5,
        "pairs": 15,
    },
    "cpu-smoke": {  # the gpu configuration's in-process path on CPU, tiny
        "nproc": 1,
        "args": ["--compile", "aot_eager", "--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32",
                 "--global-batch", "8", "--device", "cpu"],
        "steps": 8,
        "skip": 3,
        "block": 6,
        "block_skip": 2,
        "pairs": 3,
    },
}


def agent_arm(arm: str, variants: dict[str, dict[str, str]] | None = None) -> bool:
    """Whether the arm runs the agent: ``on`` and every ``--variant``."""
    return arm == "on" or arm in (variants or {})


def arm_env(arm: str, run_dir: str, job: str, variants: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """Environment of one arm; the agent's settings are its defaults except where files go (and a
    variant's own settings)."""
    env: dict[str, str] = {}
    if agent_arm(arm, variants):
        env.update(HPAR_RUN_DIR=run_dir, HPAR_JOB_ID=job, HPAR_TRACES="file", HPAR_METRICS_PORT="0",
                   HPAR_DETECTORS="1")
        env.update((variants or {}).get(arm, {}))
    if arm == "nccl":
        env["TORCH_NCCL_ENABLE_TIMING"] = "1"
    return env


def trainer_args(cfg: dict[str, Any], arm: str, out: str, variants: dict[str, dict[str, str]] | None = None) -> list[str]:
    args = [*cfg["args"], "--steps", str(cfg["steps"]), "--log-every", "1000", "--out", out]
    return args if agent_arm(arm, variants) else [*args, "--no-agent"]


def profiler() -> torch.profiler.profile:
    """torch.profiler as users run it: CPU activities, plus CUDA when a GPU is present."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


@contextlib.contextmanager
def maybe_profiler(on: bool) -> Iterator[None]:
    """torch.profiler over the whole trainer run."""
    if not on:
        yield
        return
    with profiler():
        yield


@contextlib.contextmanager
def at_instants(name: str, slot_ns: int, work: Callable[[], None],
                waiting: Callable[[], Callable[[], None]] | None = None) -> Iterator[list[int]]:
    """A thread ``name`` that runs ``work`` at every ``slot_ns`` multiple of the wall clock (the agent's
    shared instants, ``gil``) until the block ends; yields how many times it ran. ``waiting`` is called
    before each wait for the instant and returns what undoes it after."""
    done = [0]
    stop = threading.Event()

    def loop() -> None:
        while True:
            undo = waiting() if waiting is not None else None
            stopped = stop.wait((slot_ns - time.time_ns() % slot_ns) / 1e9)
            if undo is not None:
                undo()
            if stopped:
                return
            work()
            done[0] += 1

    t = threading.Thread(target=loop, name=name, daemon=True)
    t.start()
    try:
        yield done
    finally:
        stop.set()
        t.join()


@contextlib.contextmanager
def gil_burner(spec: str) -> Iterator[list[int]]:
    """``HOLD_MS/SLOT_MS[/SWITCH_MS]``: a thread that holds the GIL in a busy Python loop for HOLD_MS at
    every SLOT_MS multiple of the wall clock (the agent's pacing, ``gil``, with nothing else of the
    agent): what a given duty of GIL slices costs the job by itself; with SWITCH_MS, the switch
    interval is that while it waits for its instant. Empty: nothing."""
    if not spec:
        yield [0]
        return
    hold_ms, slot_ms, switch_ms = [*spec.split("/"), ""][:3]
    hold_ns = int(float(hold_ms) * 1e6)

    def hold() -> None:
        end = time.perf_counter_ns() + hold_ns
        while time.perf_counter_ns() < end:
            pass

    def lowered() -> Callable[[], None]:  # the switch interval, while the thread waits to take the GIL
        default = sys.getswitchinterval()
        sys.setswitchinterval(float(switch_ms) / 1e3)
        return lambda: sys.setswitchinterval(default)

    with at_instants("gil-burner", int(float(slot_ms) * 1e6), hold, lowered if switch_ms else None) as slices:
        yield slices


@contextlib.contextmanager
def cpu_spinner(spec: str) -> Iterator[list[int]]:
    """``BUSY_MS/PERIOD_MS[/SCHED]``: a thread below training (``fr_server.yield_cpu``: SCHED ``nice``,
    niceness 19, the default, or ``idle``, SCHED_IDLE) that keeps a core busy for about BUSY_MS at every
    PERIOD_MS multiple of the wall clock without holding the GIL (one SHA-256 over a buffer sized for
    BUSY_MS, which releases it): the CPU that torch's worker server spends in the rank's process on a
    full read's dump, at the same instant on every rank, with nothing else of the agent. Empty: nothing."""
    if not spec:
        yield [0]
        return
    from hpar_agent.torch_compat import fr_server  # here: the off arm's job imports nothing of the agent

    busy_ms, period_ms, sched = [*spec.split("/"), "nice"][:3]
    probe = bytes(1 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(probe).digest()
    per_ms = (1 << 20) / max((time.perf_counter() - t0) * 1e3, 1e-3)  # bytes hashed a millisecond
    buf = bytes(int(per_ms * float(busy_ms)))

    def spin() -> None:
        fr_server.yield_cpu(threading.get_native_id(), sched)  # the thread alone, as the server's are
        hashlib.sha256(buf).digest()

    with at_instants("cpu-spinner", int(float(period_ms) * 1e6), spin) as bursts:
        yield bursts


@contextlib.contextmanager
def patched_env(env: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_inprocess(arm: str, args: list[str], env: dict[str, str]) -> None:
    """One trainer run in this process (world size 1); detaches the agent and resets Dynamo after it,
    so the next arm starts from the same state (the inductor FX-graph cache stays warm)."""
    import hpar_agent
    from hpar_trainer.train import main as train_main

    allow_dropping_components()
    allow_pacing_variants()
    with patched_env(env), maybe_profiler(arm == "profiler"):
        rc = train_main(args)
    hpar_agent.detach()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if rc:
        raise RuntimeError(f"trainer exited {rc}")


def run_torchrun(arm: str, nproc: int, args: list[str], env: dict[str, str], timeout: float) -> None:
    """One trainer run under torchrun, every rank through this script's ``--child`` wrapper (all arms
    alike, so the profiler arm differs from the others only by the profiler)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--child", "profiler" if arm == "profiler" else "plain", "--", *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    res = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode:
        raise RuntimeError(f"{arm} run failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def block_order(arms: list[str], pairs: int, warm: int) -> list[tuple[str, int]]:
    """(arm, pair) of each block: ``warm`` rounds of every arm (pair -1), then the pairs, the arm order
    rotating by one from pair to pair so that no arm always runs first."""
    order = [(arm, -1) for _ in range(warm) for arm in arms]
    for p in range(pairs):
        k = p % len(arms)
        order += [(arm, p) for arm in arms[k:] + arms[:k]]
    return order


def agent_notes(run_dir: str, rank: int = 0) -> dict[str, Any]:
    """What the agent's summary of ``rank`` says of its full reads (the reader process's mode, reads and
    CPU seconds; ``by``: the reads by reason) and of where its paced slices ran (``slices``: in the
    training thread's waits or at slots); {} without a summary."""
    path = Path(run_dir, f"summary.rank{rank}.json")
    if not path.exists():
        return {}
    coll = json.loads(path.read_text()).get("components", {}).get("collectives", {})
    return {**coll.get("reader", {}), "by": coll.get("full_reads_by", {}), "slices": coll.get("work_in_waits", {})}


def run_blocks(spec: dict[str, Any], trainer_argv: list[str]) -> int:
    """Every rank: build the trainer once, then run the blocks of ``spec``, attaching the agent (or
    starting the profiler) before an arm's block and detaching (stopping) after it. Rank 0 writes
    each block's step times to ``spec["out"]``. Step times are rank 0's wall time of ``Trainer.step``,
    as in the trainer's own record."""
    import dataclasses

    import torch.distributed as dist

    import hpar_agent
    from hpar_trainer.config import parse_args
    from hpar_trainer.train import Trainer, attach_observability, init_distributed

    pin_rank(int(os.environ.get("HPAR_BENCH_PIN", "0") or 0))
    allow_dropping_components()
    allow_pacing_variants()
    cfg = parse_args([*trainer_argv, "--no-agent"])
    device = init_distributed(cfg)
    trainer = Trainer(cfg, device)
    on_cfg = dataclasses.replace(cfg, no_agent=False)
    rank, step, blocks = dist.get_rank(), 0, []
    t_start = time.monotonic()
    until = spec.get("until")  # a reference job: "off" blocks until this file appears
    order = spec["order"] if not until else [("off", -1)] * int(spec.get("max_blocks", 100_000))
    variants = spec.get("variants") or {}
    twin = spec.get("twin")  # benchmarks.twin: a second job beside this one, block for block
    for i, (arm, pair) in enumerate(order):
        if twin:
            leader_stops = bool(twin["leader"] and spec.get("max_s") and i and pair >= 0 and pair != order[i - 1][1]
                                and time.monotonic() - t_start > spec["max_s"])
            go = [twin_gate(twin, i, leader_stops) if rank == 0 else None]
            dist.broadcast_object_list(go, src=0)  # outside the block's steps, in every arm alike
            if not go[0]:
                break
        agent_on = agent_arm(arm, variants)
        # a fresh job id a block (no stale cross-rank keys from the previous attach); a variant's
        # settings stay with its block
        env = arm_env(arm, os.path.join(spec["work"], f"agent{i}"), f"overhead-b{i}", variants) if agent_on else {}
        times, ends, cpu = [], [], []
        with patched_env(env):
            if agent_on:
                trainer.agent = attach_observability(on_cfg, trainer.modules, trainer.optimizer, trainer.mesh,
                                                     trainer.schedule)
                if trainer.agent is None:  # the trainer trains on without it: that block would measure nothing
                    raise RuntimeError("attaching the agent failed (see the log above)")
            try:
                with maybe_profiler(arm == "profiler"), gil_burner(spec.get("burn", "") if arm == "burn" else ""), \
                        cpu_spinner(spec.get("spin", "") if arm == "spin" else ""):
                    for _ in range(spec["block"]):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        trainer.step(step)
                        times.append(time.perf_counter() - t0)
                        cpu.append(time.thread_time() - c0)  # the training thread's own CPU (the hooks')
                        ends.append(time.time_ns())  # wall clock: what a reference job is matched on
                        step += 1
            finally:
                if agent_on:
                    hpar_agent.detach()
                    trainer.agent = None
        notes = agent_notes(env["HPAR_RUN_DIR"], rank) if agent_on and rank == 0 else {}  # written at detach
        blocks.append({"arm": arm, "pair": pair, "times": times, "ends": ends, "cpu": cpu, "agent": notes})
        if rank == 0 and not until:
            med = statistics.median(times[spec["block_skip"]:])
            print(f"[block {i + 1}/{len(order)}] {arm:8} pair {pair:2}: step {med * 1e3:9.3f} ms",
                  flush=True)
        if twin:
            continue
        if until:
            stop = [os.path.exists(until)]
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                break
        elif spec.get("max_s") and pair >= 0 and (i + 1 == len(order) or order[i + 1][1] != pair):
            stop = [time.monotonic() - t_start > spec["max_s"]]  # rank 0 decides: every rank stops together
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                if rank == 0:
                    print(f"--max-s {spec['max_s']:g} reached: stopping after pair {pair}", flush=True)
                break
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"blocks": blocks}))
    dist.destroy_process_group()
    return 0


def twin_gate(twin: dict[str, Any], i: int, stop: bool) -> bool:
    """Rank 0 of a twin job before its block ``i``: mark this job's arrival and wait for the other
    job's, so that both run block ``i`` over the same seconds. The leader's ``stop`` (its ``--max-s``)
    ends both jobs there. True: run the block."""
    d = Path(twin["dir"])
    if stop:
        (d / f"stop.{i}").touch()
        return False
    (d / f"{twin['me']}.{i}").touch()
    deadline = time.monotonic() + float(twin.get("timeout_s", 900))
    while not (d / f"{twin['other']}.{i}").exists():
        if (d / f"stop.{i}").exists():
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"twin job {twin['other']} did not reach block {i}")
        time.sleep(0.002)
    return True


def blocks_design(name: str, cfg: dict[str, Any], arms: list[str], a: argparse.Namespace,
                  inprocess: bool) -> dict[str, Any]:
    """Run the block design (one process) and summarize it."""
    t_start = time.time()
    work = tempfile.mkdtemp(prefix="hpar-overhead-")
    spec = {"order": block_order(arms, cfg["pairs"], a.warm), "block": cfg["block"],
            "block_skip": cfg["block_skip"], "work": work, "out": os.path.join(work, "blocks.json"),
            "max_s": a.max_s, "variants": a.variants, "burn": a.burn, "spin": a.spin}
    argv = [*cfg["args"], "--log-every", "1000000"]
    ref_blocks: list[dict[str, Any]] = []
    if inprocess:
        run_blocks(spec, argv)
    elif not a.reference:
        _torchrun_blocks(cfg["nproc"], spec, argv, a.timeout)
    else:
        halves = core_halves(sorted(os.sched_getaffinity(0)))
        ref = {**spec, "order": [], "until": os.path.join(work, "done"), "out": os.path.join(work, "ref.json"),
               "work": os.path.join(work, "ref")}  # fmt: skip
        reference = _torchrun_blocks(cfg["nproc"], ref, argv, a.timeout, cpus=halves[1], wait=False)
        try:
            _torchrun_blocks(cfg["nproc"], spec, argv, a.timeout, cpus=halves[0])
        finally:
            Path(ref["until"]).touch()
            _, err = reference.communicate(timeout=max(60.0, a.timeout / 10))
        if reference.returncode:
            raise RuntimeError(f"reference job failed (rc {reference.returncode}):\n{err[-4000:]}")
        ref_blocks = json.loads(Path(ref["out"]).read_text())["blocks"]
        print(f"reference job: {sum(len(b['times']) for b in ref_blocks)} steps on CPUs {halves[1]}; "
              f"measured job on {halves[0]}", flush=True)
    blocks = json.loads(Path(spec["out"]).read_text())["blocks"]
    runs = [{"arm": b["arm"], "pair": b["pair"], "step_s": statistics.median(b["times"][cfg["block_skip"]:])}
            for b in blocks]
    done = max((r["pair"] for r in runs), default=-1) + 1  # --max-s may stop before cfg["pairs"]
    result = report(name, cfg, done, inprocess, t_start, runs, arms)
    result.update(design="blocks", block=cfg["block"], block_skip=cfg["block_skip"], warm=a.warm, blocks=blocks)
    result["windows"] = window_ratios(blocks, arms, a.windows)
    result["p99_pooled"] = pooled_p99(blocks, arms, cfg["block_skip"])
    skip = cfg["block_skip"]  # rank 0's training thread's CPU per step, arm over off (the hooks' own cost)
    result["train_cpu"] = summarize([{"arm": b["arm"], "pair": b["pair"], "step_s": statistics.median(b["cpu"][skip:])}
                                     for b in blocks if b.get("cpu")], arms)  # fmt: skip
    result["agent"] = agent_totals(blocks)
    if ref_blocks:
        result["referenced"] = referenced_ratios(blocks, ref_blocks, arms, cfg["block_skip"])
        result["reference_blocks"] = ref_blocks
    return result


def agent_totals(blocks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per agent arm, rank 0's notes over its blocks added up: the paced slices' parks that ended in a
    wait of the training thread or at a slot, and the full reads by reason (whether a variant did what
    it was meant to, on the device)."""
    out: dict[str, dict[str, Any]] = {}
    for b in blocks:
        notes = b.get("agent") or {}
        if not notes:
            continue
        tot = out.setdefault(b["arm"], {"blocks": 0, "in_wait": 0, "at_slot": 0, "reads": {}})
        tot["blocks"] += 1
        for k in ("in_wait", "at_slot"):
            tot[k] += int(notes.get("slices", {}).get(k, 0))
        for reason, n in notes.get("by", {}).items():
            tot["reads"][reason] = tot["reads"].get(reason, 0) + int(n)
    return out


def agent_lines(totals: dict[str, dict[str, Any]]) -> list[str]:
    """``agent_totals`` as one line an arm."""
    return [f"{arm:10} rank 0 over {t['blocks']} blocks: slices parked into a wait {t['in_wait']}, at a slot "
            f"{t['at_slot']}; full reads {dict(sorted(t['reads'].items()))}" for arm, t in totals.items()]


def _torchrun_blocks(nproc: int, spec: dict[str, Any], argv: list[str], timeout: float,
                     cpus: list[int] | None = None, wait: bool = True) -> subprocess.Popen[str]:
    """The blocks of ``spec`` under torchrun (every rank through ``--child-blocks``), on ``cpus`` when
    given (every rank and thread inherits them); ``wait=False`` returns the running job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--child-blocks", json.dumps(spec), "--", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, env=env, stdout=None, stderr=subprocess.PIPE, text=True, preexec_fn=pin)
    if not wait:
        return proc
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"block run failed (rc {proc.returncode}):\n{err[-4000:]}")
    return proc


def pooled_p99(blocks: list[dict[str, Any]], arms: list[str], skip: int) -> dict[str, dict[str, float]]:
    """Per arm: the p99 of every kept step of its paired blocks, and its ratio to off's (a block holds
    too few steps for a p99 of its own)."""
    kept: dict[str, list[float]] = {}
    for b in blocks:
        if b["pair"] >= 0:
            kept.setdefault(b["arm"], []).extend(b["times"][skip:])
    if not kept.get("off"):
        return {}
    off = p99(kept["off"])
    return {arm: {"p99_s": p99(kept[arm]), "ratio": p99(kept[arm]) / off, "steps": len(kept[arm])}
            for arm in arms if kept.get(arm)}  # fmt: skip


def _siblings(cpu: int) -> str:
    """The hyperthread siblings of ``cpu`` as sysfs lists them (the CPU itself where it cannot say)."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return str(cpu)


def core_halves(cpus: list[int], siblings: Callable[[int], str] = _siblings) -> tuple[list[int], list[int]]:
    """The CPUs split in two by physical core (hyperthread siblings stay together), so that two jobs
    side by side share no core; the first half gets the odd core out."""
    groups: dict[str, list[int]] = {}
    for c in cpus:
        groups.setdefault(siblings(c), []).append(c)
    cores = sorted(groups.values())
    if len(cores) < 2:
        raise SystemExit("--reference needs at least two physical cores")
    cut = (len(cores) + 1) // 2
    return sorted(c for g in cores[:cut] for c in g), sorted(c for g in cores[cut:] for c in g)


def referenced_ratios(blocks: list[dict[str, Any]], ref_blocks: list[dict[str, Any]], arms: list[str],
                      skip: int) -> dict[str, Any]:
    """Every arm's ratio to off with each block's median step divided by the reference job's median
    step over the same stretch of wall clock: a slowdown of the whole machine (a neighbour, the clocks)
    falls on both jobs and cancels; the on/off contrast stays within the measured job. Blocks without
    two reference steps in their stretch are left out."""
    ref_ends: list[int] = []
    ref_steps: list[float] = []
    for b in ref_blocks:
        ref_ends.extend(b["ends"])
        ref_steps.extend(b["times"])
    runs = []
    for b in blocks:
        kept = b["ends"][skip:]
        if not kept:
            continue
        lo, hi = kept[0] - int(b["times"][skip] * 1e9), kept[-1]
        same = [t for e, t in zip(ref_ends, ref_steps, strict=True) if lo <= e <= hi]
        if len(same) >= 2:
            runs.append({"arm": b["arm"], "pair": b["pair"],
                         "step_s": statistics.median(b["times"][skip:]) / statistics.median(same)})
    return summarize(runs, arms)


def window_ratios(blocks: list[dict[str, Any]], arms: list[str], windows: list[tuple[int, int]]) -> dict[str, Any]:
    """Per ``(first, end)`` step window of a block: every arm's ratio to off, pair by pair, on the
    medians of those steps alone. Where an attach costs the first steps after it (a fresh agent: its
    threads, reader process, first full read and exchange), the early window shows it and a late one
    shows what a run attached once pays from then on."""
    out: dict[str, Any] = {}
    for first, end in windows:
        runs = [{"arm": b["arm"], "pair": b["pair"], "step_s": statistics.median(b["times"][first:end])}
                for b in blocks if len(b["times"][first:end]) > 0]
        out[f"{first}:{end}"] = summarize(runs, arms)
    return out


def step_times(out: str, skip: int) -> list[float]:
    times = json.loads(Path(out).read_text())["step_times"]
    if len(times) <= skip:
        raise RuntimeError(f"{out}: only {len(times)} steps, need more than --skip {skip}")
    return list(times[skip:])


def step_time(out: str, skip: int) -> float:
    return statistics.median(step_times(out, skip))


def full_collections(gcw: Any) -> list[tuple[float, float]]:
    """(wall-clock start, seconds) of each generation-2 collection ``gcw`` saw: what a run's long
    step may hold (a separate process's full collection falls on a step of its own timing)."""
    offset = time.time() - time.perf_counter()
    return [(b + offset, e - b) for b, e, g in gcw.pauses if g == 2]


def step_events(out: str, skip: int, med: float) -> dict[str, Any]:
    """A run's every step time (ms), its kept steps over 1.5x their median ``med`` and the full
    collections by the step they started in (index, ms): where a separate run's tail comes from."""
    rec = json.loads(Path(out).read_text())
    times, starts = rec["step_times"], rec.get("step_starts") or []
    gc_path = Path(out + ".gc.json")
    full = json.loads(gc_path.read_text()) if gc_path.exists() else []
    by_step = [(bisect.bisect(starts, t0) - 1, du * 1e3) for t0, du in full] if starts else []
    return {"steps_ms": [round(t * 1e3, 2) for t in times],
            "long": [(i, round(t * 1e3, 1)) for i, t in enumerate(times) if i >= skip and t > 1.5 * med],
            "gc2": [(i, round(ms, 1)) for i, ms in by_step]}


def p99(values: list[float]) -> float:
    """The 99th percentile, ``statistics.quantiles`` inclusive method: linear interpolation between the
    two order statistics around position 0.99 * (n - 1) (0-based), so never above the maximum."""
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval of the median from order statistics: ``(x_(k), x_(n+1-k), coverage)``
    for the largest k whose coverage ``1 - 2 P(Binom(n, 1/2) <= k-1)`` is at least ``level``. With too
    few values (n <= 5 at 95 %) even [min, max] falls short: it is returned with its actual coverage,
    which the caller must report (a bootstrap over 3-9 values claims 95 % and covers 75-96 %)."""
    n = len(values)
    if n < 2:
        return (float("nan"), float("nan"), float("nan"))
    xs = sorted(values)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def ratio_stats(ratios: list[float]) -> dict[str, float]:
    """Median with its order-statistic interval and that interval's coverage, mean with its standard
    error, min and max of the per-pair ratios."""
    sem = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    lo, hi, cov = median_interval(ratios)
    return {"median": statistics.median(ratios), "ci_lo": lo, "ci_hi": hi, "ci_coverage": cov,
            "mean": statistics.fmean(ratios), "sem": sem, "min": min(ratios), "max": max(ratios)}


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, dict[str, Any]]:
    """Per arm: median / min / max over pairs of (arm step time / off step time of the same pair)."""
    by_pair: dict[int, dict[str, float]] = {}
    p99_pair: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["pair"] >= 0:
            by_pair.setdefault(r["pair"], {})[r["arm"]] = r["step_s"]
            if "p99_s" in r:
                p99_pair.setdefault(r["pair"], {})[r["arm"]] = r["p99_s"]
    out = {}
    for arm in arms:
        if arm == "off":
            continue
        ratios = [p[arm] / p["off"] for p in by_pair.values() if arm in p and "off" in p]
        if ratios:
            out[arm] = {**ratio_stats(ratios), "pairs": len(ratios), "ratios": ratios}
            p99s = [p[arm] / p["off"] for p in p99_pair.values() if arm in p and "off" in p]
            if p99s:
                out[arm]["p99_ratio_median"] = statistics.median(p99s)
    return out


class PairBudget:
    """``--max-s`` for a design that runs pair after pair: no pair starts that would end past it at the
    pace of the slowest pair so far (a device call's limit is hard; one that cuts a run loses its
    summary)."""

    def __init__(self, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s, self.clock = max_s, clock
        self.t0 = clock()  # the budget counts from here (warm-up included)
        self.pair_t0: float | None = None
        self.slowest = 0.0

    def pair_starts(self) -> bool:
        """A pair is about to start: whether it may (the first one always does)."""
        t = self.clock()
        if self.pair_t0 is not None:
            self.slowest = max(self.slowest, t - self.pair_t0)
            if self.max_s and t - self.t0 + self.slowest > self.max_s:
                print(f"--max-s {self.max_s:g}: another pair ({self.slowest:.0f} s) would end past it; stopping",
                      flush=True)
                return False
        self.pair_t0 = t
        return True


def runs_design(name: str, cfg: dict[str, Any], arms: list[str], a: argparse.Namespace,
                inprocess: bool) -> dict[str, Any]:
    """One trainer process per arm and pair, after a warm-up run that fills the caches."""
    work = tempfile.mkdtemp(prefix="hpar-overhead-")
    runs: list[dict[str, Any]] = []
    t_start = time.time()
    # the arms' order rotates from pair to pair: a drift of the machine (clocks, a neighbour) within
    # a pair falls on every arm in turn, not always on the one that runs last
    schedule = [("on", -1)] + [(arm, p) for p in range(cfg["pairs"])
                               for arm in arms[p % len(arms):] + arms[:p % len(arms)]]
    budget = PairBudget(a.max_s)
    for i, (arm, pair) in enumerate(schedule):
        if pair >= 0 and pair != schedule[i - 1][1] and not budget.pair_starts():
            break
        out = os.path.join(work, f"run{i}-{arm}.json")
        env = arm_env(arm, os.path.join(work, f"agent{i}"), f"overhead-{i}", a.variants)
        args = trainer_args(cfg, arm, out, a.variants)
        t0 = time.perf_counter()
        if inprocess:
            run_inprocess(arm, args, env)
        else:
            run_torchrun(arm, cfg["nproc"], args, env, a.timeout)
        times = step_times(out, cfg["skip"])
        st = statistics.median(times)
        ev = step_events(out, cfg["skip"], st)
        runs.append({"arm": arm, "pair": pair, "step_s": st, "p99_s": p99(times), "wall_s": time.perf_counter() - t0,
                     **ev})
        print(f"[{i + 1}/{len(schedule)}] {arm:8} pair {pair:2}: step {st * 1e3:9.2f} ms "
              f"(run {time.perf_counter() - t0:5.1f} s); long steps {ev['long']}, full collections "
              f"{[c for c in ev['gc2'] if c[1] >= 5]}", flush=True)
        done = len({r["pair"] for r in runs if r["pair"] >= 0})
        result = report(name, cfg, done, inprocess, t_start, runs, arms)
        result["design"] = "runs"
        if a.json:  # after every run: a run cut short by a time limit still leaves its figures
            Path(a.json).write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--cpu-smoke", action="store_true", help="gpu config's in-process path on CPU, tiny model")
    ap.add_argument("--design", choices=("blocks", "runs"), default="blocks")
    ap.add_argument("--pairs", type=int, default=0, help="interleaved pairs after warm-up (default per config)")
    ap.add_argument("--block", type=int, default=0, help="blocks: steps per block (default per config)")
    ap.add_argument("--block-skip", type=int, default=-1, help="blocks: steps left out of a block's median")
    ap.add_argument("--max-s", type=float, default=0.0,
                    help="blocks: stop after the pair that ends past this many seconds of blocks; runs: before a "
                         "pair that would end past them (0: all pairs)")
    ap.add_argument("--windows", default="", metavar="A:B,...",
                    help="blocks: also report the ratios on steps A..B-1 of each block alone (the attach transient)")
    ap.add_argument("--reference", action="store_true",
                    help="blocks under torchrun: a second job of off blocks beside the measured one, on the other "
                         "half of the cores; each block is divided by the reference's steps of the same seconds")
    ap.add_argument("--burn", default="", metavar="HOLD_MS/SLOT_MS[/SWITCH_MS]",
                    help="blocks: an arm without the agent whose every rank holds the GIL HOLD_MS at each SLOT_MS "
                         "of the wall clock (the agent's slices alone)")
    ap.add_argument("--spin", default="", metavar="BUSY_MS/PERIOD_MS[/SCHED]",
                    help="blocks: an arm without the agent whose every rank keeps a core busy off the GIL, below "
                         "training (SCHED nice: niceness 19, the default; idle: SCHED_IDLE), BUSY_MS at each "
                         "PERIOD_MS of the wall clock (the full reads' dumps alone)")
    ap.add_argument("--warm", type=int, default=2, help="blocks: warm-up rounds of every arm")
    ap.add_argument("--steps", type=int, default=0, help="runs: trainer steps per run (default per config)")
    ap.add_argument("--skip", type=int, default=-1, help="runs: steps left out of a run's median")
    ap.add_argument("--no-profiler", action="store_true", help="leave the torch.profiler arm out")
    ap.add_argument("--aa", action="store_true", help="add an A/A control arm (no agent, like off)")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default per config; > 1 runs under torchrun)")
    ap.add_argument("--extra", default="", help="more trainer arguments (later ones win), e.g. '--dp 2 --tp 2 --pp 2'")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per torchrun process")
    ap.add_argument("--in-process", action="store_true", help="runs at world size 1: reuse this process")
    ap.add_argument("--pin", type=int, default=0, help="torchrun ranks: each on its own N CPUs (0: unpinned)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...",
                    help="an arm running the agent with these settings over its defaults (repeatable)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    a.variants = parse_variants(a.variant)
    a.windows = parse_windows(a.windows)
    os.environ["HPAR_BENCH_PIN"] = str(a.pin)  # read by every torchrun child (pin_rank)
    name = "cpu-smoke" if a.cpu_smoke else a.config
    cfg = resolve_config(name, a)
    # runs design: one fresh process per run by default (what users get); --in-process reuses this one
    inprocess = cfg["nproc"] == 1 and (a.design == "blocks" or a.in_process)
    if name == "gpu" and not torch.cuda.is_available():
        sys.exit("--config gpu needs a GPU (use --cpu-smoke to test the path on CPU)")
    arms = ["off", "on"] + ([] if a.no_profiler else ["profiler"]) + (["aa"] if a.aa else []) + list(a.variants)
    if (a.burn or a.spin) and a.design != "blocks":
        sys.exit("--burn and --spin are arms of the blocks design")
    arms += (["burn"] if a.burn else []) + (["spin"] if a.spin else [])
    if name == "gpu" and a.design == "runs" and cfg["nproc"] > 1:  # one rank has no collective to time
        arms.append("nccl")
    if a.design == "blocks":
        result = blocks_design(name, cfg, arms, a, inprocess)
    else:
        result = runs_design(name, cfg, arms, a, inprocess)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"\nconfig {name}, design {result['design']} ({result['mode']}, {cfg['nproc']} rank(s), torch "
          f"{torch.__version__}, {result['device']}); off step time median {result['off_step_s_median'] * 1e3:.3f} ms")
    print(f"{'arm':10} {'ratio vs off (median)':>22} {'interval (coverage)':>24} {'mean':>8} {'+-sem':>8} {'min':>8} "
          f"{'max':>8} {'p99 ratio':>9} {'pairs':>6}")
    for arm, st in result["ratios"].items():
        print(f"{arm:10} {st['median']:22.4f} {st['ci_lo']:8.4f}-{st['ci_hi']:.4f} ({st['ci_coverage']:5.1%}) {st['mean']:8.4f} "
              f"{st['sem']:8.4f} {st['min']:8.4f} {st['max']:8.4f} {st.get('p99_ratio_median', float('nan')):9.4f} "
              f"{st['pairs']:6d}")
    for arm, st in result.get("p99_pooled", {}).items():
        print(f"  p99 of all kept steps {arm:10} {st['p99_s'] * 1e3:9.3f} ms, ratio to off {st['ratio']:.4f} "
              f"({st['steps']} steps)")
    for arm, st in result.get("train_cpu", {}).items():
        print(f"  training thread's CPU per step {arm:10} {st['median']:8.4f} {st['ci_lo']:8.4f}-{st['ci_hi']:.4f} "
              f"({st['ci_coverage']:5.1%}) mean {st['mean']:.4f} +- {st['sem']:.4f}, {st['pairs']} pairs")
    for arm, st in result.get("referenced", {}).items():
        print(f"  referenced {arm:10} {st['median']:8.4f} {st['ci_lo']:8.4f}-{st['ci_hi']:.4f} "
              f"({st['ci_coverage']:5.1%}) mean {st['mean']:.4f} +- {st['sem']:.4f}, {st['pairs']} pairs")
    for win, by_arm in result.get("windows", {}).items():
        for arm, st in by_arm.items():
            print(f"  steps {win:>7} {arm:10} {st['median']:8.4f} {st['ci_lo']:8.4f}-{st['ci_hi']:.4f} "
                  f"({st['ci_coverage']:5.1%}) mean {st['mean']:.4f} +- {st['sem']:.4f}, {st['pairs']} pairs")
    for ln in agent_lines(result.get("agent", {})):
        print("  agent " + ln)
    return 0


def resolve_config(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """``CONFIGS[name]`` with the command line's overrides: ``--extra`` trainer arguments, and each of
    pairs, block, steps, nproc (when > 0) and block_skip, skip (when >= 0)."""
    cfg = dict(CONFIGS[name])
    cfg["args"] = [*cfg["args"], *shlex.split(a.extra)]
    for key in ("pairs", "block", "steps", "nproc"):
        if getattr(a, key) > 0:
            cfg[key] = getattr(a, key)
    for key in ("block_skip", "skip"):
        if getattr(a, key) >= 0:
            cfg[key] = getattr(a, key)
    return cfg


def parse_windows(spec: str) -> list[tuple[int, int]]:
    """``"3:15,15:60"`` -> ``[(3, 15), (15, 60)]``."""
    out = []
    for tok in filter(None, spec.split(",")):
        first, sep, end = tok.partition(":")
        if not sep or not first.isdigit() or not end.isdigit() or int(first) >= int(end):
            raise SystemExit(f"--windows {tok!r}: expected A:B with A < B")
        out.append((int(first), int(end)))
    return out


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``["nopass:HPAR_INTERVAL=3600,HPAR_FR_INTERVAL=86400"]`` -> ``{"nopass": {...}}``."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, kvs = spec.partition(":")
        if not name or name in ("off", "on", "profiler", "aa", "nccl", "burn", "spin") or not kvs:
            raise SystemExit(f"--variant {spec!r}: expected NAME:K=V,... with a new arm name")
        env: dict[str, str] = {}
        key = ""
        for tok in kvs.split(","):  # a token without "=" continues the previous value (a list)
            if "=" in tok:
                key, _, val = tok.partition("=")
                env[key] = val
            elif key:
                env[key] += "," + tok
        out[name] = env
    return out


def report(name: str, cfg: dict[str, Any], pairs: int, inprocess: bool, t_start: float,
           runs: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """The JSON result: configuration, environment, per-arm ratios and every run."""
    ratios = summarize(runs, arms)
    off = [r["step_s"] for r in runs if r["arm"] == "off"]
    return {
        "config": name, "trainer_args": cfg["args"], "steps": cfg["steps"], "skip": cfg["skip"],
        "nproc": cfg["nproc"], "mode": "in-process" if inprocess else "torchrun", "pairs": pairs,
        "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d", time.gmtime(t_start)),
        "wall_s": time.time() - t_start, "off_step_s_median": statistics.median(off) if off else None,
        "ratios": ratios, "runs": runs,
    }  # fmt: skip


def pin_rank(n: int) -> None:
    """``--pin N``: this rank (every thread it starts later too) on its own N CPUs, local rank r on
    the r-th N of the allowed ones, when there are enough. Every arm alike: which cores a rank lands
    on, and whether ranks share them, moved CPU step times by 30 % between unpinned runs."""
    if n <= 0:
        return
    cpus = sorted(os.sched_getaffinity(0))
    r = int(os.environ.get("LOCAL_RANK", "0"))
    mine = cpus[r * n:(r + 1) * n]
    if len(mine) == n:
        os.sched_setaffinity(0, mine)


def allow_dropping_components() -> None:
    """Ablations: ``HPAR_BENCH_DROP=anatomy,pipeline`` (a variant's setting, read at each attach)
    leaves those components out of what ``attach()`` installs; ``HPAR_BENCH_RENICE=0`` leaves the
    worker server's threads, which build the full flight-recorder dumps, at the training process's
    priority (the reader process still yields, ``HPAR_HELPER_SCHED``). Benchmark-only: the agent has no such
    settings (every component is meant to be on, its helpers below training)."""
    import hpar_agent.agent as agent_mod
    from hpar_agent.torch_compat import fr_server

    full = agent_mod.default_components
    if getattr(full, "_bench_drop", False):
        return
    renice = fr_server.DumpServer.renice

    def maybe_renice(server: Any) -> None:
        if os.environ.get("HPAR_BENCH_RENICE") != "0":
            renice(server)

    fr_server.DumpServer.renice = maybe_renice  # type: ignore[method-assign]

    def chosen(config: Any) -> list[Any]:
        drop = set(filter(None, os.environ.get("HPAR_BENCH_DROP", "").split(",")))
        return [c for c in full(config) if c.name not in drop]

    chosen._bench_drop = True  # type: ignore[attr-defined]
    agent_mod.default_components = chosen  # type: ignore[assignment]


def allow_pacing_variants() -> None:
    """Ablations: ``HPAR_BENCH_PACE=HOLD_MS/SLOT_MS`` (a variant's setting, read at each pass) paces
    the agent's passes in HOLD_MS slices of the GIL, one per SLOT_MS of wall clock (defaults
    ``gil.HOLD_NS``, ``gil.SLOT_NS``: 1/100); ``SLOT_MS`` 0 runs each pass unpaced, handing the GIL back
    every HOLD_MS. ``HPAR_BENCH_SWITCH=MS`` sets the interpreter's switch interval to MS while a pass
    waits to take the GIL back after a hand-back (5 ms by default: a training thread in pure Python
    keeps the GIL that long, so a rank's slice can start that late after the shared instant and stop
    overlapping the other ranks'; ``benchmarks/gil_wake``: 5.3 ms against pure Python, 0.37 ms with a
    0.1 ms interval, but 0.33 ms median and 1.0 ms p90 against DTensor ops either way). Benchmark-only:
    which slicing costs the job least is what this measures."""
    import hpar_agent.agent as agent_mod
    from hpar_agent import gil

    tick = agent_mod.Agent.tick
    if getattr(tick, "_bench_pace", False):
        return
    defaults = gil.Yielder.__init__.__defaults__

    hand_back = gil.Yielder.__call__

    def hand_back_fast(y: Any) -> None:  # the switch interval lowered while waiting to get the GIL back
        if time.perf_counter_ns() - y.since < y.hold_ns:
            return
        old = sys.getswitchinterval()
        sys.setswitchinterval(float(os.environ.get("HPAR_BENCH_SWITCH", "5")) / 1e3)
        try:
            hand_back(y)
        finally:
            sys.setswitchinterval(old)

    def paced_tick(self: Any, final: bool = False, paced: bool = False) -> None:
        spec = os.environ.get("HPAR_BENCH_PACE", "")
        gil.Yielder.__init__.__defaults__ = defaults
        gil.Yielder.__call__ = hand_back_fast if os.environ.get("HPAR_BENCH_SWITCH") else hand_back  # type: ignore[method-assign]
        if spec:
            hold, slot = (int(float(v) * 1e6) for v in spec.split("/"))
            gil.Yielder.__init__.__defaults__ = (hold, 0, slot or gil.SLOT_NS, None, None, None)
            paced = paced and slot > 0
        tick(self, final, paced)

    paced_tick._bench_pace = True  # type: ignore[attr-defined]
    agent_mod.Agent.tick = paced_tick  # type: ignore[method-assign]


def child(argv: list[str]) -> int:
    """torchrun entry of every rank: the trainer, optionally inside torch.profiler."""
    mode, rest = argv[0], argv[2:] if len(argv) > 1 and argv[1] == "--" else argv[1:]
    from hpar_trainer.train import main as train_main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file as a script
    from benchmarks.common import GcWatch

    pin_rank(int(os.environ.get("HPAR_BENCH_PIN", "0") or 0))
    allow_dropping_components()
    allow_pacing_variants()

    with GcWatch() as gcw, maybe_profiler(mode == "profiler"):
        rc = train_main(rest)
    out = rest[rest.index("--out") + 1] if "--out" in rest else ""
    if out and os.environ.get("RANK", "0") == "0":  # beside rank 0's step record: its full collections
        Path(out + ".gc.json").write_text(json.dumps(full_collections(gcw)))
    return rc


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    if len(sys.argv) > 2 and sys.argv[1] == "--child-blocks":
        sys.exit(run_blocks(json.loads(sys.argv[2]), sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]))
    sys.exit(main())
