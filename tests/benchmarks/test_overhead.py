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
from benchmarks.common import adjacent_aa, common_seconds, slot_order, twin_estimates
from benchmarks.overhead import arm_env, block_order, parse_variants, run_cmd, run_order


def test_blocks_warm_every_arm_then_pair_in_the_runs_order() -> None:
    order = block_order(["off", "on"], pairs=3, warm=1)
    assert order == [
        ("off", -1),
        ("on", -1),
        ("off", 0),
        ("on", 0),
        ("on", 1),
        ("off", 1),
        ("off", 2),
        ("on", 2),
    ]


def test_runs_alternate_the_order_so_every_pair_boundary_repeats_an_arm() -> None:
    order = run_order(["off", "on"], 4)
    assert order == [
        ("off", 0),
        ("on", 0),
        ("on", 1),
        ("off", 1),
        ("off", 2),
        ("on", 2),
        ("on", 3),
        ("off", 3),
    ]
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
        slots += [
            _slot("on", "off", pair, half_a * cost, half_b),
            _slot("off", "on", pair, half_a, half_b * cost),
        ]
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


def test_runs_stop_at_the_budget_and_write_their_figures_after_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 s runs (20 s pairs) and 75 s: the warm-up and three pairs run (70 s), a fourth would end past
    it. The results after the last run hold every run, the on/off ratio and the A/A of adjacent runs."""
    clock = [0.0]

    def one_run(cfg: dict[str, Any], arm: str, i: int, work: str, a: argparse.Namespace) -> dict[str, Any]:
        clock[0] += 10.0
        assert cfg["steps"] == (3 if i < a.warm else 40)  # a warm-up run only compiles
        step = 0.105 if arm == "on" else 0.1
        return {"arm": arm, "p99_s": step * 1.1, "wall_s": 10.0, "long": [], "times": [step] * 20}

    monkeypatch.setattr(overhead, "one_run", one_run)
    saved: list[dict[str, Any]] = []
    a = argparse.Namespace(max_s=75.0, warm=1)
    cfg = {"pairs": 10, "steps": 40, "skip": 10}
    result = overhead.runs_design(
        cfg,
        ["off", "on"],
        a,
        str(tmp_path),
        lambda r: saved.append(json.loads(json.dumps(r))),
        clock=lambda: clock[0],
    )
    assert result["pairs_done"] == 3 and len(result["runs"]) == 6 and len(saved) == 6
    assert result["ratios"]["on"]["median"] == pytest.approx(1.05)
    assert result["ratios"]["aa"]["pairs"] == 2 and result["ratios"]["aa"]["median"] == pytest.approx(1.0)
    assert saved[2]["pairs_done"] == 1 and "aa" not in saved[1]["ratios"]
    assert result["p99_pooled"]["on"] == pytest.approx(1.05)


def test_merged_results_pool_their_pairs(tmp_path: Path) -> None:
    """Two results' runs: the pairs are numbered on and every figure is recomputed over all of them."""

    def result(ratio: float, pairs: int) -> dict[str, Any]:
        runs = [
            {"arm": arm, "pair": p, "p99_s": 0.1, "times": [0.1 * (ratio if arm == "on" else 1.0)] * 5}
            for arm, p in run_order(["off", "on"], pairs)
        ]
        return {
            "config": "gpu",
            "design": "runs",
            "arms": ["off", "on"],
            "wall_s": 100.0,
            **overhead.summarize_runs(runs, ["off", "on"], "runs"),
        }

    paths = []
    for i, (ratio, pairs) in enumerate(((1.01, 4), (1.03, 3))):
        paths.append(str(tmp_path / f"r{i}.json"))
        Path(paths[-1]).write_text(json.dumps(result(ratio, pairs)))
    merged = overhead.merge(paths)
    assert merged["pairs_done"] == 7 and merged["wall_s"] == 200.0
    assert sorted({r["pair"] for r in merged["runs"]}) == list(range(7))
    assert merged["ratios"]["on"]["ratios"] == pytest.approx([1.01] * 4 + [1.03] * 3)
    assert merged["ratios"]["aa"]["pairs"] == 5  # 3 + 2 within the results, none across their boundary
