"""The twin benchmark's estimator: the two core halves' own speeds and the machine's swings cancel,
the agent's cost does not."""

from __future__ import annotations

import pytest

from benchmarks.twin import (
    common_seconds,
    pair_estimates,
    pooled_p99,
    pooled_p99_interval,
    slot_order,
    summarize,
)


def test_every_pair_runs_each_arm_on_both_halves_against_off_alternating_order() -> None:
    order = slot_order(["off", "on", "aa"], 2)
    assert order[:4] == [("on", "off", 0), ("off", "on", 0), ("aa", "off", 0), ("off", "aa", 0)]
    assert order[4:] == [("off", "on", 1), ("on", "off", 1), ("off", "aa", 1), ("aa", "off", 1)]


def _slot(a: str, b: str, pair: int, va: float, vb: float) -> dict[str, object]:
    return {"a": a, "b": b, "pair": pair, "A": {"median_s": va}, "B": {"median_s": vb}}


def test_half_speeds_and_machine_swings_cancel_and_the_cost_remains() -> None:
    slots = []
    for pair, machine in enumerate((1.0, 1.3, 0.8)):  # the whole machine 30 % slower, then 20 % faster
        half_a, half_b, cost = 0.070 * machine, 0.077 * machine, 1.02  # half B 10 % slower than A
        slots += [_slot("on", "off", pair, half_a * cost, half_b), _slot("off", "on", pair, half_a, half_b * cost)]
        slots += [_slot("aa", "off", pair, half_a, half_b), _slot("off", "aa", pair, half_a, half_b)]
    est = pair_estimates(slots, "median_s")
    assert est["on"] == pytest.approx({0: 1.02, 1: 1.02, 2: 1.02})
    assert est["aa"] == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0})
    st = summarize(slots)
    assert st["on"]["median"] == pytest.approx(1.02) and st["on"]["pairs"] == 3


def test_a_pair_missing_a_slot_or_a_value_gives_no_estimate() -> None:
    slots = [_slot("on", "off", 0, 1.0, 1.0), _slot("on", "off", 1, 1.0, 1.0), _slot("off", "on", 1, 1.0, 1.0)]
    slots.append({"a": "off", "b": "on", "pair": 0, "A": {"median_s": None}, "B": {"median_s": 1.0}})
    assert pair_estimates(slots, "median_s") == {"on": {1: 1.0}}


def test_common_seconds_keeps_the_steps_both_runs_took_in_the_same_seconds() -> None:
    fast = {"step_starts": [float(i) for i in range(30)], "step_times": [1.0] * 30}  # 0..30 s
    late = {"step_starts": [10.0 + 2 * i for i in range(20)], "step_times": [2.0] * 20}  # 10..50 s
    a, b = common_seconds([fast, late], skip=2)  # kept: fast from 2 s, late from 14 s; common 14..30 s
    assert a == [1.0] * 16  # fast's steps starting at 14..29 s
    assert b == [2.0] * 18  # late has only 8 in those seconds: fewer than 10, so all 18 it kept
    late["step_times"] = [1.0] * 20  # late now ends at 49 s; common 14..30 s holds 8 of its steps still
    fast["step_starts"], fast["step_times"] = [float(i) for i in range(60)], [1.0] * 60  # 0..60 s
    a, b = common_seconds([fast, late], skip=2)  # common 14..49 s: 35 of fast's, 18 of late's
    assert len(a) == 35 and len(b) == 18


def test_pooled_p99_is_the_geometric_mean_over_the_halves() -> None:
    def blocks(arm_times: list[tuple[str, list[float]]]) -> list[dict[str, object]]:
        return [{"arm": arm, "pair": 0, "times": t} for arm, t in arm_times]

    a = blocks([("on", [0.0] + [1.1] * 50), ("off", [0.0] + [1.0] * 50)])
    b = blocks([("off", [0.0] + [2.0] * 50), ("on", [0.0] + [2.2] * 50)])
    assert pooled_p99([a, b], ["off", "on"], skip=1) == {"on": pytest.approx(1.1)}


def test_the_pooled_p99s_interval_shows_when_one_pairs_stall_carries_it() -> None:
    """Ten pairs with on 5 % slower throughout: a narrow interval at 1.05. The same with one pair's on
    block stalled: the pooled p99 jumps, and the resampled pairs show how much it rests on that pair."""
    def halves(stall: bool) -> list[list[dict[str, object]]]:
        out: list[list[dict[str, object]]] = [[], []]
        for pair in range(10):
            for half in out:
                on = [1.05 * (1.0 + 0.001 * i) for i in range(60)]
                if stall and pair == 3:  # more stalled steps than a pooled p99's top 1 % of 600
                    on[-10:] = [3.0] * 10
                half += [{"arm": "on", "pair": pair, "times": on},
                         {"arm": "off", "pair": pair, "times": [1.0 + 0.001 * i for i in range(60)]}]
        return out

    lo, hi = pooled_p99_interval(halves(False), ["off", "on"], skip=0)["on"]
    assert lo == pytest.approx(1.05, abs=1e-3) and hi == pytest.approx(1.05, abs=1e-3)
    stalled = halves(True)
    assert pooled_p99(stalled, ["off", "on"], skip=0)["on"] > 1.05
    lo, hi = pooled_p99_interval(stalled, ["off", "on"], skip=0)["on"]
    assert lo == pytest.approx(1.05, abs=1e-3) and hi > 1.5  # draws without pair 3 / with it twice or more
    assert pooled_p99_interval([h[:4] for h in stalled], ["off", "on"], skip=0) == {}  # 2 pairs: none


def test_runs_stop_before_a_pair_that_would_end_past_max_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device call's limit is hard: with 10 s slots (20 s pairs) and 65 s, the warm-up and two pairs
    run (50 s) and the third, which would end at 70 s, does not start."""
    import argparse

    from benchmarks import twin

    clock = [1000.0]
    ran: list[str] = []

    def slot(a: str, b: str, *_: object) -> dict[str, object]:
        clock[0] += 10.0
        ran.append(f"{a}/{b}")
        return {h: {"median_s": 0.07, "p99_s": 0.08, "steps": 100} for h in twin.HALVES}

    monkeypatch.setattr(twin, "run_slot", slot)
    args = argparse.Namespace(max_s=65.0, variants={}, timeout=60.0)
    slots = twin.runs_design({"pairs": 10}, ["off", "on"], args, ([0], [1]), "unused", clock=lambda: clock[0])
    assert [s["pair"] for s in slots] == [0, 0, 1, 1]
    assert len(ran) == 5 and clock[0] - 1000.0 <= 65.0  # the warm-up slot and two pairs
