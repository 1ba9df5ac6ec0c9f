"""Whether ReplicaDivergence and CompileDivergence name the right ranks at every density of fault, at
1,024 and 8,192 simulated ranks and at the sizes where n/5 is a multiple of a node (1,280, 2,560).

The real detectors judge every simulated rank on the payloads of its real comparison peers
(``testkit.detection_sim``). A case passes where the ranks named are exactly the faulty ones, or, for
a dense fault (half the job, every other rank), where no healthy rank is named and the split is
reported ("culprit unknown: no majority"). ``tests/unit/detectors/test_detection_sim_faults.py`` holds
the same cases at 1,024 ranks in CI.

  python -m benchmarks.fault_density --ranks 1024 8192 --json fault_density.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.common import write_rows
from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence
from testkit.detection_sim import diverge, job, judge, named, raised

DETECTORS = {"replica": ReplicaDivergence, "compile": CompileDivergence}


def cases(n: int) -> list[tuple[str, str, list[tuple[str, int]], set[int], bool]]:
    """(case, detector, layout, faulty ranks, dense: a split may stand for the culprits) at ``n`` ranks."""
    flat = [("dp", n)]
    out = []
    for det in DETECTORS:
        out += [
            (f"{det}: one GPU of every node", det, flat, {r for r in range(n) if r % 8 == 3}, False),
            (f"{det}: half the job (contiguous)", det, flat, set(range(n // 2)), True),
            (f"{det}: every other rank", det, flat, set(range(0, n, 2)), True),
            (f"{det}: {n // 128} scattered", det, flat, {(i * 389 + 17) % n for i in range(n // 128)}, False),
        ]
    node = n // 8 // 3 * 8  # a node of dp x tp8, a third into the job
    out.append(
        (
            "compile: a node of dp x tp8",
            "compile",
            [("dp", n // 8), ("tp", 8)],
            set(range(node, node + 8)),
            False,
        )
    )
    return out


def run_case(det: str, dims: list[tuple[str, int]], wrong: set[int], dense: bool) -> dict[str, Any]:
    grid, ranks = job(dims)
    detector = DETECTORS[det]
    diverge(detector, ranks, wrong)
    t0 = time.perf_counter()
    verdicts = judge(detector, grid, ranks)
    seconds = time.perf_counter() - t0
    got = named(verdicts)
    splits = {r for r, v in verdicts.items() if v.active and v.details.get("culprit_unknown")}
    exact = got == wrong
    ok = exact or (dense and got <= wrong and bool(splits))
    return {
        "faulty": len(wrong),
        "named": len(got),
        "healthy_named": len(got - wrong),
        "faulty_missed": len(wrong - got),
        "split_reported_on": len(splits),
        "healthy_raised_without_split": len((raised(verdicts) - wrong) - splits),
        "exact": exact,
        "ok": ok,
        "judge_s": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--blind", type=int, nargs="*", default=[1280, 2560], help="sizes where n/5 is 8k")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    plan = [(n, c) for n in args.ranks for c in cases(n)]
    plan += [(n, c) for n in args.blind for c in cases(n) if "one GPU" in c[0]]
    print(
        f"{'ranks':>6}  {'case':<36} {'faulty':>6} {'named':>6} {'healthy':>7} {'missed':>6} {'split':>6}  ok"
    )
    for n, (name, det, dims, wrong, dense) in plan:
        row = {"ranks": n, "case": name, **run_case(det, dims, wrong, dense)}
        rows.append(row)
        print(
            f"{n:>6}  {name:<36} {row['faulty']:>6} {row['named']:>6} {row['healthy_named']:>7} "
            f"{row['faulty_missed']:>6} {row['split_reported_on']:>6}  {'yes' if row['ok'] else 'NO'}",
            flush=True,
        )
    if args.json:
        write_rows(args.json, "fault_density", argv, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
