"""How long the agent thread holds the GIL between two hand-backs, per rank of a torchrun job, and which
units of work the long holds are.

A paced pass (``hpar_agent.gil``) hands the GIL back once it has held it ~1 ms, but only at a check
point (after each component, at the pause points inside long loops): a unit of work between two check
points holds it as long as it runs. Every rank runs the reference trainer (default: the 4-rank CPU
configuration of ``overhead.py``) through this file's ``--child`` wrapper, which records the agent
thread's CPU time between consecutive hand-backs (its own CPU: not the time it waited for the GIL
or slept) and the two check points around each, then prints per rank the distribution and the units
that held it over ``--long-ms`` the most.

    python -m benchmarks.slice_units --steps 150 --env HPAR_FR_READER=process
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.overhead import CONFIGS

UNITS: dict[str, list[float]] = defaultdict(list)  # "from -> to" check points: CPU ms of each hold
_STATE: dict[int, list[Any]] = {}  # thread id -> [thread CPU ns at the last hand-back, its check point]


def _site() -> str:
    frames = traceback.extract_stack(limit=6)[:-2]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))


def instrument(out: str) -> None:
    """Wrap ``gil.Yielder.__call__`` and ``gil.running`` of this rank; dump ``UNITS`` at exit."""
    from hpar_agent import gil

    hand_back, enter, leave = gil.Yielder.__call__, gil.running.__enter__, gil.running.__exit__

    def state() -> list[Any]:
        return _STATE.setdefault(threading.get_ident(), [time.thread_time_ns(), "thread start"])

    def call(y: Any) -> None:
        if time.perf_counter_ns() - y.since < y.hold_ns:
            return
        st, here = state(), _site()
        UNITS[f"{st[1]}  ->  {here}"].append((time.thread_time_ns() - st[0]) / 1e6)
        hand_back(y)
        st[0], st[1] = time.thread_time_ns(), here

    def entered(r: Any) -> Any:
        st = state()
        st[0], st[1] = time.thread_time_ns(), "pass start"
        return enter(r)

    def left(r: Any, *exc: object) -> None:
        st = state()
        UNITS[f"{st[1]}  ->  pass end"].append((time.thread_time_ns() - st[0]) / 1e6)
        leave(r, *exc)

    gil.Yielder.__call__ = call  # type: ignore[method-assign]
    gil.running.__enter__ = entered  # type: ignore[method-assign]
    gil.running.__exit__ = left  # type: ignore[method-assign]
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: Path(out, f"rank{rank}.json").write_text(json.dumps(UNITS)))


def summarize(units: dict[str, list[float]], long_ms: float, top: int, final_ms: float = 100.0) -> list[str]:
    """Lines: the holds' distribution (the final unpaced pass and the exporter thread's chunks left
    out) and the units with the most CPU in holds over ``long_ms``."""
    holds = sorted(x for k, v in units.items() if "otel.py" not in k for x in v if x < final_ms)
    if not holds:
        return ["no paced pass recorded"]
    n = len(holds)
    long = [x for x in holds if x > long_ms]
    lines = [f"holds {n}: median {statistics.median(holds):.2f} ms, p90 {holds[int(0.9 * n)]:.2f}, p99 "
             f"{holds[min(n - 1, int(0.99 * n))]:.2f}, max {holds[-1]:.2f}; over {long_ms:g} ms: {len(long)} "
             f"({sum(long):.0f} of {sum(holds):.0f} ms)"]  # fmt: skip
    rows = []
    for k, v in units.items():
        over = [x for x in v if long_ms < x < final_ms]
        if over and "otel.py" not in k:
            rows.append((sum(over), len(over), len(v), max(over), k))
    for total, cnt, of, mx, k in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {total:6.1f} ms in {cnt:3d} of {of:4d} holds (max {mx:.2f}): {k}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--nproc", type=int, default=CONFIGS["cpu"]["nproc"])
    ap.add_argument("--long-ms", type=float, default=2.0)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="agent settings for the run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="hpar-slices-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HPAR_TRACES": "file",
           "HPAR_METRICS_PORT": "0", "HPAR_RUN_DIR": os.path.join(work, "run"), "HPAR_JOB_ID": "slice-units",
           **dict(kv.split("=", 1) for kv in a.env)}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           "-m", "benchmarks.slice_units", "--child", work, "--", *CONFIGS["cpu"]["args"], "--steps", str(a.steps),
           "--log-every", "1000", "--out", os.path.join(work, "trainer.json")]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        print(res.stderr[-3000:], file=sys.stderr)
        return res.returncode
    results = {}
    for r in range(a.nproc):
        units = json.loads(Path(work, f"rank{r}.json").read_text())
        results[f"rank{r}"] = units
        print(f"rank{r}: " + "\n".join(summarize(units, a.long_ms, a.top)))
    if a.json:
        Path(a.json).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        instrument(sys.argv[2])
        from hpar_trainer.train import main as train_main

        sys.exit(train_main(sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]))
    sys.exit(main())
