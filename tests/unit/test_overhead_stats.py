"""The overhead benchmark's interval of the median: exact order-statistic coverage, not a bootstrap's claim."""

from __future__ import annotations

import pytest

from benchmarks.overhead import median_interval, p99, ratio_stats


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


def test_ratio_stats_reports_the_coverage() -> None:
    st = ratio_stats([1.0, 1.1, 0.9])
    assert (st["ci_lo"], st["ci_hi"], st["ci_coverage"]) == (0.9, 1.1, 0.75)
    assert "ci95_lo" not in st


def test_p99_interpolates_and_stays_within_range() -> None:
    assert p99([0.0, 1.0]) == pytest.approx(0.99)
    assert p99([5.0]) == 5.0
