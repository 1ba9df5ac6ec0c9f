"""Is run B slower than run A? The ratio of their median step times with a block-bootstrap interval.

Steps of one run are not independent draws: a slow phase (another job on the node, a page-cache
flush, the allocator growing) lasts several steps. An i.i.d. bootstrap or a Mann-Whitney test on raw
steps takes each step as fresh evidence and calls a slow phase significant. A circular block bootstrap
(Politis & Romano) resamples runs of ``block`` consecutive steps instead, so the interval keeps the
series' own correlation; the block length follows the autocorrelation (the first lag after which it
stays inside its noise band, as in Politis & White's rule), never under n^(1/3).

Why numpy by hand: ``scipy.stats.bootstrap`` and ``scipy.stats.mannwhitneyu`` assume independent
samples; the block bootstraps of ``arch`` fit but pull in scipy, pandas and statsmodels for a CLI that
needs 40 lines. numpy is already a dependency.

What the interval cannot see is a shift between two runs that stays flat within each (another job on
the machine for the whole of one run). The minimum effect (``compare --max-regression``) is for that:
a regression is a change whose interval excludes no change and whose estimate exceeds the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Two-sided coverage of the interval.
LEVEL = 0.95
RESAMPLES = 2000
#: Steps a run needs before its median gets an interval.
MIN_STEPS = 10
#: Fixed: the same two runs always get the same interval and verdict.
SEED = 0


@dataclass(frozen=True)
class Change:
    """B's median over A's, with its interval."""

    ratio: float
    low: float
    high: float
    median_a: float
    median_b: float
    n_a: int
    n_b: int
    block_a: int
    block_b: int

    def verdict(self, limit: float) -> str:
        """``regressed`` (slower, past ``limit``), ``slower`` (within it), ``faster``, or ``no change``
        (the interval holds 1)."""
        if self.low > 1:
            return "regressed" if self.ratio - 1 > limit else "slower"
        if self.high < 1:
            return "faster"
        return "no change"


def block_length(x: np.ndarray) -> int:
    """Steps per resampled block: twice the lag after which the autocorrelation stays within
    ``2 sqrt(log10(n) / n)`` for K lags (Politis & White's m-hat), at least n^(1/3), at most n/4."""
    n = len(x)
    floor = max(1, math.ceil(n ** (1 / 3)))
    cap = max(1, n // 4)
    z = x - x.mean()
    denom = float(z @ z)
    if n < 8 or denom == 0:
        return min(floor, cap)
    lags = cap
    acf = np.array([float(z[:-k] @ z[k:]) / denom for k in range(1, lags + 1)])
    band = 2 * math.sqrt(math.log10(n) / n)
    run = max(5, math.ceil(math.sqrt(math.log10(n))))
    inside = np.abs(acf) < band
    m = next((k for k in range(lags) if inside[k : k + run].all()), lags)
    return int(min(max(floor, 2 * m), cap))


def _boot_medians(x: np.ndarray, block: int, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Medians of ``resamples`` circular block-bootstrap series of ``x``."""
    n = len(x)
    blocks = -(-n // block)
    starts = rng.integers(0, n, size=(resamples, blocks))
    idx = (starts[:, :, None] + np.arange(block)).reshape(resamples, blocks * block)[:, :n] % n
    return np.median(x[idx], axis=1)


def compare_medians(
    a: np.ndarray,
    b: np.ndarray,
    *,
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    block: int | None = None,
) -> Change:
    """The ratio median(b) / median(a) and its percentile interval from independent block bootstraps
    of the two series (in step order). ``block`` overrides the chosen length (tests: 1 is i.i.d.).
    ``ValueError`` with fewer than ``MIN_STEPS`` positive values in either."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    for name, x in (("A", a), ("B", b)):
        if len(x) < MIN_STEPS or not np.all(np.isfinite(x)) or not np.all(x > 0):
            raise ValueError(
                f"run {name}: {len(x)} steps, an interval needs {MIN_STEPS} positive finite ones"
            )
    rng = np.random.default_rng(seed)
    ba, bb = block or block_length(a), block or block_length(b)
    ratios = _boot_medians(b, bb, rng, resamples) / _boot_medians(a, ba, rng, resamples)
    low, high = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    ma, mb = float(np.median(a)), float(np.median(b))
    return Change(mb / ma, float(low), float(high), ma, mb, len(a), len(b), ba, bb)


__all__ = ["LEVEL", "MIN_STEPS", "Change", "block_length", "compare_medians"]
