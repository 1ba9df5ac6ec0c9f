"""RankGone's margin and time to name across job sizes, in the detection simulation
(``testkit.detection_sim.silence_named``: the real detector on the exchange's real cadence, a 1 s pass):
for ranks spread over the cadence's offsets, the seconds from a dead rank's last publish to the pass
at which each of its readers' alert fires (its first verdict naming it, the detector's ``confirm``
counted), and the verdicts naming a live rank that skipped one exchange and was a late pass on the
next, or was one exchange and a late pass late on one.

    python -m benchmarks.rankgone_sweep                         # 1,024 to 8,192 ranks, 16 ranks each
    python -m benchmarks.rankgone_sweep --ranks 8192 --subjects 64
"""

from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.common import write_rows


def sweep(n: int, subjects: int) -> dict[str, float]:
    from hpar_agent.crossrank import cadence
    from hpar_agent.detectors.liveness import LATE_S
    from hpar_agent.thresholds import COMPONENT_DEFAULTS
    from testkit.detection_sim import silence_named

    cad = cadence(n, COMPONENT_DEFAULTS["exchange_s"], 1.0)
    every = cad.interval_s
    times: list[float] = []
    early = false = 0
    for i in range(subjects):
        subject = (i * n) // subjects + i % 7  # over the job and the cadence's offsets
        k, off = cad.offset(subject)
        last = 2 * every + k + off
        for at in silence_named(n, subject, lambda e: 0.0 if e <= 2 else None, 7).values():
            times.append(at[0] - last if at else float("inf"))
            early += bool(at) and at[0] - last <= 2 * every + LATE_S
        for late in (
            lambda e: None if e == 2 else (LATE_S - 0.01 if e == 3 else 0.0),
            lambda e: every + LATE_S - 0.01 if e == 2 else 0.0,
        ):
            false += sum(len(at) for at in silence_named(n, subject, late, 7).values())
    return {
        "exchange_s": every,
        "bound_s": 2 * every + LATE_S,
        "min_s": min(times),
        "median_s": statistics.median(times),
        "max_s": max(times),
        "early": early,
        "false": false,
        "readers": len(times),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--subjects", type=int, default=16, help="ranks judged per job size")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    print(
        "| ranks | exchange s | named past s | readers | s from last publish to named (min / median / max) "
        "| named before the bound | verdicts naming a live late rank |"
    )
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for n in args.ranks:
        r = sweep(n, args.subjects)
        rows.append({"ranks": n, **r})
        bad += int(r["early"] + r["false"])
        print(
            f"| {n:,} | {r['exchange_s']:g} | {r['bound_s']:g} | {r['readers']:.0f} "
            f"| {r['min_s']:.1f} / {r['median_s']:.1f} / {r['max_s']:.1f} | {r['early']:.0f} | {r['false']:.0f} |",
            flush=True,
        )
    if args.json:
        write_rows(args.json, "rankgone_sweep", argv, rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
