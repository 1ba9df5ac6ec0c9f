"""The agent's overhead measured by twin jobs: two copies of a torchrun job side by side, one on each
half of the cores, one with the agent and one without, then the halves swapped.

Why: on the device's CPUs a job's step time swings by 10-20 % from one few-second stretch to the next,
and two identical jobs on the two core halves swing together (their block medians correlated 0.93,
BENCHMARKS.md). The ``overhead`` designs compare arms run one after the other, so those swings land
between the arms and need dozens of pairs to average out. Here both arms run over the same seconds:

  slot 1: half A runs arm X, half B runs off      r1 = X_A / off_B
  slot 2: half A runs off,  half B runs arm X     r2 = X_B / off_A
  pair estimate  sqrt(r1 * r2) = sqrt(X_A X_B / (off_A off_B))

The halves' own speeds cancel in the product, the machine's swings cancel in each ratio, and every slot
measures the arm against off directly. ``aa`` (``--aa``) runs the same pairs with no agent on either
side: the noise floor. Two designs:

  runs    every slot starts two fresh torchrun jobs at once (the agent, where on, attached before the
          first step, as users run it; compile and warm-up included), ``--steps`` steps each; a slot's
          figures are each job's median (and p99) over the steps after ``--skip`` that both jobs ran in
          the same seconds (``step_starts`` of the trainer's summary).
  blocks  two long-lived jobs run ``--block``-step blocks in lockstep (rank 0 of each waits for the
          other before every block: ``overhead.twin_gate``), attaching the agent before an arm's block
          and detaching after it, as ``overhead --design blocks`` does; ``--windows`` gives the ratio on
          steps A..B-1 of the blocks alone (right after attach, against a steady state); ``--burn``
          adds an arm without the agent whose ranks hold the GIL in the agent's slices
          (``overhead.gil_burner``), to tell the passes' share of the GIL from the rest of their cost;
          ``--spin`` one whose ranks keep a core busy off the GIL in bursts (``overhead.cpu_spinner``),
          to tell the full reads' CPU beside training from the rest of their cost.

The arms' slot order alternates from pair to pair. Printed per arm: the median pair estimate with its
order-statistic interval and exact coverage, mean +- sem, min/max, the p99 estimate (runs: from each
slot's p99s; blocks: from the p99 of all kept steps per half and arm), and for blocks each window.

    python -m benchmarks.twin --design runs --pairs 8 --steps 120 --skip 20 --aa --json twin-runs.json
    python -m benchmarks.twin --design blocks --block 90 --windows 3:22,30:90 --aa --max-s 450
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import overhead
from benchmarks.overhead import (
    PairBudget,
    _torchrun_blocks,
    agent_arm,
    arm_env,
    core_halves,
    p99,
    parse_variants,
    parse_windows,
    ratio_stats,
    resolve_config,
    trainer_args,
)

HALVES = ("A", "B")


def slot_order(arms: list[str], pairs: int) -> list[tuple[str, str, int]]:
    """``(arm on half A, arm on half B, pair)`` of every slot: per pair and per arm other than off, the
    two slots ``(X, off)`` and ``(off, X)``, which of them first alternating from pair to pair."""
    out = []
    for p in range(pairs):
        for arm in arms:
            if arm == "off":
                continue
            slots = [(arm, "off", p), ("off", arm, p)]
            out += slots if p % 2 == 0 else slots[::-1]
    return out


def pair_estimates(slots: list[dict[str, Any]], key: str) -> dict[str, dict[int, float]]:
    """Per arm and pair: ``sqrt(X_A / off_B * X_B / off_A)`` from the pair's two slots' ``key`` values
    (``slots``: dicts with ``a``, ``b`` (arms), ``pair``, ``A``, ``B`` (dicts of values))."""
    halves: dict[tuple[str, int], dict[str, float]] = {}  # (arm, pair) -> {"XA", "offB", "XB", "offA"}
    for s in slots:
        if s["A"].get(key) is None or s["B"].get(key) is None:
            continue
        if s["b"] == "off" and s["a"] != "off":
            halves.setdefault((s["a"], s["pair"]), {}).update(XA=s["A"][key], offB=s["B"][key])
        elif s["a"] == "off" and s["b"] != "off":
            halves.setdefault((s["b"], s["pair"]), {}).update(XB=s["B"][key], offA=s["A"][key])
    out: dict[str, dict[int, float]] = {}
    for (arm, pair), v in halves.items():
        if len(v) == 4:
            out.setdefault(arm, {})[pair] = (v["XA"] / v["offB"] * v["XB"] / v["offA"]) ** 0.5
    return out


def summarize(slots: list[dict[str, Any]], key: str = "median_s") -> dict[str, dict[str, Any]]:
    """Per arm: ``ratio_stats`` over the pair estimates of ``key``."""
    return {arm: {**ratio_stats(list(by_pair.values())), "pairs": len(by_pair), "ratios": list(by_pair.values())}
            for arm, by_pair in pair_estimates(slots, key).items()}  # fmt: skip


# ------------------------------------------------------------------------------------------ runs design
def common_seconds(runs: list[dict[str, Any]], skip: int) -> list[list[float]]:
    """Each run's step times after ``skip`` that lie within the seconds both runs stepped in (all of
    its kept steps where that leaves fewer than 10 of them)."""
    kept = [list(zip(r["step_starts"][skip:], r["step_times"][skip:], strict=True)) for r in runs]
    lo = max(k[0][0] for k in kept)
    hi = min(k[-1][0] + k[-1][1] for k in kept)
    out = []
    for k in kept:
        same = [d for s, d in k if s >= lo and s + d <= hi]
        out.append(same if len(same) >= 10 else [d for _, d in k])
    return out


def start_job(arm: str, cfg: dict[str, Any], out: str, cpus: list[int], work: str, tag: str,
              variants: dict[str, dict[str, str]]) -> subprocess.Popen[str]:
    """One fresh torchrun job of ``cfg`` on ``cpus``, the agent attached at start where ``arm`` runs it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg['nproc']}",
           overhead.__file__, "--child", "plain", "--", *trainer_args(cfg, arm, out, variants)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           **arm_env(arm, os.path.join(work, f"agent-{tag}"), f"twin-{tag}", variants)}  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def run_slot(a: str, b: str, cfg: dict[str, Any], halves: tuple[list[int], list[int]], work: str, tag: str,
             variants: dict[str, dict[str, str]], timeout: float) -> dict[str, Any]:
    """Both halves' jobs of one slot, started together; their medians and p99s over the same seconds."""
    outs = [os.path.join(work, f"{tag}-{h}.json") for h in HALVES]
    procs = [start_job(arm, cfg, out, cpus, work, f"{tag}-{h}", variants)
             for arm, out, cpus, h in zip((a, b), outs, halves, HALVES, strict=True)]  # fmt: skip
    for proc, arm in zip(procs, (a, b), strict=True):
        _, err = proc.communicate(timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{arm} job failed (rc {proc.returncode}):\n{err[-3000:]}")
    runs = [json.loads(Path(o).read_text()) for o in outs]
    same = common_seconds(runs, cfg["skip"])
    return {h: {"median_s": statistics.median(t), "p99_s": p99(t), "steps": len(t)} for h, t in zip(HALVES, same, strict=True)}


def runs_design(cfg: dict[str, Any], arms: list[str], a: argparse.Namespace,
                halves: tuple[list[int], list[int]], work: str,
                clock: Callable[[], float] = time.monotonic) -> list[dict[str, Any]]:
    """Fresh jobs per slot (one warm-up slot first: caches, page cache). With ``--max-s``, no pair starts
    that would end past it at the pace of the slowest pair so far (a device call's limit is hard; a
    pair of 200-step slots takes ~2 minutes)."""
    budget = PairBudget(a.max_s, clock)
    run_slot("on", "off", cfg, halves, work, "warm", a.variants, a.timeout)
    slots: list[dict[str, Any]] = []
    order = slot_order(arms, cfg["pairs"])
    for i, (arm_a, arm_b, pair) in enumerate(order):
        t = clock()
        if (not i or order[i - 1][2] != pair) and not budget.pair_starts():
            break
        res = run_slot(arm_a, arm_b, cfg, halves, work, f"s{i}", a.variants, a.timeout)
        slots.append({"a": arm_a, "b": arm_b, "pair": pair, **res})
        print(f"[slot {i + 1}/{len(order)}] pair {pair:2}: A {arm_a:6} {res['A']['median_s'] * 1e3:8.2f} ms, "
              f"B {arm_b:6} {res['B']['median_s'] * 1e3:8.2f} ms ({res['A']['steps']}/{res['B']['steps']} steps in "
              f"the same seconds, {clock() - t:4.1f} s)", flush=True)
    return slots


# ---------------------------------------------------------------------------------------- blocks design
def blocks_design(cfg: dict[str, Any], arms: list[str], a: argparse.Namespace,
                  halves: tuple[list[int], list[int]], work: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two long-lived jobs in lockstep, block for block; returns the slots of kept-step medians, and
    ``windows`` (the same slots' medians per ``--windows`` window), ``p99`` and each job's ``blocks``."""
    order = slot_order(arms, cfg["pairs"])
    warm = [(arm, "off" if arm != "off" else "on", -1) for _ in range(a.warm) for arm in ("on", "off")]
    order = warm + order
    argv = [*cfg["args"], "--log-every", "1000000"]
    gate = os.path.join(work, "gate")
    os.makedirs(gate)
    specs = []
    for h, col in zip(HALVES, (0, 1), strict=True):
        specs.append({"order": [(o[col], o[2]) for o in order], "block": cfg["block"], "block_skip": cfg["block_skip"],
                      "work": os.path.join(work, h), "out": os.path.join(work, f"blocks-{h}.json"),
                      "max_s": a.max_s if h == "A" else 0, "variants": a.variants, "burn": a.burn, "spin": a.spin,
                      "twin": {"dir": gate, "me": h, "other": "B" if h == "A" else "A", "leader": h == "A"}})
    jobs = [_torchrun_blocks(cfg["nproc"], s, argv, a.timeout, cpus=cpus, wait=False)
            for s, cpus in zip(specs, halves, strict=True)]  # fmt: skip
    for job, h in zip(jobs, HALVES, strict=True):
        _, err = job.communicate(timeout=a.timeout)
        if job.returncode:
            raise RuntimeError(f"twin job {h} failed (rc {job.returncode}):\n{err[-4000:]}")
    blocks = [json.loads(Path(s["out"]).read_text())["blocks"] for s in specs]
    skip = cfg["block_skip"]
    slots, windows = [], []
    for ba, bb in zip(*blocks, strict=False):
        if ba["pair"] < 0:
            continue
        slots.append({"a": ba["arm"], "b": bb["arm"], "pair": ba["pair"],
                      **{h: {"median_s": statistics.median(b["times"][skip:]),
                             "cpu_s": statistics.median(b["cpu"][skip:]) if b.get("cpu") else None}
                         for h, b in zip(HALVES, (ba, bb), strict=True)}})  # fmt: skip
        win = {f"{lo}:{hi}": {h: {"median_s": statistics.median(b["times"][lo:hi]) if b["times"][lo:hi] else None}
                              for h, b in zip(HALVES, (ba, bb), strict=True)}
               for lo, hi in a.windows}  # fmt: skip
        windows.append({"a": ba["arm"], "b": bb["arm"], "pair": ba["pair"], "win": win})
    return slots, {"windows": windows, "p99": pooled_p99(blocks, arms, skip), "blocks": blocks}


def pooled_p99(blocks: list[list[dict[str, Any]]], arms: list[str], skip: int) -> dict[str, float]:
    """Per arm other than off: ``sqrt(p99(X_A) p99(X_B) / (p99(off_A) p99(off_B)))``, each half's ratio
    from ``overhead.pooled_p99`` (every kept step of its paired blocks: one block holds too few steps)."""
    a, b = (overhead.pooled_p99(bl, arms, skip) for bl in blocks)
    return {arm: (a[arm]["ratio"] * b[arm]["ratio"]) ** 0.5 for arm in arms if arm != "off" and arm in a and arm in b}


def pooled_p99_interval(blocks: list[list[dict[str, Any]]], arms: list[str], skip: int, reps: int = 1000,
                        seed: int = 0) -> dict[str, tuple[float, float]]:
    """Per arm, the 2.5th and 97.5th percentiles of ``pooled_p99`` over the pairs resampled with
    replacement (a pair's blocks go together, as a stall shared by its arms does): how much the pooled
    p99 rests on a few pairs. Empty with fewer than 3 pairs."""
    pairs = sorted({b["pair"] for half in blocks for b in half if b["pair"] >= 0})
    if len(pairs) < 3:
        return {}
    by_pair = [{p: [b for b in half if b["pair"] == p] for p in pairs} for half in blocks]
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(reps):
        pick = rng.choices(pairs, k=len(pairs))
        sample = [[{**b, "pair": i} for i, p in enumerate(pick) for b in half[p]] for half in by_pair]
        for arm, v in pooled_p99(sample, arms, skip).items():
            draws.setdefault(arm, []).append(v)
    out = {}
    for arm, v in draws.items():
        v.sort()
        out[arm] = (v[int(0.025 * (len(v) - 1))], v[int(0.975 * (len(v) - 1))])
    return out


def line(arm: str, st: dict[str, Any]) -> str:
    return (f"{arm:10} {st['median']:8.4f} {st['ci_lo']:8.4f}-{st['ci_hi']:.4f} ({st['ci_coverage']:5.1%}) "
            f"mean {st['mean']:.4f} +- {st['sem']:.4f}, min {st['min']:.4f} max {st['max']:.4f}, {st['pairs']} pairs")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--design", choices=("runs", "blocks"), default="runs")
    ap.add_argument("--pairs", type=int, default=100, help="pairs of slots per arm (--max-s usually ends first)")
    ap.add_argument("--max-s", type=float, default=0.0, help="stop before a pair that would end past this many seconds (blocks: after the pair that does)")
    ap.add_argument("--steps", type=int, default=0, help="runs: steps per job (default per config)")
    ap.add_argument("--skip", type=int, default=-1, help="runs: steps left out (compile, warm-up)")
    ap.add_argument("--block", type=int, default=0, help="blocks: steps per block")
    ap.add_argument("--block-skip", type=int, default=-1, help="blocks: steps left out of a block's median")
    ap.add_argument("--warm", type=int, default=1, help="blocks: warm-up rounds of on and off")
    ap.add_argument("--windows", default="", metavar="A:B,...", help="blocks: ratios on steps A..B-1 of the blocks")
    ap.add_argument("--aa", action="store_true", help="also pairs with no agent on either side (the noise floor)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...",
                    help="an arm running the agent with these settings over its defaults (repeatable)")
    ap.add_argument("--burn", default="", metavar="HOLD_MS/SLOT_MS[/SWITCH_MS]",
                    help="blocks: an arm without the agent whose ranks hold the GIL in slices at the agent's "
                    "instants (overhead.gil_burner): what the passes' share of the GIL costs by itself")
    ap.add_argument("--spin", default="", metavar="BUSY_MS/PERIOD_MS[/SCHED]",
                    help="blocks: an arm without the agent whose ranks keep a core busy off the GIL below training "
                    "(SCHED nice, the default, or idle) in bursts at shared instants (overhead.cpu_spinner): what "
                    "the full reads' dumps cost by their CPU")
    ap.add_argument("--nproc", type=int, default=0, help="ranks per job (default per config)")
    ap.add_argument("--extra", default="", help="more trainer arguments (later ones win)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    a.variants = parse_variants(a.variant)
    a.windows = parse_windows(a.windows)
    cfg = resolve_config(a.config, a)
    if (a.burn or a.spin) and a.design != "blocks":
        ap.error("--burn and --spin are arms of the blocks design")
    arms = ["off", "on"] + (["aa"] if a.aa else []) + (["burn"] if a.burn else []) + (["spin"] if a.spin else []) \
        + list(a.variants)
    halves = core_halves(sorted(os.sched_getaffinity(0)))
    work = tempfile.mkdtemp(prefix="hpar-twin-")
    t_start = time.time()
    extra: dict[str, Any] = {}
    if a.design == "runs":
        slots = runs_design(cfg, arms, a, halves, work)
    else:
        slots, extra = blocks_design(cfg, arms, a, halves, work)
    result: dict[str, Any] = {
        "design": f"twin-{a.design}", "config": a.config, "trainer_args": cfg["args"], "nproc": cfg["nproc"],
        "halves": halves, "date": time.strftime("%Y-%m-%d", time.gmtime(t_start)), "wall_s": time.time() - t_start,
        "arms": arms, "agent_arms": [x for x in arms if agent_arm(x, a.variants)],
        "off_step_s_median": statistics.median([s[h]["median_s"] for s in slots for h in HALVES
                                                if (s["a"], s["b"])[HALVES.index(h)] == "off"]),
        "ratios": summarize(slots), "slots": slots,
    }  # fmt: skip
    if a.design == "runs":
        result["p99_ratios"] = summarize(slots, "p99_s")
        result.update(steps=cfg["steps"], skip=cfg["skip"])
    else:
        result.update(block=cfg["block"], block_skip=cfg["block_skip"], p99_pooled=extra["p99"],
                      p99_pooled_interval=pooled_p99_interval(extra["blocks"], arms, cfg["block_skip"]))
        result["train_cpu"] = summarize(slots, "cpu_s")
        result["windows"] = {k: summarize([{**w, **w["win"][k]} for w in extra["windows"]])
                             for k in (extra["windows"][0]["win"] if extra["windows"] else {})}  # fmt: skip
        result["agent"] = {h: overhead.agent_totals(b) for h, b in zip(HALVES, extra["blocks"], strict=True)}
        result["blocks"] = extra["blocks"]
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"\ntwin {a.design}, config {a.config} ({cfg['nproc']} ranks a job; halves {halves[0]} | {halves[1]}); "
          f"off step median {result['off_step_s_median'] * 1e3:.2f} ms, {result['wall_s']:.0f} s")
    print("pair estimate sqrt(X_A X_B / (off_A off_B)), median with its interval (coverage):")
    for arm, st in result["ratios"].items():
        print("  " + line(arm, st))
    for arm, st in result.get("p99_ratios", {}).items():
        print("  p99 " + line(arm, st))
    for arm, v in result.get("p99_pooled", {}).items():
        lo, hi = result.get("p99_pooled_interval", {}).get(arm, (float("nan"),) * 2)
        print(f"  p99 of all kept steps {arm:10} {v:.4f}   pairs resampled: {lo:.4f}-{hi:.4f}")
    for arm, st in result.get("train_cpu", {}).items():
        print("  training thread's CPU per step " + line(arm, st))
    for k, by_arm in result.get("windows", {}).items():
        for arm, st in by_arm.items():
            print(f"  steps {k:>7} " + line(arm, st))
    for h, totals in result.get("agent", {}).items():
        for ln in overhead.agent_lines(totals):
            print(f"  agent, job {h}: " + ln)
    return 0


if __name__ == "__main__":
    sys.exit(main())
