"""Training-step overhead of the agent (and of torch.profiler / NCCL timing), measured side by side.

Arms, run INTERLEAVED after one warm-up run so machine drift hits every arm alike:
  off       trainer with ``--no-agent``
  on        trainer with the agent: every collector, detectors, tracing at the default sampling, traces
            to a local file (``HPAR_TRACES=file``)
  profiler  ``--no-agent`` inside ``torch.profiler.profile`` (CPU, plus CUDA activities on a GPU)
  nccl      ``--no-agent`` with ``TORCH_NCCL_ENABLE_TIMING=1`` (CUDA only)
A run's step time is the median of the trainer's ``step_times`` after ``--skip`` steps (compile and
warm-up); a pair's ratio is arm / off of the same pair. Printed: median ratio with min/max over pairs.

Configurations: ``--config cpu`` launches 4 gloo ranks with torchrun (dp1 x tp2 x pp2, aot_eager, tiny
model); ``--config gpu`` runs the trainer's entry in-process, world size 1 (inductor, bf16, a model whose
step takes >= 50 ms on an H200). In-process runs let the profiler wrap the trainer without a trainer
flag and reuse the warm compile caches, so 20 runs fit in a few device minutes. ``--cpu-smoke`` runs the
gpu configuration's in-process path on CPU with a tiny model (to test this script without a GPU).

    python benchmarks/overhead.py --config cpu --pairs 5 --json overhead-cpu.json
    python benchmarks/overhead.py --config gpu --pairs 5 --json overhead-gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
    },
    "gpu": {
        "nproc": 1,
        "args": ["--compile", "inductor", "--dtype", "bf16", "--layers", "12", "--dim", "2048", "--heads", "16",
                 "--seq-len", "1024", "--global-batch", "8", "--vocab", "8192", "--lr", "3e-4", "--device", "cuda"],
        "steps": 25,
        "skip": 5,
    },
    "cpu-smoke": {  # the gpu configuration's in-process path on CPU, tiny
        "nproc": 1,
        "args": ["--compile", "aot_eager", "--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32",
                 "--global-batch", "8", "--device", "cpu"],
        "steps": 8,
        "skip": 3,
    },
}


def arm_env(arm: str, run_dir: str, job: str) -> dict[str, str]:
    """Environment of one arm; the agent's settings are its defaults except where files go."""
    env: dict[str, str] = {}
    if arm == "on":
        env.update(HPAR_RUN_DIR=run_dir, HPAR_JOB_ID=job, HPAR_TRACES="file", HPAR_METRICS_PORT="0",
                   HPAR_DETECTORS="1")
    if arm == "nccl":
        env["TORCH_NCCL_ENABLE_TIMING"] = "1"
    return env


def trainer_args(cfg: dict[str, Any], arm: str, out: str) -> list[str]:
    args = [*cfg["args"], "--steps", str(cfg["steps"]), "--log-every", "1000", "--out", out]
    return args if arm == "on" else [*args, "--no-agent"]


@contextlib.contextmanager
def maybe_profiler(on: bool) -> Iterator[None]:
    """torch.profiler over the whole trainer run (CPU activities, plus CUDA when a GPU is present)."""
    if not on:
        yield
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts):
        yield


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


def step_time(out: str, skip: int) -> float:
    times = json.loads(Path(out).read_text())["step_times"]
    if len(times) <= skip:
        raise RuntimeError(f"{out}: only {len(times)} steps, need more than --skip {skip}")
    return statistics.median(times[skip:])


def ratio_stats(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summarize(runs: list[dict[str, Any]], arms: list[str]) -> dict[str, dict[str, float]]:
    """Per arm: median / min / max over pairs of (arm step time / off step time of the same pair)."""
    by_pair: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["pair"] >= 0:
            by_pair.setdefault(r["pair"], {})[r["arm"]] = r["step_s"]
    out = {}
    for arm in arms:
        if arm == "off":
            continue
        ratios = [p[arm] / p["off"] for p in by_pair.values() if arm in p and "off" in p]
        if ratios:
            out[arm] = {**ratio_stats(ratios), "pairs": len(ratios), "ratios": ratios}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--cpu-smoke", action="store_true", help="gpu config's in-process path on CPU, tiny model")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved rounds after the warm-up (>= 5 for figures)")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps per run (default per config)")
    ap.add_argument("--skip", type=int, default=-1, help="steps left out of a run's median (default per config)")
    ap.add_argument("--no-profiler", action="store_true", help="leave the torch.profiler arm out")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun run")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    name = "cpu-smoke" if a.cpu_smoke else a.config
    cfg = dict(CONFIGS[name])
    if a.steps:
        cfg["steps"] = a.steps
    if a.skip >= 0:
        cfg["skip"] = a.skip
    inprocess = cfg["nproc"] == 1
    if name == "gpu" and not torch.cuda.is_available():
        sys.exit("--config gpu needs a GPU (use --cpu-smoke to test the path on CPU)")
    arms = ["off", "on"] + ([] if a.no_profiler else ["profiler"]) + (["nccl"] if name == "gpu" else [])
    work = tempfile.mkdtemp(prefix="hpar-overhead-")
    runs: list[dict[str, Any]] = []
    t_start = time.time()
    schedule = [("on", -1)] + [(arm, p) for p in range(a.pairs) for arm in arms]  # warm-up: fills caches
    for i, (arm, pair) in enumerate(schedule):
        out = os.path.join(work, f"run{i}-{arm}.json")
        env = arm_env(arm, os.path.join(work, f"agent{i}"), f"overhead-{i}")
        args = trainer_args(cfg, arm, out)
        t0 = time.perf_counter()
        if inprocess:
            run_inprocess(arm, args, env)
        else:
            run_torchrun(arm, cfg["nproc"], args, env, a.timeout)
        st = step_time(out, cfg["skip"])
        runs.append({"arm": arm, "pair": pair, "step_s": st, "wall_s": time.perf_counter() - t0})
        print(f"[{i + 1}/{len(schedule)}] {arm:8} pair {pair:2}: step {st * 1e3:9.2f} ms "
              f"(run {time.perf_counter() - t0:5.1f} s)", flush=True)
        result = report(name, cfg, a.pairs, inprocess, t_start, runs, arms)
        if a.json:  # after every run: a run cut short by a time limit still leaves its figures
            Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"\nconfig {name} ({result['mode']}, {cfg['nproc']} rank(s), torch {torch.__version__}, "
          f"{result['device']}); off step time median {result['off_step_s_median'] * 1e3:.2f} ms")
    print(f"{'arm':10} {'ratio vs off (median)':>22} {'min':>8} {'max':>8} {'pairs':>6}")
    for arm, s in result["ratios"].items():
        print(f"{arm:10} {s['median']:22.4f} {s['min']:8.4f} {s['max']:8.4f} {s['pairs']:6d}")
    return 0


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


def child(argv: list[str]) -> int:
    """torchrun entry of every rank: the trainer, optionally inside torch.profiler."""
    mode, rest = argv[0], argv[2:] if len(argv) > 1 and argv[1] == "--" else argv[1:]
    from hpar_trainer.train import main as train_main

    with maybe_profiler(mode == "profiler"):
        return train_main(rest)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    sys.exit(main())
