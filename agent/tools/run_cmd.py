"""``hpar-agent run -- CMD ...``: observe an unmodified training script (zero-code mode).

CMD is ``torchrun ... train.py``, ``python train.py``, ``accelerate launch ...`` (anything that starts
Python processes, however they start their ranks). The children, and theirs, get the shim directory
first on PYTHONPATH (its ``sitecustomize`` attaches the agent in the processes that train, see
``autoattach``), ``HPAR_AUTOATTACH=1``, ``HPAR_RUN_DIR``, ``HPAR_JOB_ID``, and what must be set
before a process group exists (``TORCH_NCCL_ENABLE_TIMING=1`` unless set). The command runs in its own
process group: SIGINT/SIGTERM/SIGHUP are forwarded to the whole group (a second one sends SIGKILL), and
its exit status is ours (128 + N when a signal N ended it).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpar_agent.catalogue import ENV_AUTOATTACH
from hpar_agent.config import TRUE_WORDS
from hpar_agent.safefiles import RUNS_DIR, default_run_dir, private_dir
from hpar_agent.tools.culprits import Ending, ending_lines, endings
from hpar_agent.tools.exits import ExitWatcher
from hpar_agent.tools.goodput_view import closing_line
from hpar_agent.tools.run_files import load_run
from hpar_agent.tools.summary import load_rank_summaries

SHIM_DIR = Path(__file__).resolve().parents[1] / "zerocode_site"  # hpar_agent/zerocode_site
#: Set before any process group exists; a user's own value wins.
PRE_PG_ENV = {"TORCH_NCCL_ENABLE_TIMING": "1"}
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _say(msg: str) -> None:
    print(f"hpar-agent run: {msg}", file=sys.stderr, flush=True)


def fresh_run_dir(base: Path | None = None) -> Path:
    """``hpar-runs/run-<time>``, made unique with a suffix when that name exists."""
    base = base or Path(RUNS_DIR)
    stem = f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base / stem, 1
    while path.exists():
        n += 1
        path = base / f"{stem}-{n}"
    return path


def child_env(environ: Mapping[str, str], run_dir: Path) -> dict[str, str]:
    """The children's environment: the shim on PYTHONPATH, the run dir and the pre-PG settings."""
    env = dict(environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{SHIM_DIR}{os.pathsep}{old}" if old else str(SHIM_DIR)
    env[ENV_AUTOATTACH] = "1"
    env["HPAR_RUN_DIR"] = str(run_dir)
    env.setdefault("HPAR_JOB_ID", run_dir.name)
    for name, value in PRE_PG_ENV.items():
        env.setdefault(name, value)
    return env


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _run_forwarding(cmd: Sequence[str], env: Mapping[str, str], received: list[int] | None = None) -> int:
    """Run ``cmd`` in its own process group, forward termination signals to the group, return its
    exit status; ``received`` gets the signals forwarded."""
    try:
        proc = subprocess.Popen(list(cmd), env=dict(env), preexec_fn=os.setpgrp)
    except OSError as exc:
        _say(f"cannot start {cmd[0]!r}: {exc}")
        return 127
    received = [] if received is None else received

    def forward(signum: int, _frame: Any) -> None:
        sig = signal.SIGKILL if received else signum
        received.append(signum)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return _exit_status(rc)


#: Above this many ranks the end of the run prints totals instead of a line per rank.
RANK_LINES_MAX = 16


#: What the end of the run says when no process attached.
NOT_ATTACHED = (
    "  no process attached, so nothing was observed: a process is observed once it creates a process "
    "group (init_process_group), steps a torch.optim optimizer, compiles (torch.compile) or calls "
    "hpar_agent.current(); in a loop with none of these, call hpar_agent.current().step() once per "
    "iteration (and check that hpar_agent is importable by the command's Python)"
)


def rank_lines(run_dir: Path, ended: Sequence[Ending] = ()) -> list[str]:
    """What the end of the run says about the ranks, from their ``summary.rank<R>.json`` (and, for a rank
    killed before it wrote one, its state file: ``ended``): how many ranks the job had (the world size the
    observed ones saw) and how many were observed, naming the missing ones."""
    ranks = load_rank_summaries(run_dir)
    unsummarized = [e for e in ended if e.rank not in {r.get("rank") for r in ranks}]
    if not ranks and not unsummarized:
        return [NOT_ATTACHED]
    world = max(
        [int(r.get("topology", {}).get("world_size", 0) or 0) for r in ranks]
        + [e.world for e in unsummarized]
    )
    seen = {r.get("rank") for r in ranks} | {e.rank for e in unsummarized}
    missing = [i for i in range(world) if i not in seen]
    lines = [
        f"  ranks observed: {len(seen)} of {world} (summary.rank<R>.json, events.rank<R>.jsonl, state.rank<R>)"
    ]
    if missing:
        shown = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
        lines.append(
            f"  not observed: rank(s) {shown} of {world} (crashed or killed before attaching, or "
            "writing to another host's run directory)"
        )
    steps = [int(r.get("components", {}).get("steps", {}).get("steps", 0)) for r in ranks]
    errors = [sum(r.get("errors", {}).values()) for r in ranks]
    ooms = [line for r in ranks if (line := oom_line(r))]
    if len(ooms) > RANK_LINES_MAX:
        ooms[RANK_LINES_MAX:] = [
            f"  ... and {len(ooms) - RANK_LINES_MAX} more rank(s) ran out of CUDA memory"
        ]
    if len(seen) > RANK_LINES_MAX:
        steps += [e.step for e in unsummarized]
        lines.append(f"  steps per rank: min {min(steps)}, max {max(steps)}; agent errors: {sum(errors)}")
        return lines + ooms
    per_rank: list[tuple[int, str]] = []
    for r, n, err in zip(ranks, steps, errors, strict=True):
        comps = r.get("components", {})
        topo = r.get("topology", {})
        p50 = comps.get("steps", {}).get("step_seconds_p50")
        attached = comps.get("zerocode", {}).get("attached_at", "attach()")
        inner = "".join(f", {d} {topo[d]}" for d in ("tp", "cp") if str(topo.get(d, "1")) != "1")
        pp = f", pp {topo['pp']} stage {r.get('pp_stage')}" if str(topo.get("pp", "1")) != "1" else ""
        per_rank.append(
            (
                int(r.get("rank") or 0),
                f"  rank {r.get('rank')}/{topo.get('world_size', '?')} ({topo.get('backend', '?')}, dp "
                f"{topo.get('dp', '?')}{inner}{pp}): {n} steps, step p50 {'-' if p50 is None else f'{p50 * 1e3:.1f} ms'}, "
                f"attached at {attached}, agent errors {err}, metrics {r.get('metrics_url') or '-'}",
            )
        )
    for e in unsummarized:
        per_rank.append(
            (
                e.rank,
                f"  rank {e.rank}/{e.world}: {e.step} steps, then {e.how} (no summary: it ended "
                "before its agent could write one)",
            )
        )
    return lines + [line for _, line in sorted(per_rank)] + ooms


def _gib(n: object) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, int | float) and not isinstance(n, bool) else "?"


def oom_line(summary: dict[str, Any]) -> str | None:
    """One line on a rank's CUDA out-of-memory (the ``oom`` record of its summary), or None: whether it
    ended the process, after how many steps, what was asked and free, where, and the record's file."""
    oom = summary.get("components", {}).get("oom") or {}
    rec = oom.get("record")
    if not isinstance(rec, dict):
        return None
    if rec.get("fatal"):
        what = "died of CUDA out of memory"
    else:
        what = f"ran out of CUDA memory {oom.get('count') or 1} time(s) and went on; the first"
    ask = f"; asked {_gib(rec['requested_bytes'])}" if rec.get("requested_bytes") is not None else ""
    free = (
        f" with {_gib(rec['device_free_bytes'])} free of {_gib(rec.get('device_limit_bytes'))}"
        if (rec.get("device_free_bytes") is not None)
        else ""
    )
    held = f"; allocated {_gib(rec['allocated_bytes'])}" if rec.get("allocated_bytes") is not None else ""
    where = f" at {rec['site']}" if rec.get("site") else ""
    files = [p for p in rec.get("evidence") or () if str(p).endswith(".oom.json")]
    return (
        f"  rank {summary.get('rank')}: {what} after {rec.get('step', '?')} completed steps{where}{ask}{free}"
        f"{held}; record: {files[0] if files else 'events.rank<R>.jsonl (kind oom)'}"
    )


def run(cmd: Sequence[str], run_dir: str | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``hpar-agent run``: returns the command's exit status (2 for a usage error)."""
    environ = os.environ if environ is None else environ
    cmd = list(cmd[1:] if cmd[:1] == ["--"] else cmd)
    if not cmd:
        _say("error: give the command after --, e.g. hpar-agent run -- torchrun --nproc-per-node 2 train.py")
        return 2
    if environ.get("HPAR_DISABLE", "").strip().lower() in TRUE_WORDS:
        _say("HPAR_DISABLE is set: running the command unobserved")
        return _run_forwarding(cmd, environ)
    chosen = run_dir or environ.get("HPAR_RUN_DIR")
    rd = Path(chosen or fresh_run_dir())
    try:  # 0700, as the agent's own files are 0600
        rd = Path(
            private_dir(str(rd.resolve()), chosen=True) if chosen else default_run_dir(rd.name)
        ).resolve()
    except OSError as exc:
        _say(f"error: run directory {rd}: {exc}")
        return 2
    _say(f"observing `{shlex.join(cmd)}`; outputs in {rd}")
    t0 = time.time()
    watcher = ExitWatcher(rd).start()
    forwarded: list[int] = []
    status = _run_forwarding(cmd, child_env(environ, rd), forwarded)
    exits = watcher.stop()
    _say(f"exit code {status} after {time.time() - t0:.1f} s; outputs in {rd}")
    ended = endings(rd, exits)
    for line in [*rank_lines(rd, ended), *ending_lines(ended, load_run(rd).events, bool(forwarded))]:
        print(line, file=sys.stderr)
    goodput = closing_line(load_rank_summaries(rd))
    if goodput:
        _say(goodput)
    return status
