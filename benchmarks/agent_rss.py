"""Resident memory the agent adds: the reference trainer (one rank) as subprocesses with and without the
agent, same arguments, each pair side by side, a few pairs; VmRSS / VmHWM from ``/proc/self/status``
after the last step (before detach), and on a GPU the caching allocator's bytes (expect 0).

    python -m benchmarks.agent_rss --json rss-cpu.json
    python -m benchmarks.agent_rss --device cuda --json rss-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    CONFIGS,
    before_detach,
    current_agent,
    finish,
    fmt_bytes,
    need_device,
    proc_status,
    results,
    title,
)


def child_rss(out: str, argv: list[str]) -> int:
    """One trainer process (world size 1); memory read after the last step, before the agent detaches."""
    from hpar_trainer.train import main as train_main

    def at_end() -> None:
        d: dict[str, Any] = {**proc_status(), "threads": threading.active_count()}  # read first: no import before
        agent = current_agent() if "hpar_agent" in sys.modules else None
        d["agent"] = agent is not None
        reader = getattr(agent.component("collectives"), "_reader", None) if agent is not None else None
        if reader is not None and reader.proc is not None:  # the reader process: memory outside this one
            d["reader_VmRSS"] = proc_status(reader.proc.pid)["VmRSS"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            d.update(cuda_allocated=torch.cuda.memory_allocated(), cuda_max_allocated=torch.cuda.max_memory_allocated(),
                     cuda_reserved=torch.cuda.memory_reserved(), cuda_max_reserved=torch.cuda.max_memory_reserved())  # fmt: skip
        Path(out).write_text(json.dumps(d))

    with before_detach(at_end):
        return train_main(argv)


def measure_rss(cfg: dict[str, Any], work: str, repeats: int, steps: int) -> dict[str, Any]:
    """Pairs of trainer processes (agent / --no-agent, same arguments) started together, ``repeats`` times."""
    from benchmarks.overhead import arm_env

    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        procs = []
        for arm in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            out = os.path.join(work, f"rss{rep}-{arm}.json")
            args = [*cfg["trainer"], "--steps", str(steps), "--log-every", "100000"]
            if arm == "off":
                args.append("--no-agent")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   **arm_env(arm, os.path.join(work, f"rss{rep}"), f"comp-rss{rep}")}  # fmt: skip
            cmd = [sys.executable, "-m", "benchmarks.agent_rss", "--child", out, "--", *args]
            procs.append((arm, out, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                     stdin=subprocess.DEVNULL, text=True)))  # fmt: skip
        for arm, out, p in procs:
            _o, err = p.communicate(timeout=900)
            if p.returncode or not os.path.exists(out):
                raise RuntimeError(f"rss {arm} run failed (rc {p.returncode}): {err[-2000:]}")
            d = json.loads(Path(out).read_text())
            if bool(d.get("agent")) != (arm == "on"):  # else the pair measures nothing
                raise RuntimeError(f"rss {arm} run had agent={d.get('agent')!r}: expected {arm == 'on'}")
            runs.append({"rep": rep, "arm": arm, **d})
    result: dict[str, Any] = {"steps": steps, "repeats": repeats, "runs": runs}
    for key in ("VmRSS", "VmHWM", "cuda_allocated", "cuda_max_allocated", "cuda_max_reserved"):
        diffs = []
        for rep in range(repeats):
            pair = {r["arm"]: r for r in runs if r["rep"] == rep}
            if key in pair.get("on", {}) and key in pair.get("off", {}):
                diffs.append(pair["on"][key] - pair["off"][key])
        if diffs:
            result[f"{key}_added_bytes"] = {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs),
                                            "pairs": diffs}  # fmt: skip
    for arm in ("on", "off"):
        vals = [r["VmRSS"] for r in runs if r["arm"] == arm]
        result[f"VmRSS_{arm}_median"] = statistics.median(vals)
    readers = [r["reader_VmRSS"] for r in runs if "reader_VmRSS" in r]
    if readers:
        result["reader_VmRSS_median"] = statistics.median(readers)
    return result


def print_report(r: dict[str, Any]) -> None:
    print(title(r, "resident memory"))
    m = r["rss"]
    line = (f"4. memory the agent adds (median of {m['repeats']} pairs): VmRSS {fmt_bytes(m['VmRSS_added_bytes']['median'])} "
            f"(pairs {', '.join(fmt_bytes(d) for d in m['VmRSS_added_bytes']['pairs'])}; off {m['VmRSS_off_median'] / 2**20:.0f} MiB), "
            f"VmHWM {fmt_bytes(m['VmHWM_added_bytes']['median'])}")  # fmt: skip
    if "reader_VmRSS_median" in m:
        line += f"; the reader process {m['reader_VmRSS_median'] / 2**20:.1f} MiB besides"
    if "cuda_max_reserved_added_bytes" in m:
        line += (f"; CUDA allocated {m['cuda_allocated_added_bytes']['median']:+.0f} B, "
                 f"max reserved {m['cuda_max_reserved_added_bytes']['median']:+.0f} B")  # fmt: skip
    print(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rss-repeats", type=int, default=2, help="pairs of runs")
    ap.add_argument("--steps", type=int, default=0, help="trainer steps (default per device)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    cfg = CONFIGS[a.device]
    r = results("agent_rss", a.device, argv, trainer_args=cfg["trainer"])
    r["rss"] = measure_rss(cfg, tempfile.mkdtemp(prefix="hpar-rss-"), a.rss_repeats, a.steps or cfg["rss_steps"])
    finish(r, a.json)
    print_report(r)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # one trainer process of a pair
        rest = sys.argv[2:]
        sys.exit(child_rss(rest[0], rest[2:] if len(rest) > 1 and rest[1] == "--" else rest[1:]))
    sys.exit(main())
