"""The agent's training-step overhead: step time with the agent against without, side by side.

Designs (``--design``), each interleaving its arms so that a drift of the machine falls on all alike:
  blocks  ONE trainer process (torchrun ranks, or in-process at world size 1) runs ``--block``-step
          blocks, attaching the agent (or starting torch.profiler) before an arm's block and detaching
          after it. A block's step time is the median after its first ``--block-skip`` steps; ``--warm``
          rounds of every arm come first (compile, caches). One process means one compile, one memory
          layout and one set of caches: the spread of separate processes (5-7 % on one GPU) would swamp
          a sub-percent cost.
  runs    one fresh process per run, the agent attached before the first step: what users get, start-up
          included. ``--warm`` short runs first fill the inductor caches (one ``TORCHINDUCTOR_CACHE_DIR``
          for every run), so a run loads its compiled graphs instead of compiling them.
  --twin  (with blocks or runs, torchrun configurations) two copies of the job side by side, one on each
          half of the cores, arm X on one half and off on the other, then swapped: a pair's estimate is
          sqrt(X_A / off_B * X_B / off_A). The halves' speeds cancel in the product and the machine's
          swings in each ratio (on a CPU host two such jobs' block medians correlate ~0.9).
A pair is a block or run of every arm, the order reversing from pair to pair (off on, on off, ...):
each pair boundary runs one arm twice in a row, and those adjacent blocks or runs are the A/A at no
cost of their own (n pairs give n - 1 A/A ratios). Twin pairs have an ``aa`` arm (no agent) instead.

Configurations (``--config``):
  cpu        4 gloo ranks under torchrun: dp1 x tp2 x pp2, 1F1B, aot_eager, a small model (~70-80 ms steps)
  gpu        one GPU: inductor, bf16, 12 layers of dim 2048, 8 x 1024 tokens (~50-85 ms steps)
  short-cpu  short steps as a new user meets them: ``tiny_gpt.py`` (a nanoGPT-style loop on one CPU
             thread, ~10-12 ms steps, timed by the script itself) run as ``python tiny_gpt.py`` against
             ``hpar-agent run -- python tiny_gpt.py`` (runs, the default), or in one process with
             ``attach(model, optimizer=opt)`` before an agent block (``--design blocks``)
  short-gpu  the same on one GPU (sized for ~10 ms steps on an H100)
``--cpu-smoke`` runs the gpu configuration's path on CPU with a tiny model, to test this script.

Arms: ``off``; ``on`` (the agent at its defaults; local trace files, metrics on an ephemeral port);
``--profiler`` (torch.profiler, CPU and CUDA activities); ``nccl`` (runs on several GPUs:
``TORCH_NCCL_ENABLE_TIMING=1`` without the agent); ``--variant NAME:K=V,...`` (the agent with these
settings, e.g. ``slow:HPAR_INTERVAL=5``).

Printed per arm: the median over pairs of arm / off with its order-statistic interval and that
interval's exact coverage (95 % needs 6 pairs or more), mean +- sem, min and max; the p99 of every kept
step over off's, with an interval from resampling the pairs (one pair's stall can carry a p99); runs:
the pairs' own p99 ratios; blocks: rank 0's training-thread CPU per step over off's (the hooks' cost).
``--merge`` pools the pairs of several results of one design (each pair's ratio stays within its own).

    python -m benchmarks.overhead --config gpu --design blocks --pairs 200 --max-s 380 --json blocks.json
    python -m benchmarks.overhead --config gpu --design runs --pairs 14 --max-s 450 --json runs.json
    python -m benchmarks.overhead --config short-gpu --pairs 16 --max-s 420 --json short.json
    python -m benchmarks.overhead --config short-gpu --design blocks --pairs 200 --max-s 380 --json short-blocks.json
    python -m benchmarks.overhead --config cpu --twin --block 60 --max-s 400 --json twin.json
    python -m benchmarks.overhead --merge runs-1.json runs-2.json --json runs.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    HALVES,
    PairBudget,
    adjacent_aa,
    common_seconds,
    core_halves,
    p99,
    paired,
    patched_env,
    pooled_p99_report,
    ratio_stats,
    slot_order,
    stats_line,
    twin_estimates,
    twin_gate,
)
from hpar_agent.tools.launch import torchrun_cmd

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = Path(__file__).resolve().parent / "tiny_gpt.py"
#: ``block_skip`` of gpu: the first second after an attach (12 steps of ~84 ms) holds the agent's
#: start-up and first pass, which a job pays once, when it attaches: the blocks keep the steady state.
CONFIGS: dict[str, dict[str, Any]] = {
    "cpu": {
        "nproc": 4,
        "steps": 16,
        "skip": 4,
        "block": 20,
        "block_skip": 3,
        "pairs": 10,
        "args": (
            "--dp 1 --tp 2 --pp 2 --schedule 1f1b --compile aot_eager --layers 4 "
            "--dim 64 --heads 4 --seq-len 32 --global-batch 16 --device cpu"
        ).split(),
    },
    "gpu": {
        "nproc": 1,
        "steps": 40,
        "skip": 10,
        "block": 30,
        "block_skip": 12,
        "pairs": 15,
        "args": (
            "--compile inductor --dtype bf16 --layers 12 --dim 2048 --heads 16 "
            "--seq-len 1024 --global-batch 8 --vocab 8192 --lr 3e-4 --device cuda"
        ).split(),
    },
    "cpu-smoke": {
        "nproc": 1,
        "steps": 8,
        "skip": 3,
        "block": 6,
        "block_skip": 2,
        "pairs": 3,
        "args": (
            "--compile aot_eager --layers 2 --dim 64 --heads 4 --seq-len 32 --global-batch 8 --device cpu"
        ).split(),
    },
    "short-cpu": {
        "nproc": 1,
        "steps": 400,
        "skip": 50,
        "block": 300,
        "block_skip": 30,
        "pairs": 20,
        "workload": "tiny_gpt",
        "args": ["--preset", "cpu"],
    },
    "short-gpu": {
        "nproc": 1,
        "steps": 600,
        "skip": 50,
        "block": 300,
        "block_skip": 30,
        "pairs": 16,
        "workload": "tiny_gpt",
        "args": ["--preset", "gpu"],
    },
}
FIXED_ARMS = ("off", "on", "aa", "profiler", "nccl")
#: The inductor caches every run of the runs design shares (TORCHINDUCTOR_CACHE_DIR): the warm-up run
#: compiles, the others load the FX graphs and AOT-autograd graphs it saved.
INDUCTOR_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


# ------------------------------------------------------------------------------------------------ arms
def agent_arm(arm: str, variants: dict[str, dict[str, str]]) -> bool:
    """Whether the arm runs the agent: ``on`` and every ``--variant``."""
    return arm == "on" or arm in variants


def arm_env(arm: str, run_dir: str, job: str, variants: dict[str, dict[str, str]]) -> dict[str, str]:
    """Environment of one arm: the agent's defaults but where its files go (and a variant's settings)."""
    env: dict[str, str] = {}
    if agent_arm(arm, variants):
        env.update(HPAR_RUN_DIR=run_dir, HPAR_JOB_ID=job, HPAR_TRACES="file", HPAR_METRICS_PORT="0")
        env.update(variants.get(arm, {}))
    if arm == "nccl":
        env["TORCH_NCCL_ENABLE_TIMING"] = "1"
    return env


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``["slow:HPAR_INTERVAL=5,HPAR_FR_INTERVAL=30"]`` -> ``{"slow": {...}}``; a token without ``=``
    continues the previous value (a list)."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, kvs = spec.partition(":")
        if not name or name in FIXED_ARMS or not kvs:
            raise SystemExit(f"--variant {spec!r}: expected NAME:K=V,... with a new arm name")
        env: dict[str, str] = {}
        key = ""
        for tok in kvs.split(","):
            if "=" in tok:
                key, _, val = tok.partition("=")
                env[key] = val
            elif key:
                env[key] += "," + tok
        out[name] = env
    return out


def maybe_profiler(on: bool) -> contextlib.AbstractContextManager[Any]:
    """torch.profiler as users run it: CPU activities, plus CUDA when a GPU is present."""
    acts = [torch.profiler.ProfilerActivity.CPU] + [
        torch.profiler.ProfilerActivity.CUDA
    ] * torch.cuda.is_available()
    return torch.profiler.profile(activities=acts) if on else contextlib.nullcontext()


def run_cmd(cfg: dict[str, Any], arm: str, out: str, variants: dict[str, dict[str, str]]) -> list[str]:
    """The command of one fresh run of ``arm``: the trainer through this module's ``--child`` (under
    torchrun with several ranks), or tiny_gpt.py, wrapped in ``hpar-agent run`` for an agent arm."""
    on = agent_arm(arm, variants)
    py = sys.executable
    if cfg.get("workload") == "tiny_gpt":
        cmd = [py, str(TINY_GPT), *cfg["args"], "--steps", str(cfg["steps"]), "--out", out]
        return [py, "-m", "hpar_agent", "run", "--", *cmd] if on else cmd
    args = [*cfg["args"], "--steps", str(cfg["steps"]), "--log-every", "100000", "--out", out]
    child = [
        "-m",
        "benchmarks.overhead",
        "--child",
        "profiler" if arm == "profiler" else "plain",
        "--",
        *args,
        *([] if on else ["--no-agent"]),
    ]
    if cfg["nproc"] > 1:
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg['nproc']}", *child]
    return [py, *child]


def child(argv: list[str]) -> int:
    """A fresh run's process (every rank of it): the trainer, optionally inside torch.profiler."""
    from hpar_trainer.train import main as train_main

    mode, rest = argv[0], argv[2:] if argv[1:2] == ["--"] else argv[1:]
    with maybe_profiler(mode == "profiler"):
        return train_main(rest)


# ------------------------------------------------------------------------------------------------ blocks
def block_order(arms: list[str], pairs: int, warm: int) -> list[tuple[str, int]]:
    """(arm, pair) of each block: ``warm`` rounds of every arm (pair -1), then the pairs in the runs
    design's order (``run_order``: forward, then reversed)."""
    return [(arm, -1) for _ in range(warm) for arm in arms] + run_order(arms, pairs)


def run_blocks(spec: dict[str, Any], trainer_argv: list[str]) -> int:
    """Every rank: build the trainer once, then run the blocks of ``spec``, attaching the agent (or
    starting the profiler) before an arm's block and detaching after it. Rank 0 writes each block's
    step times (its wall time of ``Trainer.step``) and its training thread's CPU per step."""
    import torch.distributed as dist

    import hpar_agent
    from hpar_trainer.config import parse_args
    from hpar_trainer.train import Trainer, attach_observability, init_distributed

    cfg = parse_args([*trainer_argv, "--no-agent"])
    trainer = Trainer(cfg, init_distributed(cfg))
    on_cfg = dataclasses.replace(cfg, no_agent=False)
    rank, step, blocks, t_start = dist.get_rank(), 0, [], time.monotonic()
    order, variants, twin = spec["order"], spec["variants"], spec.get("twin")
    for i, (arm, pair) in enumerate(order):
        new_pair = i + 1 == len(order) or order[i + 1][1] != pair
        if twin:  # both jobs start block i together; the leader's --max-s ends both at a pair boundary
            stop = bool(
                twin["leader"]
                and spec["max_s"]
                and i
                and pair >= 0
                and pair != order[i - 1][1]
                and time.monotonic() - t_start > spec["max_s"]
            )
            go = [twin_gate(twin, i, stop) if rank == 0 else None]
            dist.broadcast_object_list(go, src=0)  # outside the block's steps, in every arm alike
            if not go[0]:
                break
        on = agent_arm(arm, variants)
        env = arm_env(arm, os.path.join(spec["work"], f"agent{i}"), f"overhead-b{i}", variants) if on else {}
        with patched_env(env):  # a fresh job id a block: no stale cross-rank keys from the last attach
            if on:
                trainer.agent = attach_observability(
                    on_cfg, trainer.modules, trainer.optimizer, trainer.mesh, trainer.schedule
                )
                if trainer.agent is None:
                    raise RuntimeError("attaching the agent failed (see the log above)")
            try:
                with maybe_profiler(arm == "profiler"):
                    times, cpu = time_steps(trainer.step, step, spec["block"])
                    step += spec["block"]
            finally:
                if on:
                    hpar_agent.detach()
                    trainer.agent = None
        blocks.append({"arm": arm, "pair": pair, "times": times, "cpu": cpu})
        if rank == 0:
            med = statistics.median(times[spec["block_skip"] :])
            print(f"[block {i + 1}/{len(order)}] {arm:8} pair {pair:2}: step {med * 1e3:9.3f} ms", flush=True)
        if not twin and spec["max_s"] and pair >= 0 and new_pair:
            stop_now = [time.monotonic() - t_start > spec["max_s"]]  # rank 0 decides for every rank
            dist.broadcast_object_list(stop_now, src=0)
            if stop_now[0]:
                if rank == 0:
                    print(f"--max-s {spec['max_s']:g} reached: stopping after pair {pair}", flush=True)
                break
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"blocks": blocks}))
    dist.destroy_process_group()
    return 0


def time_steps(step_fn: Callable[[int], object], first: int, n: int) -> tuple[list[float], list[float]]:
    """``n`` steps from step ``first``: each one's wall time and the calling thread's CPU time."""
    times, cpu = [], []
    for step in range(first, first + n):
        t0, c0 = time.perf_counter(), time.thread_time()
        step_fn(step)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return times, cpu


def run_tiny_blocks(spec: dict[str, Any], argv: list[str]) -> None:
    """The short-step workload in this process: ``tiny_gpt``'s model and loop built once, the agent
    attached (``attach(model, optimizer=...)``, as a user's one line) before an agent arm's block and
    detached after it. One process resolves what fresh processes' spread hides (about +-10 % a run
    at 10 ms steps on one GPU)."""
    import hpar_agent
    from benchmarks import tiny_gpt

    model, opt, step_fn = tiny_gpt.build(tiny_gpt.parse_args(argv))
    blocks, step, t_start = [], 0, time.monotonic()
    order, variants = spec["order"], spec["variants"]
    for i, (arm, pair) in enumerate(order):
        on = agent_arm(arm, variants)
        env = arm_env(arm, os.path.join(spec["work"], f"agent{i}"), f"overhead-b{i}", variants) if on else {}
        with patched_env(env):
            if on:
                hpar_agent.attach(model, optimizer=opt)
            try:
                times, cpu = time_steps(step_fn, step, spec["block"])
                step += spec["block"]
            finally:
                if on:
                    hpar_agent.detach()
        blocks.append({"arm": arm, "pair": pair, "times": times, "cpu": cpu})
        print(
            f"[block {i + 1}/{len(order)}] {arm:8} pair {pair:2}: step "
            f"{statistics.median(times[spec['block_skip'] :]) * 1e3:9.3f} ms",
            flush=True,
        )
        last_of_pair = i + 1 == len(order) or order[i + 1][1] != pair
        if spec["max_s"] and pair >= 0 and last_of_pair and time.monotonic() - t_start > spec["max_s"]:
            print(f"--max-s {spec['max_s']:g} reached: stopping after pair {pair}", flush=True)
            break
    Path(spec["out"]).write_text(json.dumps({"blocks": blocks}))


def torchrun_blocks(
    nproc: int, spec: dict[str, Any], argv: list[str], cpus: list[int] | None = None
) -> subprocess.Popen[str]:
    """The blocks of ``spec`` under torchrun (every rank through ``--child-blocks``), on ``cpus`` when given."""
    cmd = torchrun_cmd(nproc, "benchmarks.overhead", ["--child-blocks", json.dumps(spec), "--", *argv])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=pin)


def wait_job(proc: subprocess.Popen[str], what: str) -> None:
    err = proc.communicate()[1]
    if proc.returncode:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}):\n{err[-4000:]}")


def blocks_design(cfg: dict[str, Any], arms: list[str], a: argparse.Namespace, work: str) -> dict[str, Any]:
    spec = {
        "order": block_order(arms, cfg["pairs"], a.warm),
        "block": cfg["block"],
        "block_skip": cfg["block_skip"],
        "work": work,
        "out": os.path.join(work, "blocks.json"),
        "max_s": a.max_s,
        "variants": a.variants,
    }
    argv = [*cfg["args"], "--log-every", "1000000"]
    if cfg.get("workload") == "tiny_gpt":
        run_tiny_blocks(spec, cfg["args"])
    elif cfg["nproc"] == 1:
        run_blocks(spec, argv)
    else:
        wait_job(torchrun_blocks(cfg["nproc"], spec, argv), "block run")
    skip = cfg["block_skip"]
    blocks = [
        {**b, "times": b["times"][skip:], "cpu": b["cpu"][skip:]}
        for b in json.loads(Path(spec["out"]).read_text())["blocks"]
    ]
    return summarize_runs(blocks, arms, "blocks")


def summarize_runs(runs: list[dict[str, Any]], arms: list[str], unit: str) -> dict[str, Any]:
    """The figures of a blocks or runs design from its blocks or runs in order (``arm``, ``pair``,
    ``times`` of the kept steps; runs also ``p99_s``): ratios to off a pair, the A/A from adjacent
    blocks or runs of one arm, the pooled p99, the training thread's CPU (blocks)."""
    for r in runs:
        r["step_s"] = statistics.median(r["times"])
        if r.get("cpu"):
            r["cpu_s"] = statistics.median(r["cpu"])
    aa = adjacent_aa(runs)
    out = {
        "ratios": {**paired(runs, arms), **({"aa": ratio_stats(aa)} if aa else {})},
        "aa_method": f"adjacent {unit} of the same arm at each pair boundary (the order reverses a pair)",
        **pooled_p99_report([runs], arms),
        "off_step_s_median": statistics.median(
            r["step_s"] for r in runs if r["arm"] == "off" and r["pair"] >= 0
        )
        if any(r["arm"] == "off" and r["pair"] >= 0 for r in runs)
        else None,
        "pairs_done": sum(
            {r["arm"] for r in runs if r["pair"] == p} == set(arms)
            for p in {r["pair"] for r in runs if r["pair"] >= 0}
        ),
        unit: runs,
    }
    if unit == "blocks":
        out["train_cpu"] = paired(runs, arms, "cpu_s")
    else:
        out["p99_pair_ratios"] = paired(runs, arms, "p99_s")
    return out


# ------------------------------------------------------------------------------------------------ runs
def run_order(arms: list[str], pairs: int) -> list[tuple[str, int]]:
    """(arm, pair) of every run: the arms in order, then reversed, pair after pair (ABBA), so that a
    drift within a pair falls on each arm in turn and each pair boundary repeats one arm (the A/A)."""
    return [(arm, p) for p in range(pairs) for arm in (arms if p % 2 == 0 else arms[::-1])]


def one_run(cfg: dict[str, Any], arm: str, i: int, work: str, a: argparse.Namespace) -> dict[str, Any]:
    """One fresh run of ``arm``: its kept steps, their p99, and those over 1.5x their median."""
    out = os.path.join(work, f"run{i}-{arm}.json")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **INDUCTOR_CACHES,
        "TORCHINDUCTOR_CACHE_DIR": a.cache_dir,
        **arm_env(arm, os.path.join(work, f"agent{i}"), f"overhead-{i}", a.variants),
    }
    t0 = time.perf_counter()
    res = subprocess.run(
        run_cmd(cfg, arm, out, a.variants),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=a.timeout,
        check=False,
    )
    if res.returncode or not os.path.exists(out):
        raise RuntimeError(
            f"{arm} run failed (rc {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        )
    times = json.loads(Path(out).read_text())["step_times"]
    kept = times[cfg["skip"] :] or times[-1:]
    med = statistics.median(kept)
    return {
        "arm": arm,
        "p99_s": p99(kept),
        "wall_s": time.perf_counter() - t0,
        "times": kept,
        "long": [(k + cfg["skip"], round(t * 1e3, 1)) for k, t in enumerate(kept) if t > 1.5 * med],
    }


def runs_design(
    cfg: dict[str, Any],
    arms: list[str],
    a: argparse.Namespace,
    work: str,
    save: Any,
    clock: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``--warm`` short runs that fill the caches, then the pairs; ``save(result)`` after every run (a
    cut-off invocation keeps its figures)."""
    budget = PairBudget(a.max_s, clock or time.monotonic)
    warm_cfg = {**cfg, "steps": min(cfg["steps"], 3), "skip": 0}  # the first step compiles: enough to fill
    for i in range(a.warm):
        w = one_run(warm_cfg, "on", i, work, a)
        print(f"[warm-up {i + 1}/{a.warm}] on: {w['wall_s']:.1f} s (caches filled)", flush=True)
    runs: list[dict[str, Any]] = []
    order = run_order(arms, cfg["pairs"])
    result: dict[str, Any] = {}
    for i, (arm, pair) in enumerate(order):
        if (not i or order[i - 1][1] != pair) and not budget.pair_starts():
            break
        runs.append({**one_run(cfg, arm, a.warm + i, work, a), "pair": pair})
        r, per_run, left = runs[-1], statistics.fmean(x["wall_s"] for x in runs), len(order) - i - 1
        print(
            f"[{i + 1}/{len(order)}] {arm:8} pair {pair:2}: step {statistics.median(r['times']) * 1e3:8.2f} ms, "
            f"p99 {r['p99_s'] * 1e3:8.2f} ms, run {r['wall_s']:5.1f} s (~{per_run:.0f} s a run; {left} runs left "
            f"~{left * per_run / 60:.1f} min{'' if not a.max_s else f', budget {budget.left_s() / 60:.1f} min'}); "
            f"long steps {r['long'][:5]}",
            flush=True,
        )
        result = summarize_runs([dict(x) for x in runs], arms, "runs")
        save(result)
    return result


def merge(paths: list[str]) -> dict[str, Any]:
    """Several results of one configuration and design (blocks or runs) as one: their pairs numbered
    on, every ratio recomputed (a pair's ratio is within one result, so pairs of separate results, or
    machines, pool as they are; the A/A never pairs runs of two results)."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    unit = "blocks" if docs[0]["design"] == "blocks" else "runs"
    if {d["design"] for d in docs} != {docs[0]["design"]} or unit not in docs[0]:
        raise SystemExit("--merge takes results of one blocks or runs design")
    runs, offset = [], 0
    for source, d in enumerate(docs):
        runs += [
            {**r, "pair": r["pair"] + offset if r["pair"] >= 0 else -1, "source": source} for r in d[unit]
        ]
        offset += max((r["pair"] for r in d[unit]), default=-1) + 1
    head = {
        k: v for k, v in docs[0].items() if k not in (unit, "ratios", "p99_pooled", "p99_pooled_interval")
    }
    return {
        **head,
        "merged": paths,
        "wall_s": sum(d["wall_s"] for d in docs),
        **summarize_runs(runs, docs[0]["arms"], unit),
    }


# ------------------------------------------------------------------------------------------------ twin
def twin_runs(
    cfg: dict[str, Any],
    arms: list[str],
    a: argparse.Namespace,
    halves: tuple[list[int], list[int]],
    work: str,
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """A warm-up slot, then slot after slot of two fresh jobs started together, one per half."""
    budget = PairBudget(a.max_s)

    def slot(arm_a: str, arm_b: str, tag: str) -> dict[str, Any]:
        outs = [os.path.join(work, f"{tag}-{h}.json") for h in HALVES]
        procs = []
        for arm, out, cpus, h in zip((arm_a, arm_b), outs, halves, HALVES, strict=True):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                **arm_env(arm, os.path.join(work, f"agent-{tag}-{h}"), f"twin-{tag}-{h}", a.variants),
            }
            procs.append(
                subprocess.Popen(
                    run_cmd(cfg, arm, out, a.variants),
                    env=env,
                    cwd=ROOT,
                    text=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    preexec_fn=functools.partial(os.sched_setaffinity, 0, cpus),
                )
            )
        for proc, arm in zip(procs, (arm_a, arm_b), strict=True):
            wait_job(proc, f"{arm} job")
        same = common_seconds([json.loads(Path(o).read_text()) for o in outs], cfg["skip"])
        return {
            h: {"median_s": statistics.median(t), "p99_s": p99(t), "times": t}
            for h, t in zip(HALVES, same, strict=True)
        }

    slot("on", "off", "warm")
    slots: list[dict[str, Any]] = []
    order = slot_order(arms, cfg["pairs"])
    for i, (arm_a, arm_b, pair) in enumerate(order):
        if (not i or order[i - 1][2] != pair) and not budget.pair_starts():
            break
        t = time.monotonic()
        slots.append({"a": arm_a, "b": arm_b, "pair": pair, **slot(arm_a, arm_b, f"s{i}")})
        s = slots[-1]
        print(
            f"[slot {i + 1}/{len(order)}] pair {pair:2}: A {arm_a:6} {s['A']['median_s'] * 1e3:8.2f} ms, B {arm_b:6} "
            f"{s['B']['median_s'] * 1e3:8.2f} ms ({time.monotonic() - t:4.1f} s)",
            flush=True,
        )
    jobs = [[{"arm": s[h.lower()], "pair": s["pair"], "times": s[h]["times"]} for s in slots] for h in HALVES]
    return slots, jobs


def twin_blocks(
    cfg: dict[str, Any],
    arms: list[str],
    a: argparse.Namespace,
    halves: tuple[list[int], list[int]],
    work: str,
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Two long-lived jobs, one per half, running blocks in lockstep (``twin_gate``)."""
    order = [(arm, "off" if arm != "off" else "on", -1) for _ in range(a.warm) for arm in ("on", "off")]
    order += slot_order(arms, cfg["pairs"])
    gate = os.path.join(work, "gate")
    os.makedirs(gate)
    specs = [
        {
            "order": [(o[col], o[2]) for o in order],
            "block": cfg["block"],
            "block_skip": cfg["block_skip"],
            "work": os.path.join(work, h),
            "out": os.path.join(work, f"blocks-{h}.json"),
            "max_s": a.max_s if h == "A" else 0,
            "variants": a.variants,
            "twin": {"dir": gate, "me": h, "other": "B" if h == "A" else "A", "leader": h == "A"},
        }
        for h, col in zip(HALVES, (0, 1), strict=True)
    ]
    argv = [*cfg["args"], "--log-every", "1000000"]
    procs = [torchrun_blocks(cfg["nproc"], s, argv, cpus) for s, cpus in zip(specs, halves, strict=True)]
    for proc, h in zip(procs, HALVES, strict=True):
        wait_job(proc, f"twin job {h}")
    blocks = [json.loads(Path(s["out"]).read_text())["blocks"] for s in specs]
    skip = cfg["block_skip"]
    slots = [
        {
            "a": ba["arm"],
            "b": bb["arm"],
            "pair": ba["pair"],
            **{
                h: {
                    "median_s": statistics.median(b["times"][skip:]),
                    "cpu_s": statistics.median(b["cpu"][skip:]),
                }
                for h, b in zip(HALVES, (ba, bb), strict=True)
            },
        }
        for ba, bb in zip(*blocks, strict=False)
        if ba["pair"] >= 0
    ]
    return slots, [[{**b, "times": b["times"][skip:]} for b in job] for job in blocks]


# ------------------------------------------------------------------------------------------------ main
def resolve_config(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """``CONFIGS[name]`` with the command line's overrides (``--extra`` arguments; pairs, block, steps,
    nproc when > 0; block_skip, skip when >= 0)."""
    cfg = {**CONFIGS[name], "args": [*CONFIGS[name]["args"], *shlex.split(a.extra)]}
    cfg.update({k: getattr(a, k) for k in ("pairs", "block", "steps", "nproc") if getattr(a, k) > 0})
    cfg.update({k: getattr(a, k) for k in ("block_skip", "skip") if getattr(a, k) >= 0})
    return cfg


def print_report(r: dict[str, Any]) -> None:
    off = r.get("off_step_s_median")
    print(
        f"\nconfig {r['config']}, design {r['design']} ({r['nproc']} rank(s), torch {r['torch']}, {r['device']}, "
        f"{r['cpu_count']} CPUs); off step median {off * 1e3 if off else float('nan'):.3f} ms; {r['pairs_done']} "
        f"pairs in {r['wall_s']:.0f} s"
    )
    print(
        "step time over off, per pair (median, order-statistic interval (coverage), mean +- sem, min, max):"
    )
    for arm, st in r["ratios"].items():
        print("  " + stats_line(arm, st))
    if r.get("aa_method"):
        print(f"  (aa: {r['aa_method']})")
    for arm, v in r.get("p99_pooled", {}).items():
        lo, hi = r.get("p99_pooled_interval", {}).get(arm, (float("nan"),) * 2)
        per_pair = r.get("p99_pair_ratios", {}).get(arm)
        print(
            f"  p99 of every kept step {arm:10} {v:.4f}x off (pairs resampled {lo:.4f}-{hi:.4f})"
            + (f"; the pairs' p99 ratios: median {per_pair['median']:.4f}" if per_pair else "")
        )
    for arm, st in r.get("train_cpu", {}).items():
        print("  training thread's CPU per step " + stats_line(arm, st))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=[c for c in CONFIGS if c != "cpu-smoke"], default="cpu")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="the gpu configuration's path on CPU, a tiny model"
    )
    ap.add_argument(
        "--design", choices=("blocks", "runs"), default=None, help="default: blocks (short-*: runs)"
    )
    ap.add_argument(
        "--twin", action="store_true", help="two jobs side by side on the core halves (torchrun configs)"
    )
    ap.add_argument("--pairs", type=int, default=0, help="pairs after warm-up (default per config)")
    ap.add_argument(
        "--max-s", type=float, default=0.0, help="no pair starts that would end past this (0: all pairs)"
    )
    ap.add_argument("--block", type=int, default=0, help="blocks: steps per block (default per config)")
    ap.add_argument("--block-skip", type=int, default=-1, help="blocks: steps left out of a block's median")
    ap.add_argument("--steps", type=int, default=0, help="runs: steps per run (default per config)")
    ap.add_argument("--skip", type=int, default=-1, help="runs: steps left out of a run's median")
    ap.add_argument(
        "--warm",
        type=int,
        default=-1,
        help="warm-up (blocks: rounds of every arm, 2; runs: short on runs, 1)",
    )
    ap.add_argument("--no-aa", action="store_true", help="twin: leave the A/A pairs out")
    ap.add_argument("--profiler", action="store_true", help="add a torch.profiler arm")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:K=V,...",
        help="an arm running the agent with these settings over its defaults (repeatable)",
    )
    ap.add_argument(
        "--nproc", type=int, default=0, help="ranks (default per config; > 1 runs under torchrun)"
    )
    ap.add_argument(
        "--extra", default="", help="more workload arguments (later ones win), e.g. '--dp 2 --tp 2'"
    )
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="runs: every run's TORCHINDUCTOR_CACHE_DIR (default: the variable's, else a new one)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run or job")
    ap.add_argument("--json", default=None, help="write the results here (runs: after every run)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="pool the pairs of these results (one design)")
    a = ap.parse_args(argv)
    if a.merge:
        result = merge(a.merge)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
        print_report(result)
        return 0
    name = "cpu-smoke" if a.cpu_smoke else a.config
    cfg = resolve_config(name, a)
    short = cfg.get("workload") == "tiny_gpt"
    design = a.design or ("runs" if short else "blocks")
    if short and (a.twin or a.profiler):
        ap.error("short-* configurations are a user's one-process script: no --twin or --profiler")
    if a.twin and cfg["nproc"] < 2:
        ap.error("--twin runs torchrun jobs: a configuration with several ranks (cpu)")
    if name in ("gpu", "short-gpu") and not torch.cuda.is_available():
        sys.exit(f"--config {name} needs a GPU (--cpu-smoke tests the gpu path on CPU)")
    a.variants = parse_variants(a.variant)
    a.warm = a.warm if a.warm >= 0 else (1 if design == "runs" or a.twin else 2)
    work = tempfile.mkdtemp(prefix="hpar-overhead-")
    a.cache_dir = (
        a.cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(work, "inductor-cache")
    )
    arms = ["off", "on"] + (["profiler"] if a.profiler else [])
    arms += ["aa"] if a.twin and not a.no_aa else []  # blocks and runs: adjacent blocks or runs of one arm
    arms += list(a.variants) + (["nccl"] if name == "gpu" and design == "runs" and cfg["nproc"] > 1 else [])
    t_start = time.time()
    head: dict[str, Any] = {
        "config": name,
        "design": ("twin-" if a.twin else "") + design,
        "workload_args": cfg["args"],
        "nproc": cfg["nproc"],
        "arms": arms,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and "cpu" not in name else "cpu",
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d", time.gmtime(t_start)),
        "command": "python -m benchmarks.overhead " + shlex.join(argv if argv is not None else sys.argv[1:]),
        **{k: cfg[k] for k in ("steps", "skip", "block", "block_skip") if k in cfg},
        "warm": a.warm,
    }

    def save(body: dict[str, Any]) -> dict[str, Any]:
        result = {**head, "wall_s": time.time() - t_start, **body}
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
        return result

    if a.twin:
        halves = core_halves(sorted(os.sched_getaffinity(0)))
        slots, jobs = (twin_runs if design == "runs" else twin_blocks)(cfg, arms, a, halves, work)
        body = {
            "ratios": twin_estimates(slots),
            **pooled_p99_report(jobs, arms),
            "halves": halves,
            "pairs_done": len({s["pair"] for s in slots}),
            "slots": slots,
            "off_step_s_median": statistics.median(
                s[h]["median_s"] for s in slots for h in HALVES if s[h.lower()] == "off"
            ),
        }
        if design == "blocks":
            body["train_cpu"] = twin_estimates(slots, "cpu_s")
    elif design == "blocks":
        body = blocks_design(cfg, arms, a, work)
    else:
        body = runs_design(cfg, arms, a, work, save)
    print_report(save(body))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    if sys.argv[1:2] == ["--child-blocks"]:
        sys.exit(
            run_blocks(json.loads(sys.argv[2]), sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:])
        )
    sys.exit(main())
