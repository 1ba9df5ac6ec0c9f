"""Peak memory of ``hpar-agent compare`` on large run directories: the tools stream the event logs and
traces, so memory follows the steps kept, not the files' size.

Writes two synthetic run directories of ``--ranks`` ranks (summaries carrying 512 step times each,
event logs of ``--events-mib`` MiB in all, traces of ``--traces-mib`` MiB in all with the sampled
steps' ``train.step`` and ``step.forward`` spans), runs ``hpar-agent compare A B --phase forward`` in a
child process and prints its peak resident memory (``ru_maxrss`` of the child) against the input's size.

    python -m benchmarks.compare_memory --events-mib 1024 --dir /tmp/cmpmem
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _summary(rank: int, ranks: int, seed: int) -> dict:
    rng = random.Random(seed * 100 + rank)
    return {
        "rank": rank,
        "topology": {"world_size": ranks},
        "components": {
            "steps": {
                "steps": 10_000,
                "recent_first_step": 10_000 - 512,
                "recent_step_seconds": [0.1 * (1 + 0.05 * rng.random()) for _ in range(512)],
                "cpu_wait_share": 0.01,
            }
        },
    }


def _events(path: Path, size: int, rank: int) -> None:
    """Alert, step and compile events as the agent writes them, up to ``size`` bytes."""
    lines = [
        {
            "ts": 0.0,
            "kind": "alert",
            "alert": "Straggler",
            "state": "firing",
            "rank": rank,
            "step": 0,
            "value": 0.42,
            "threshold": 0.2,
            "evidence": ["evidence/Straggler-1.pyspy.json"],
            "details": {"culprits": [3], "stack": [f"train.py:{i} in step" for i in range(12)]},
        },
        {"ts": 0.0, "kind": "compile", "rank": rank, "graphs": 3, "frame": "forward", "reason": "x" * 120},
        {"ts": 0.0, "kind": "step", "rank": rank, "step": 1, "seconds": 0.1, "phases": {"forward": 0.02}},
    ]
    block = "".join(json.dumps({**e, "ts": 1.7e9 + i}) + "\n" for i, e in enumerate(lines * 200)).encode()
    with path.open("wb") as fh:
        for _ in range(size // len(block)):
            fh.write(block)


def _traces(path: Path, size: int, rank: int) -> None:
    """OTLP/JSON lines, one sampled step each (``train.step`` and ``step.forward``), up to ``size``."""
    written, step = 0, 0
    with path.open("w") as fh:
        while written < size:
            t0 = 1_700_000_000_000_000_000 + step * 10**8

            def span(name: str, d: float, t0: int = t0, step: int = step) -> dict:
                attrs = [
                    {"key": "hpar.step", "value": {"intValue": str(step)}},
                    {"key": "hpar.trace.reason", "value": {"stringValue": "sampled"}},
                ]
                return {
                    "name": name,
                    "startTimeUnixNano": str(t0),
                    "endTimeUnixNano": str(t0 + int(d * 1e9)),
                    "attributes": attrs,
                }

            res = {"attributes": [{"key": "hpar.rank", "value": {"intValue": str(rank)}}]}
            spans = [span("train.step", 0.1), span("step.forward", 0.02)]
            line = json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": spans}]}]}) + "\n"
            fh.write(line)
            written += len(line)
            step += 1


def make_run(path: Path, ranks: int, events_mib: int, traces_mib: int, seed: int) -> int:
    path.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (path / f"summary.rank{r}.json").write_text(json.dumps(_summary(r, ranks, seed)))
        if events_mib:
            _events(path / f"events.rank{r}.jsonl", events_mib * MiB // ranks, r)
        if traces_mib:
            _traces(path / f"traces.rank{r}.jsonl", traces_mib * MiB // ranks, r)
    return sum(p.stat().st_size for p in path.iterdir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks a run (a JSONL file is read up to 256 MiB)")
    ap.add_argument("--events-mib", type=int, default=1024)
    ap.add_argument("--traces-mib", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where to write the runs (default: a temporary directory)")
    a = ap.parse_args(argv)
    base = Path(a.dir or tempfile.mkdtemp(prefix="compare-memory-"))
    sizes = [make_run(base / n, a.ranks, a.events_mib, a.traces_mib, s) for s, n in enumerate("AB")]
    cmd = [
        sys.executable,
        "-m",
        "hpar_agent",
        "compare",
        str(base / "A"),
        str(base / "B"),
        "--phase",
        "forward",
    ]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    print(res.stdout[-1500:], res.stderr[-1500:], sep="\n")
    print(
        f"input {sizes[0] / MiB:.0f} MiB a run ({a.ranks} ranks: events {a.events_mib} MiB, traces "
        f"{a.traces_mib} MiB), two runs; compare exit {res.returncode} in {seconds:.1f} s; "
        f"peak RSS {peak / MiB:.0f} MiB"
    )
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
