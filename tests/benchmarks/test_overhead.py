"""The overhead benchmark's designs: their orders, the twin estimator, the pooled p99 with its
resampled interval, the runs design's budget and its results written after every run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import overhead
from benchmarks.common import adjacent_aa
from benchmarks.overhead import (
    arm_env,
    block_order,
    common_seconds,
    core_halves,
    parse_variants,
    pooled_p99,
    pooled_p99_report,
    run_cmd,
    run_order,
    slot_order,
    twin_estimates,
)


def test_blocks_rotate_the_arm_order_after_warm_up_rounds() -> None:
    order = block_order(["off", "on", "aa"], pairs=2, warm=1)
    assert order[:3] == [("off", -1), ("on", -1), ("aa", -1)]
    assert order[3:] == [("off", 0), ("on", 0), ("aa", 0), ("on", 1), ("aa", 1), ("off", 1)]


def test_runs_alternate_the_order_so_every_pair_boundary_repeats_an_arm() -> None:
    order = run_order(["off", "on"], 4)
    assert order == [("off", 0), ("on", 0), ("on", 1), ("off", 1), ("off", 2), ("on", 2), ("on", 3), ("off", 3)]
    runs = [{"arm": a, "pair": p, "step_s": 1.0} for a, p in order]
    assert len(adjacent_aa(runs)) == 3  # n pairs give n - 1 A/A ratios


def test_variants_are_agent_arms_with_their_own_settings() -> None:
    v = parse_variants(["slow:HPAR_INTERVAL=5,HPAR_FR_INTERVAL=30", "lists:HPAR_X=a,b"])
    assert v == {"slow": {"HPAR_INTERVAL": "5", "HPAR_FR_INTERVAL": "30"}, "lists": {"HPAR_X": "a,b"}}
    env = arm_env("slow", "/run", "job", v)
    assert env["HPAR_INTERVAL"] == "5" and env["HPAR_RUN_DIR"] == "/run" and env["HPAR_TRACES"] == "file"
    assert arm_env("off", "/run", "job", v) == {} and arm_env("aa", "/run", "job", v) == {}
    assert arm_env("nccl", "/run", "job", v) == {"TORCH_NCCL_ENABLE_TIMING": "1"}
    for bad in ("on:HPAR_INTERVAL=2", "x", ":HPAR_INTERVAL=2"):
        with pytest.raises(SystemExit):
            parse_variants([bad])


def test_a_short_run_is_the_users_script_and_the_agent_arm_wraps_it_in_hpar_agent_run() -> None:
    cfg = {**overhead.CONFIGS["short-cpu"], "steps": 50}
    off = run_cmd(cfg, "off", "/o.json", {})
    on = run_cmd(cfg, "on", "/o.json", {})
    assert off[1:] == [str(overhead.TINY_GPT), "--preset", "cpu", "--steps", "50", "--out", "/o.json"]
    assert on[:5] == [sys.executable, "-m", "hpar_agent", "run", "--"] and on[5:] == off
    ranks = run_cmd(overhead.CONFIGS["cpu"], "off", "/o.json", {})
    assert ranks[1:3] == ["-m", "torch.distributed.run"] and ranks[-1] == "--no-agent"
    one = run_cmd(overhead.CONFIGS["gpu"], "on", "/o.json", {})
    assert one[1:5] == ["-m", "benchmarks.overhead", "--child", "plain"] and "--no-agent" not in one


def _slot(a: str, b: str, pair: int, va: float, vb: float) -> dict[str, Any]:
    return {"a": a, "b": b, "pair": pair, "A": {"median_s": va}, "B": {"median_s": vb}}


def test_twin_pairs_run_each_arm_on_both_halves_against_off_alternating_order() -> None:
    order = slot_order(["off", "on", "aa"], 2)
    assert order[:4] == [("on", "off", 0), ("off", "on", 0), ("aa", "off", 0), ("off", "aa", 0)]
    assert order[4:] == [("off", "on", 1), ("on", "off", 1), ("off", "aa", 1), ("aa", "off", 1)]


def test_twin_halves_speeds_and_machine_swings_cancel_and_the_cost_remains() -> None:
    slots = []
    for pair, machine in enumerate((1.0, 1.3, 0.8)):  # the whole machine 30 % slower, then 20 % faster
        half_a, half_b, cost = 0.070 * machine, 0.077 * machine, 1.02  # half B 10 % slower than A
        slots += [_slot("on", "off", pair, half_a * cost, half_b), _slot("off", "on", pair, half_a, half_b * cost)]
        slots += [_slot("aa", "off", pair, half_a, half_b), _slot("off", "aa", pair, half_a, half_b)]
    slots.append({**_slot("off", "on", 3, 1.0, 1.0), "A": {"median_s": None}})  # a pair missing a value
    st = twin_estimates(slots)
    assert list(st) == ["on", "aa"]
    assert st["on"]["ratios"] == pytest.approx([1.02] * 3) and st["aa"]["median"] == pytest.approx(1.0)


def test_common_seconds_keep_the_steps_both_runs_took_in_the_same_seconds() -> None:
    fast = {"step_starts": [float(i) for i in range(30)], "step_times": [1.0] * 30}  # 0..30 s
    late = {"step_starts": [10.0 + 2 * i for i in range(20)], "step_times": [2.0] * 20}  # 10..50 s
    a, b = common_seconds([fast, late], skip=2)  # kept: fast from 2 s, late from 14 s; common 14..30 s
    assert a == [1.0] * 16
    assert b == [2.0] * 18  # only 8 of late's in those seconds: fewer than 10, so all it kept


def _blocks(pairs: int, on: list[float], stall_pair: int | None = None) -> list[dict[str, Any]]:
    out = []
    for p in range(pairs):
        times = list(on)
        if p == stall_pair:  # more stalled steps than a pooled p99's top 1 %
            times[-10:] = [3.0] * 10
        out += [{"arm": "on", "pair": p, "times": times}, {"arm": "off", "pair": p, "times": [1.0 + 0.001 * i for i in range(60)]}]
    return out


def test_pooled_p99_is_over_every_kept_step_and_its_interval_shows_a_pair_carrying_it() -> None:
    steady = [1.05 * (1.0 + 0.001 * i) for i in range(60)]
    rep = pooled_p99_report([_blocks(10, steady)], ["off", "on"])
    assert rep["p99_pooled"]["on"] == pytest.approx(1.05, abs=1e-3)
    lo, hi = rep["p99_pooled_interval"]["on"]
    assert lo == pytest.approx(1.05, abs=1e-3) and hi == pytest.approx(1.05, abs=1e-3)
    stalled = pooled_p99_report([_blocks(10, steady, stall_pair=3)], ["off", "on"])
    assert stalled["p99_pooled"]["on"] > 1.5
    lo, hi = stalled["p99_pooled_interval"]["on"]
    assert lo == pytest.approx(1.05, abs=1e-3) and hi > 1.5  # draws without pair 3, with it twice or more
    assert pooled_p99_report([_blocks(2, steady)], ["off", "on"])["p99_pooled_interval"] == {}


def test_twin_pooled_p99_is_the_geometric_mean_over_the_halves() -> None:
    a = [{"arm": "on", "pair": 0, "times": [1.1] * 50}, {"arm": "off", "pair": 0, "times": [1.0] * 50}]
    b = [{"arm": "off", "pair": 0, "times": [2.0] * 50}, {"arm": "on", "pair": 0, "times": [2.42] * 50}]
    assert pooled_p99([a, b], ["off", "on"]) == {"on": pytest.approx((1.1 * 1.21) ** 0.5)}


def test_core_halves_share_no_core() -> None:
    first, second = core_halves([0, 1])
    assert first and second and not set(first) & set(second)


def test_runs_stop_at_the_budget_and_write_their_figures_after_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 s runs (20 s pairs) and 75 s: the warm-up and three pairs run (70 s), a fourth would end past
    it. The results after the last run hold every run, the on/off ratio and the A/A of adjacent runs."""
    clock = [0.0]

    def one_run(cfg: dict[str, Any], arm: str, i: int, work: str, a: argparse.Namespace) -> dict[str, Any]:
        clock[0] += 10.0
        step = 0.105 if arm == "on" else 0.1
        return {"arm": arm, "step_s": step, "p99_s": step * 1.1, "wall_s": 10.0, "long": [], "times": [step] * 20}

    monkeypatch.setattr(overhead, "one_run", one_run)
    saved: list[dict[str, Any]] = []
    a = argparse.Namespace(max_s=75.0, warm=1)
    cfg = {"pairs": 10}
    result = overhead.runs_design(cfg, ["off", "on"], a, str(tmp_path), lambda r: saved.append(json.loads(json.dumps(r))),
                                  clock=lambda: clock[0])
    assert result["pairs_done"] == 3 and len(result["runs"]) == 6 and len(saved) == 6
    assert result["ratios"]["on"]["median"] == pytest.approx(1.05)
    assert result["ratios"]["aa"]["pairs"] == 2 and result["ratios"]["aa"]["median"] == pytest.approx(1.0)
    assert saved[2]["pairs_done"] == 1 and "aa" not in saved[1]["ratios"]
    assert result["p99_pooled"]["on"] == pytest.approx(1.05)
