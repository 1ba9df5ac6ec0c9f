"""Straggler at 1,024 and 8,192 simulated ranks (``testkit.straggler_sim``): how soon a 1.5x rank is
confirmed, its score for 1 to 8 gradient buckets a step, false alerts over long clean runs, and dense
faults (half the job slow, every other rank, 64 scattered; half the replicas in dp x tp8 and pp4 x dp):
the ranks that raise, those named, and the splits reported with no culprit ("no majority").

``python -m benchmarks.straggler_sim [--ranks 1024,8192] [--clean-passes 300] [--dense-only]``. Steps of 0.3 s, an
exchange every 10 steps (3 s) from the job's first step (confirmed: the second consecutive exchange
whose verdict is active; warm-up, compiles and the exchange's own delays left out); the judged ranks are those whose views hold the slow rank plus 48 spread
over the job (``cover``); a clean run judges 64 spread ranks. Times are simulated job time, not the
store's (``benchmarks/store_load.py`` measures that).
"""

from __future__ import annotations

import argparse

from testkit.straggler_sim import (
    HEAVY,
    HEAVY_GPUS,
    MILD,
    Job,
    StragglerSim,
    cover,
    fired,
    first_fired_pass,
    named,
)

STEP_S = 0.3


def confirm(n: int, noise_name: str, buckets: int) -> str:
    noise = {"mild": MILD, "heavy": HEAVY, "heavy+gpus": HEAVY_GPUS}[noise_name]
    slow = n // 2 + 3
    job = Job(dp=n, buckets=buckets, noise=noise, slow={slow: 1.5})
    sim = StragglerSim(job, cover(job))
    history = sim.run(8, fill=False)  # from the job's start: an exchange every 10 steps
    at = first_fired_pass(history, slow)
    steps = ((at or 0) + 1) * job.steps_per_pass
    others = named(history) - {slow}
    when = f"{steps * STEP_S:.0f} s ({steps} steps)" if at is not None else "not confirmed"
    score = history[-1][slow].value if slow in history[-1] else float("nan")
    return f"| {n} | {noise_name} | {buckets} | {score:.3f} | {when} | {len(others)} |"


def clean(n: int, passes: int) -> str:
    job = Job(dp=n, buckets=2, noise=HEAVY_GPUS, seed=1)
    judged = set(range(0, n, max(1, n // 64)))
    sim = StragglerSim(job, judged)
    history = sim.run(passes)
    top = max(v.value for vs in history for v in vs.values())
    return f"| {n} | heavy+gpus | {passes} | {len(fired(history))} | {len(named(history))} | {top:.3f} |"


def dense(n: int, case: str) -> str:
    """One dense fault, 1.5x, mild noise, 2 buckets, 3 exchanges; judged: 16 spread replicas and the
    next (every rank whose view holds a slow one, for the scattered case)."""
    tp, pp = {"dp x tp8": (8, 1), "pp4 x dp": (1, 4)}.get(case.split(": ")[0], (1, 1))
    per = tp * pp
    dp = n // per
    slow = {
        "half": set(range(n // 2)),
        "every other": set(range(0, n, 2)),
        "64 scattered": set(range(7, n, n // 64)),
    }.get(case.split(": ")[-1], set(range(n // 2)))
    job = Job(dp=dp, tp=tp, pp=pp, buckets=2, noise=MILD, slow=dict.fromkeys(slow, 1.5))
    if case == "64 scattered":
        judged = cover(job)
    else:
        reps = {(r + d) % dp for r in range(0, dp, max(1, dp // 16)) for d in (0, 1)}
        judged = {rep * per + i for rep in reps for i in range(per)}
    history = StragglerSim(job, judged).run(3)
    last = history[-1]
    splits = {r: v.details["split"] for r, v in last.items() if v.active and "split" in v.details}
    wrong = sum(1 for s in splits.values() if set(s["slower"]) - slow or set(s["faster"]) & slow)
    raised, got = fired(history), named(history)
    return (
        f"| {n} | {case} | {len(slow & judged)} of {len(slow)} | {len(raised & slow)} | {len(raised - slow)} "
        f"| {len(got & slow)} | {len(got - slow)} | {len(splits)} | {wrong} |"
    )


DENSE = ("half", "every other", "64 scattered", "dp x tp8: half", "pp4 x dp: half")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1024,8192")
    ap.add_argument("--clean-passes", type=int, default=300)
    ap.add_argument("--dense-only", action="store_true", help="only the dense faults' table")
    a = ap.parse_args()
    sizes = [int(x) for x in a.ranks.split(",")]
    print(
        "| ranks | slow | slow judged | slow raised | healthy raised | slow named | healthy named "
        "| splits reported | splits wrong |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        for case in DENSE:
            print(dense(n, case), flush=True)
    if a.dense_only:
        return
    print()
    print("| ranks | noise | buckets | score of the 1.5x rank | confirmed after | healthy named |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        for noise in ("mild", "heavy", "heavy+gpus"):
            for k in (1, 2, 4, 8):
                print(confirm(n, noise, k), flush=True)
    print()
    print("| ranks | noise | passes | ranks fired | ranks named | highest score |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        print(clean(n, a.clean_passes), flush=True)


if __name__ == "__main__":
    main()
