"""Where in time an arm's cost sits: the steps that contain an instant of a wall-clock grid against the
others, by arm, from the JSON of a blocks design (``overhead --design blocks`` or ``twin --design
blocks``, whose blocks keep each step's wall-clock end).

The agent's passes start at every ``HPAR_INTERVAL`` multiple of the wall clock on every rank, and the
``--spin`` arm's bursts at every PERIOD_MS multiple; a cost paid at those instants shows as a longer step
where a step contains one, and none elsewhere. Each step is taken as its excess over its own block's
median (kept steps only), so the machine's slow and fast phases cancel.

    python -m benchmarks.instant_steps twin-spin.json --period 1    # the agent's passes
    python -m benchmarks.instant_steps twin-spin.json --period 2    # --spin 50/2000's bursts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def blocks_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every block of a result, whichever design wrote it (``twin``: one list a half)."""
    blocks = result.get("blocks") or []
    if blocks and isinstance(blocks[0], list):
        return [b for half in blocks for b in half]
    return list(blocks)


def excess_by_instant(
    blocks: list[dict[str, Any]], period_s: float, skip: int, exclude_pairs: frozenset[int] = frozenset()
) -> dict[str, dict[bool, list[float]]]:
    """arm -> (step contains a ``period_s`` multiple of the wall clock) -> each kept step's excess over
    its block's median, in ms. Warm-up blocks (pair < 0) and ``exclude_pairs`` are left out."""
    period_ns = int(period_s * 1e9)
    out: dict[str, dict[bool, list[float]]] = {}
    for b in blocks:
        if b.get("pair", -1) < 0 or b["pair"] in exclude_pairs or not b.get("ends"):
            continue
        times, ends = b["times"][skip:], b["ends"][skip:]
        if not times:
            continue
        med = statistics.median(times)
        by = out.setdefault(b["arm"], {True: [], False: []})
        for t, end in zip(times, ends, strict=True):
            start = end - int(t * 1e9)
            by[end // period_ns * period_ns >= start].append((t - med) * 1e3)
    return out


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"steps": len(v), "mean_ms": statistics.mean(v), "median_ms": statistics.median(v),
            "p90_ms": v[int(0.9 * (len(v) - 1))]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a blocks design's --json output")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between the instants (default 1: HPAR_INTERVAL)")
    ap.add_argument("--skip", type=int, default=-1, help="steps left out at a block's start (default: the run's block_skip)")
    ap.add_argument("--exclude-pairs", default="", metavar="N,N", help="pairs left out (a stall every arm shared)")
    a = ap.parse_args(argv)
    result = json.loads(Path(a.json).read_text())
    skip = a.skip if a.skip >= 0 else int(result.get("block_skip", 3))
    excl = frozenset(int(x) for x in a.exclude_pairs.split(",") if x)
    by_arm = excess_by_instant(blocks_of(result), a.period, skip, excl)
    if not by_arm:
        print("no blocks with step ends in this file", file=sys.stderr)
        return 1
    print(f"excess over the block's median (ms), steps containing a {a.period:g} s instant of the wall clock vs the others")
    for arm, by in sorted(by_arm.items()):
        for hit in (True, False):
            if by[hit]:
                s = summary(by[hit])
                print(f"  {arm:8} {'at an instant' if hit else 'elsewhere':14} {s['steps']:5d} steps  mean {s['mean_ms']:6.2f}"
                      f"  median {s['median_ms']:6.2f}  p90 {s['p90_ms']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
