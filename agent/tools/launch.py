"""Launch ``hpar_trainer`` under torchrun as a subprocess (the demo, diagnose and benchmarks).

A subprocess, not an import: the agent never imports the trainer, the trainer imports the agent; the
tools read only the trainer's argv for a run (``trainer_scenarios``: ``hpar_trainer.scenarios``, no torch).
torchrun starts every worker in a session of its own, so killing torchrun alone (what
``subprocess.run`` does on a timeout or Ctrl-C) orphans the ranks; ``stop`` ends torchrun and each
worker's process group.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from hpar_agent.safefiles import open_private, open_regular, private_dir

#: The most of a log the launcher reads back (its failure report and first error lines are near the top).
LOG_LIMIT = 64 << 20


def _read_log(path: Path) -> str:
    """The first ``LOG_LIMIT`` bytes of a log as text; never blocks on a FIFO in its place."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(LOG_LIMIT).decode(errors="replace")


#: Rank output lines as torchrun tees them (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` below).
_RANK_LINE = re.compile(r"^\[rank(\d+)\]:")
#: One failure in torchrun's ChildFailedError report.
_FAILURE = re.compile(r"^\s*rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)", re.MULTILINE)


def torchrun_cmd(
    nproc: int, module: str, args: Sequence[str], *, torchrun_args: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *torchrun_args,
        "-m",
        module,
        *args,
    ]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen[str], grace: float = 10.0) -> int:
    """End torchrun (started with ``start_new_session``) and every worker: SIGTERM to each process
    group, SIGKILL to what is left after ``grace`` seconds. Returns how many workers were signalled."""
    workers = _children(proc.pid)
    for pgid in (proc.pid, *workers):
        _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(w) for w in workers)):
        time.sleep(0.05)
    for pgid in (proc.pid, *workers):
        _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    return len(workers)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _stop_uninterrupted(proc: subprocess.Popen[str]) -> int:
    """``stop`` that a second Ctrl-C cannot cut short (which would leave ranks running)."""
    main = threading.current_thread() is threading.main_thread()
    previous = [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)] if main else []
    try:
        return stop(proc)
    finally:
        for s, handler in zip((signal.SIGINT, signal.SIGTERM), previous, strict=False):
            signal.signal(s, handler)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by torchrun) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def run_trainer(
    nproc: int,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``hpar_trainer`` on ``nproc`` local ranks (one intra-op thread each: ranks share cores).

    Like ``subprocess.run``; on a timeout or Ctrl-C every rank is stopped before the exception propagates.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = torchrun_cmd(nproc, "hpar_trainer", args)
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(
        cmd, env=full_env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # TimeoutExpired, KeyboardInterrupt
            stop(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@dataclass
class Launch:
    """What one observed torchrun launch left behind."""

    returncode: int
    wall_s: float
    log_dir: Path
    interrupted: bool = False
    timed_out: bool = False
    stopped_workers: int = 0
    #: torchrun's own last lines (its failure report), for when no rank says what went wrong.
    torchrun_tail: list[str] = field(default_factory=list)

    def exit_codes(self) -> dict[int, int]:
        """``{rank: exit code}`` of the ranks torchrun's failure report lists (negative: a signal)."""
        try:
            text = _read_log(self.log_dir / "torchrun.log")
        except OSError:
            return {}
        return {int(r): int(c) for r, c in _FAILURE.findall(text)}

    def rank_errors(self) -> dict[int, str]:
        """``{rank: first error line}`` from each rank's stderr (torchrun ``--log-dir``)."""
        errors: dict[int, str] = {}
        for path in sorted(self.log_dir.glob("*/attempt_*/*/stderr.log")):
            try:
                rank = int(path.parent.name)
                line = first_error_line(_read_log(path))
            except (OSError, ValueError):
                continue
            if line:
                errors[rank] = line
        return errors


def first_error_line(text: str) -> str | None:
    """The exception line of the first traceback in ``text``, else the first line saying ``error:``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt.startswith((" ", "\t")):
                    return nxt.strip()
    for line in lines:
        if re.search(r"\berror:", line, re.IGNORECASE):
            return line.strip()
    return None


def launch_observed(
    nproc: int,
    module: str,
    args: Sequence[str],
    *,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: Callable[[str], None] = lambda line: print(line, end="", flush=True),
) -> Launch:
    """Run ``module`` under torchrun: rank output (prefixed ``[rankN]:``) goes to ``echo``, torchrun's
    own log only to ``log_dir/torchrun.log``, each rank's stdout/stderr to files under ``log_dir``.
    Ctrl-C or ``timeout`` stops every rank (``stop``) and is reported, not raised."""
    private_dir(str(log_dir), chosen=True)
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        **(env or {}),
    }
    cmd = torchrun_cmd(
        nproc, module, args, torchrun_args=["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"]
    )
    tail: list[str] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def pump() -> None:
        assert proc.stdout is not None
        with os.fdopen(open_private(str(log_dir / "torchrun.log"), append=False), "w") as log:
            for line in proc.stdout:
                log.write(line)
                if _RANK_LINE.match(line):
                    echo(line)
                else:
                    tail.append(line.rstrip())
                    del tail[:-20]

    reader = threading.Thread(target=pump, name="hpar-torchrun-output", daemon=True)
    reader.start()
    result = Launch(returncode=0, wall_s=0.0, log_dir=log_dir, torchrun_tail=tail)
    main = threading.current_thread() is threading.main_thread()
    # SIGTERM (a job scheduler, kill) ends the ranks the way Ctrl-C does instead of orphaning them.
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        result.returncode = proc.wait(timeout=timeout)
    except KeyboardInterrupt:
        result.interrupted, result.returncode = True, 130
        result.stopped_workers = _stop_uninterrupted(proc)
    except subprocess.TimeoutExpired:
        result.timed_out, result.returncode = True, 124
        result.stopped_workers = _stop_uninterrupted(proc)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    reader.join(timeout=5)
    result.wall_s = time.monotonic() - t0
    return result


class TrainerMissing(RuntimeError):
    """The reference trainer (``hpar_trainer``), which the demo and the fault matrix run, is not importable."""


def trainer_scenarios() -> ModuleType:
    """``hpar_trainer.scenarios``: the trainer's argv for the demo and the fault matrix, imported only when
    a tool runs the trainer (the agent never spells a trainer flag)."""
    try:
        return importlib.import_module("hpar_trainer.scenarios")
    except ImportError as exc:
        raise TrainerMissing(
            f"the reference trainer is not importable ({exc}); install hpar-agent with its hpar_trainer package"
        ) from exc
