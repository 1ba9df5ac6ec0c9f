"""Straggler at 1,024 and 8,192 simulated ranks (``testkit.straggler_sim``): how soon a 1.5x rank is
confirmed, its score for 1 to 8 gradient buckets a step, and false alerts over long clean runs.

``python -m benchmarks.straggler_sim [--ranks 1024,8192] [--clean-passes 300]``. Steps of 0.3 s, an
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1024,8192")
    ap.add_argument("--clean-passes", type=int, default=300)
    a = ap.parse_args()
    sizes = [int(x) for x in a.ranks.split(",")]
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
