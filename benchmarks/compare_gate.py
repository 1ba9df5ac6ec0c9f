"""How often ``hpar-agent compare`` is right on real runs: false alarms between identical runs, and
misses of a planted slowdown.

Each of ``--pairs`` rounds runs three jobs of one program, a 2-rank gloo DDP training loop of
``tiny_gpt.py``'s model under ``hpar-agent run``: A and A2 (identical) and B, which spins for
``--slowdown`` of each step's own time after the step: that much more work a step, as a slower kernel
would add. The order of the three rotates from round to round, so a drift of the machine falls on
every arm alike. Each round compares A with A2 (a regression there is a false alarm) and A with B (no
regression there is a miss), with the gate's defaults unless ``--max-regression`` says otherwise.

    python -m benchmarks.compare_gate --pairs 20 --steps 100 --out-dir runs --json gate.json
    python -m benchmarks.compare_gate --pairs 20 --out-dir runs --rejudge --max-regression 10%

The worker (``python -m benchmarks.compare_gate worker``) is what torchrun starts on each rank.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("A", "A2", "B")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.tiny_gpt import PRESETS, TinyGPT

    p = PRESETS["cpu"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    vocab, seq = int(p["vocab"]), int(p["seq_len"])
    model = DDP(TinyGPT(vocab, seq, int(p["dim"]), int(p["heads"]), int(p["layers"])))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
    data = torch.randint(0, vocab, (16, int(p["batch"]), seq + 1))
    for it in range(a.steps):
        t0 = time.perf_counter()
        batch = data[it % len(data)]
        loss = F.cross_entropy(model(batch[:, :-1]).view(-1, vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if a.slowdown:  # more work, as a slower kernel would add (a sleep would hand the CPU to the others)
            until = time.perf_counter() + a.slowdown * (time.perf_counter() - t0)
            while time.perf_counter() < until:
                pass
    dist.destroy_process_group()


def _run(run_dir: Path, steps: int, slowdown: float) -> None:
    cmd = [
        sys.executable,
        *"-m hpar_agent run --run-dir".split(),
        str(run_dir),
        "--",
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.compare_gate worker --steps".split(),
        str(steps),
        "--slowdown",
        str(slowdown),
    ]
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HPAR_METRICS_PORT": "-1", "PYTHONPATH": path}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if res.returncode:
        sys.exit(f"{run_dir.name} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _describe(changes: list[float]) -> str:
    s = sorted(changes)
    if not s:
        return "-"
    return f"median {s[len(s) // 2]:+.1%}, min {s[0]:+.1%}, max {s[-1]:+.1%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--slowdown", type=float, default=0.10, help="B's planted slowdown (0.10: every step 10%% slower)"
    )
    ap.add_argument("--max-regression", default="5%", help="the gate's limit (default 5%%)")
    ap.add_argument(
        "--out-dir", default=None, help="keep the run directories here (default: a temporary one)"
    )
    ap.add_argument(
        "--rejudge",
        action="store_true",
        help="run nothing: judge the runs an earlier invocation kept in --out-dir (e.g. with another limit)",
    )
    ap.add_argument("--json", default=None, help="write every comparison and the counts here")
    a = ap.parse_args(argv)
    from benchmarks.common import finish, results
    from hpar_agent.tools.compare import compare, parse_threshold

    if a.rejudge and not a.out_dir:
        ap.error("--rejudge needs the --out-dir of the runs")
    limit = parse_threshold(a.max_regression)
    r = results("compare_gate", "cpu", argv, pairs=a.pairs, steps=a.steps, slowdown=a.slowdown, limit=limit)
    base = Path(a.out_dir or tempfile.mkdtemp(prefix="compare-gate-"))
    rows: list[dict[str, Any]] = []
    for i in range(a.pairs):
        dirs = {arm: base / f"{i:02d}-{arm}" for arm in ARMS}
        for arm in [] if a.rejudge else ARMS[i % 3 :] + ARMS[: i % 3]:
            _run(dirs[arm], a.steps, a.slowdown if arm == "B" else 0.0)
        for kind, other in (("identical", "A2"), ("slower", "B")):
            res = compare(dirs["A"], dirs[other], ("step",), limit)
            j = res.judged[0] if res.judged else None
            c = j.change if j is not None else None
            row: dict[str, Any] = {
                "round": i,
                "kind": kind,
                "status": res.status,
                "verdict": j.verdict(limit) if j else "unknown",
                "cpu_wait": [res.a.figures.get("cpu_wait"), res.b.figures.get("cpu_wait")],
                "change": c.ratio - 1 if c else None,
                "low": c.low - 1 if c else None,
                "high": c.high - 1 if c else None,
            }
            rows.append(row)
            print(
                f"round {i:2d} {kind:9s} exit {row['status']} {row['verdict']:9s} "
                + (f"{c.ratio - 1:+.1%} ({c.low - 1:+.1%} .. {c.high - 1:+.1%})" if c else "")
                + f"  CPU wait {_pct(row['cpu_wait'][0])} / {_pct(row['cpu_wait'][1])}",
                flush=True,
            )
    r["rows"] = rows
    print()
    for kind in ("identical", "slower"):
        mine = [x for x in rows if x["kind"] == kind]
        codes = {code: sum(x["status"] == code for x in mine) for code in (0, 1, 2)}
        r[f"{kind}_exit_codes"] = codes
        print(
            f"{kind}: exit 0 (no regression) {codes[0]}, exit 1 (regression) {codes[1]}, exit 2 (unknown) "
            f"{codes[2]} of {len(mine)}; change {_describe([x['change'] for x in mine if x['change'] is not None])}"
        )
        for side, busier in (("A", lambda w: w[0] > w[1]), ("B", lambda w: w[1] > w[0])):  # load's direction
            some = [x for x in mine if None not in x["cpu_wait"] and busier(x["cpu_wait"])]
            by = {code: sum(x["status"] == code for x in some) for code in (0, 1, 2)}
            r[f"{kind}_exit_codes_{side}_busier"] = by
            print(
                f"  {'A (the baseline)' if side == 'A' else 'B'} waited more: exit 0/1/2 {by[0]}/{by[1]}/{by[2]} of {len(some)}"
            )
    finish(r, a.json)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        wp = argparse.ArgumentParser()
        wp.add_argument("--steps", type=int, default=100)
        wp.add_argument("--slowdown", type=float, default=0.0)
        worker(wp.parse_args(sys.argv[2:]))
    else:
        raise SystemExit(main())
