"""Hang's culprit in long pipelines, in the detection simulation (``testkit.detection_sim``: the real
detector on each rank's real comparison peers and a store it reads on demand): one rank asleep
mid-step, pass after pass, how many ranks name it, say "unknown", or name another rank, and what the
chain's reads on demand cost (store reads a pass, ranks' ``s`` a read).

    python -m benchmarks.pipeline_hang                      # pp 16, 64, 256 and dp4 x pp16 (~1 min)
    python -m benchmarks.pipeline_hang --layouts pp64 --passes 1
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import write_rows

LAYOUTS = {
    "pp16": [("pp", 16)],
    "pp64": [("pp", 64)],
    "pp256": [("pp", 256)],
    "dp4xpp16": [("pp", 16), ("dp", 4)],
}


def row(layout: str, where: str, passes: int) -> dict[str, Any]:
    from hpar_agent.detectors.liveness import Hang
    from testkit.detection_sim import hang_in_pipeline, job, judge

    dims = LAYOUTS[layout]
    grid, ranks = job(dims)
    line = grid.group(len(grid.ranks) // 2, "pp")  # a pipeline in the middle of the job
    culprit = {"first": line[0], "middle": line[len(line) // 2], "last": line[-1]}[where]
    hang_in_pipeline(grid, ranks, culprit)
    fetched: dict[int, list[list[int]]] = {}
    verdicts = judge(Hang, grid, ranks, stalled_s=60.0, fetched=fetched, passes=passes, timeout_s=30)
    named = [r for r, v in verdicts.items() if v.details["culprits"] == [culprit]]
    unknown = [r for r, v in verdicts.items() if v.details["kind"] == "unknown"]
    return {
        "layout": layout,
        "culprit": culprit,
        "where": where,
        "passes": passes,
        "ranks": len(verdicts),
        "named": len(named),
        "unknown": len(unknown),
        "wrong": len(verdicts) - len(named) - len(unknown),
        "reads_max": max((len(reads) for reads in fetched.values()), default=0),
        "ranks_per_read_max": max((len(x) for reads in fetched.values() for x in reads), default=0),
        "ranks_read_max": max((sum(len(x) for x in reads) for reads in fetched.values()), default=0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--passes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    print(
        "| layout | rank asleep | passes | ranks | name it | unknown | name another | store reads "
        "(all passes, most of a rank) | ranks' s a read (most) | ranks' s read (most of a rank) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows, wrong = [], 0
    for layout in args.layouts:
        for where in ("middle", "last"):
            for passes in args.passes:
                r = row(layout, where, passes)
                rows.append(r)
                wrong += r["wrong"]
                print(
                    f"| {layout} | {r['culprit']} ({where}) | {passes} | {r['ranks']} | {r['named']} "
                    f"| {r['unknown']} | {r['wrong']} | {r['reads_max']} | {r['ranks_per_read_max']} "
                    f"| {r['ranks_read_max']} |",
                    flush=True,
                )
    if args.json:
        write_rows(args.json, "pipeline_hang", argv, rows)
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
