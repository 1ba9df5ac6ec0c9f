"""The twin design of ``benchmarks.overhead`` (``--twin``): two copies of a job side by side, one on
each half of the cores. Here are the parts that start no process, so they test on their own: the
slots' order, the estimator in which the halves' speeds cancel, the seconds two runs share, and the
gate that keeps the two jobs' blocks in lockstep. ``overhead.twin_runs`` and ``overhead.twin_blocks``
start the jobs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.common import ratio_stats

#: The two halves of the cores, and the keys of a slot's values on each.
HALVES = ("A", "B")


def slot_order(arms: list[str], pairs: int) -> list[tuple[str, str, int]]:
    """``(arm on half A, arm on half B, pair)`` of every slot: per pair and per arm X other than off,
    ``(X, off)`` and ``(off, X)``, which of them first alternating from pair to pair."""
    out = []
    for p in range(pairs):
        for arm in arms[1:]:
            slots = [(arm, "off", p), ("off", arm, p)]
            out += slots if p % 2 == 0 else slots[::-1]
    return out


def twin_estimates(slots: list[dict[str, Any]], key: str = "median_s") -> dict[str, dict[str, Any]]:
    """Per arm: ``ratio_stats`` over the pairs of ``sqrt(X_A / off_B * X_B / off_A)`` (``slots``: dicts
    with ``a``, ``b`` (arms), ``pair``, ``A``, ``B`` (dicts of values)); a pair missing a value has none."""
    halves: dict[tuple[str, int], dict[str, float]] = {}
    for s in slots:
        if s["A"].get(key) is None or s["B"].get(key) is None:
            continue
        if s["b"] == "off" and s["a"] != "off":
            halves.setdefault((s["a"], s["pair"]), {}).update(XA=s["A"][key], offB=s["B"][key])
        elif s["a"] == "off" and s["b"] != "off":
            halves.setdefault((s["b"], s["pair"]), {}).update(XB=s["B"][key], offA=s["A"][key])
    by_arm: dict[str, list[float]] = {}
    for (arm, _pair), v in halves.items():  # the slots' order: the arms' own
        if len(v) == 4:
            by_arm.setdefault(arm, []).append((v["XA"] / v["offB"] * v["XB"] / v["offA"]) ** 0.5)
    return {arm: ratio_stats(r) for arm, r in by_arm.items()}


def common_seconds(runs: list[dict[str, Any]], skip: int) -> list[list[float]]:
    """Each of two runs' step times after ``skip`` that lie within the seconds both ran steps in (all of
    its kept steps where that leaves fewer than 10)."""
    kept = [list(zip(r["step_starts"][skip:], r["step_times"][skip:], strict=True)) for r in runs]
    lo, hi = max(k[0][0] for k in kept), min(k[-1][0] + k[-1][1] for k in kept)
    out = []
    for k in kept:
        same = [d for s, d in k if s >= lo and s + d <= hi]
        out.append(same if len(same) >= 10 else [d for _, d in k])
    return out


def twin_gate(twin: dict[str, Any], i: int, stop: bool) -> bool:
    """Rank 0 of a twin job before its block ``i``: mark this job's arrival and wait for the other's,
    so both run block ``i`` over the same seconds; the leader's ``stop`` ends both. True: run it."""
    d = Path(twin["dir"])
    if stop:
        (d / f"stop.{i}").touch()
        return False
    (d / f"{twin['me']}.{i}").touch()
    deadline = time.monotonic() + 900
    while not (d / f"{twin['other']}.{i}").exists():
        if (d / f"stop.{i}").exists():
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"twin job {twin['other']} did not reach block {i}")
        time.sleep(0.002)
    return True
