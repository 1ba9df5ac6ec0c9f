"""The statistics every benchmark report rests on: the median's order-statistic interval with its exact
coverage, paired ratios, the A/A from adjacent runs, the pooled p99 with its resampled interval, the time
budget, threads' CPU clocks, the core halves of twin jobs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from benchmarks.common import (
    PairBudget,
    ThreadClocks,
    adjacent_aa,
    core_halves,
    median_interval,
    p99,
    paired,
    pooled_p99,
    pooled_p99_report,
    ratio_stats,
    thread_group,
)


def test_three_pairs_give_min_max_at_75_percent() -> None:
    assert median_interval([1.02, 0.98, 1.05]) == (0.98, 1.05, 0.75)


def test_nine_pairs_give_second_order_statistics_at_96_percent() -> None:
    lo, hi, cov = median_interval([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0])
    assert (lo, hi) == (2.0, 8.0)
    assert cov == pytest.approx(1 - 2 * 10 / 512) and cov >= 0.95


def test_seven_pairs_give_min_max_at_98_percent() -> None:
    lo, hi, cov = median_interval([3.0, 1.0, 7.0, 2.0, 6.0, 4.0, 5.0])
    assert (lo, hi) == (1.0, 7.0)
    assert cov == pytest.approx(1 - 2 / 128)


def test_ratio_stats_report_the_coverage_with_the_interval() -> None:
    st = ratio_stats([1.0, 1.1, 0.9])
    assert (st["ci_lo"], st["ci_hi"], st["ci_coverage"], st["pairs"]) == (0.9, 1.1, 0.75, 3)
    assert st["median"] == 1.0 and st["sem"] == pytest.approx(0.1 / 3**0.5)


def test_p99_interpolates_and_stays_within_range() -> None:
    assert p99([0.0, 1.0]) == pytest.approx(0.99)
    assert p99([5.0]) == 5.0


def test_paired_ratios_are_within_a_pair_and_leave_the_warm_up_out() -> None:
    runs = [{"arm": "on", "pair": -1, "step_s": 9.0}, {"arm": "off", "pair": -1, "step_s": 1.0}]
    runs += [
        {"arm": a, "pair": p, "step_s": s}
        for p, (off, on) in enumerate([(1.0, 1.1), (2.0, 2.2), (4.0, 4.4)])
        for a, s in (("off", off), ("on", on))
    ]
    runs.append({"arm": "on", "pair": 3, "step_s": 5.0})  # its off never ran: no ratio
    st = paired(runs, ["off", "on", "aa"])
    assert list(st) == ["on"] and st["on"]["pairs"] == 3 and st["on"]["median"] == pytest.approx(1.1)


def test_adjacent_runs_of_one_arm_make_the_aa_with_the_direction_alternating() -> None:
    """ABBA: off on | on off | off on | on off: the pair boundaries repeat on, off, on. A machine that
    slows by 10 % a run shows in each A/A ratio, in turn as 1.1 and 1/1.1: its median stays near 1."""
    order = [("off", 0), ("on", 0), ("on", 1), ("off", 1), ("off", 2), ("on", 2), ("on", 3), ("off", 3)]
    runs = [{"arm": a, "pair": p, "step_s": 1.1**i} for i, (a, p) in enumerate(order)]
    aa = adjacent_aa(runs)
    assert aa == pytest.approx([1.1, 1 / 1.1, 1.1])
    assert (
        adjacent_aa([{"arm": "on", "pair": -1, "step_s": 1.0}, {"arm": "on", "pair": 0, "step_s": 1.0}]) == []
    )


def test_budget_stops_before_a_pair_that_would_end_past_it() -> None:
    """20 s pairs and a 65 s budget: three pairs start (the third ends at 60 s), not a fourth (80 s)."""
    clock = [0.0]
    budget = PairBudget(65.0, clock=lambda: clock[0])
    started = 0
    while budget.pair_starts():
        started += 1
        clock[0] += 20.0
    assert started == 3 and budget.left_s() == pytest.approx(5.0)
    assert PairBudget(0.0).pair_starts() and PairBudget(0.0).left_s() == float("inf")


def test_thread_clocks_read_a_threads_own_cpu_and_keep_it_after_it_ends() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, name="hpar-agent")
    t.start()
    clocks = ThreadClocks([t])
    t0 = clocks.total()
    time.sleep(0.3)
    busy = clocks.total() - t0
    stop.set()
    t.join()
    assert 0.05 < busy < 0.4  # a thread sharing the GIL with this sleeping one: most of 0.3 s
    assert clocks.total() == pytest.approx(t0 + busy, abs=0.05)  # the ended thread's last reading
    assert [thread_group(n) for n in clocks.clocks] == ["agent thread"]
    assert thread_group("OtelBatchSpanRecordProcessor#12") == "span exporter"


def _blocks(pairs: int, on: list[float], stall_pair: int | None = None) -> list[dict[str, Any]]:
    out = []
    for p in range(pairs):
        times = list(on)
        if p == stall_pair:  # more stalled steps than a pooled p99's top 1 %
            times[-10:] = [3.0] * 10
        out += [
            {"arm": "on", "pair": p, "times": times},
            {"arm": "off", "pair": p, "times": [1.0 + 0.001 * i for i in range(60)]},
        ]
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
