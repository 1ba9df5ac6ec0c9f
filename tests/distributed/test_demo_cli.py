"""``hpar-agent demo`` end to end on 2 CPU ranks: a failed rank is named with its error and fails the
command; Ctrl-C stops every rank. Each test launches one small torchrun job."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

#: The demo on 2 ranks (dp1 x tp1 x pp2), eager: what is tested is the launch, not the model.
SMALL = ["--nproc", "2", "--metrics-port", "0"]
SMALL_TRAINER = ["--", "--tp", "1", "--compile", "eager"]

BLOCK_NUMPY = """
import sys
class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoNumpy())
"""


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = {int(c) for c in f.read().split()}
                todo += kids - found
                found |= kids
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_without_numpy_fail_the_demo_and_are_named(tmp_path):
    """The issue's first-hour failure: every rank dies importing numpy. The demo must exit non-zero,
    name the failed ranks with their error line, say no rank wrote a summary, and write no report."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_NUMPY)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run(
        [
            sys.executable,
            *"-m hpar_agent demo --run-dir".split(),
            str(run_dir),
            "--steps",
            "2",
            *SMALL,
            *SMALL_TRAINER,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout
    assert res.returncode != 0, out[-2000:]
    # the first rank to die is named with its error line; torchrun may stop the other before its own
    # import fails (then it is listed as stopped), so either rank can be the one that carries the line
    failed = re.search(r"FAILED ranks: ([\d, ]+)", out)
    stopped = re.search(r"stopped by torchrun after the failure: ranks ([\d, ]+)", out)
    assert failed, out[-2000:]
    named = failed.group(1).strip().split(", ") + (stopped.group(1).strip().split(", ") if stopped else [])
    assert sorted(named) == ["0", "1"], out[-2000:]  # each rank once: failed, or stopped after a failure
    assert re.search(r"rank [01] \(exit 1\): ModuleNotFoundError: No module named 'numpy'", out), out[-2000:]
    assert "no summary from ranks: 0, 1" in out
    assert "none fired" not in out and "report: none (the run never stepped)" in out
    assert not (run_dir / "report.html").exists()
    assert "ChildFailedError" not in out + res.stderr  # torchrun's report goes to logs/torchrun.log
    assert "ChildFailedError" in (run_dir / "logs" / "torchrun.log").read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_every_rank_promptly(tmp_path, sig):
    # A terminal's Ctrl-C reaches a demo whose SIGINT is not ignored; a test run started in the
    # background of a shell without job control inherits SIGINT ignored, so the demo gets it back.
    proc = subprocess.Popen(
        [
            sys.executable,
            *"-m hpar_agent demo --run-dir".split(),
            str(tmp_path / "run"),
            "--steps",
            "100000",
            *SMALL,
            *SMALL_TRAINER,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tree: list[int] = []
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # wait until the ranks train
            seen.append(line)
            if "step 0 loss" in line:
                break
        else:
            pytest.fail("demo ended before stepping: " + "".join(seen)[-2000:])
        tree = _descendants(proc.pid)
        assert len(tree) >= 3  # torchrun and two ranks (plus their helpers)
        t0 = time.monotonic()
        proc.send_signal(sig)  # SIGINT: what the terminal sends on Ctrl-C (to hpar-agent's group only)
        rc = proc.wait(timeout=60)
        stopped_after = time.monotonic() - t0
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = [p for p in tree if _alive(p)]
        for p in left:  # torchrun and the ranks run in their own sessions: a failure must not leave them
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    assert rc == 130 and "interrupted" in err, err
    assert not left, f"still running after Ctrl-C: {left}"
    assert stopped_after < 15, stopped_after


def test_timeout_stops_every_rank(tmp_path):
    """``--timeout`` ends torchrun and the ranks alike (killing torchrun alone orphans them)."""
    res = subprocess.run(
        [
            sys.executable,
            *"-m hpar_agent demo --run-dir".split(),
            str(tmp_path / "run"),
            *"--steps 100000 --timeout 20".split(),
            *SMALL,
            *SMALL_TRAINER,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert res.returncode == 124 and "timed out after 20 s" in res.stderr, res.stderr[-2000:]
    ranks = subprocess.run(
        ["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True
    ).stdout.split()
    assert not ranks, f"ranks still running: {ranks}"


def test_demo_output_is_rank_prefixed_and_summarised(tmp_path):
    """A clean small run: exit 0, rank output tagged, a summary and a report."""
    run_dir = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable,
            *"-m hpar_agent demo --run-dir".split(),
            str(run_dir),
            "--steps",
            "3",
            *SMALL,
            *SMALL_TRAINER,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "[rank0]:" in res.stdout and "=== hpar-agent demo summary ===" in res.stdout
    assert "FAILED" not in res.stdout and "no summary from" not in res.stdout
    assert Path(run_dir / "report.html").stat().st_size > 0


def test_run_trainer_timeout_stops_every_rank(tmp_path):
    """``launch.run_trainer`` (diagnose, benchmarks) raises TimeoutExpired like subprocess.run, but only
    after torchrun and every rank are gone (subprocess.run would SIGKILL torchrun and orphan them)."""
    from hpar_agent.tools.launch import run_trainer

    marker = str(tmp_path / "trainer.json")
    args = ["--pp", "2", "--compile", "eager", "--steps", "100000", "--no-agent", "--out", marker]
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_trainer(2, args, timeout=15)
    assert time.monotonic() - t0 < 40
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"ranks still running: {left}"
