"""``hpar-agent diagnose`` ends every mode with a row, kills what it started, and refuses bad names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpar_agent.tools import cli
from hpar_agent.tools.diagnose import Finding, diagnose, injection_times, markdown, run_group, tagged


def test_a_mode_past_its_timeout_becomes_a_row_and_leaves_no_process(tmp_path: Path) -> None:
    t0 = time.monotonic()
    # 2 ranks, 5 s: torchrun and its ranks are still starting (or stuck) when the limit hits
    finding = diagnose("hang", tmp_path / "hang", timeout=5, nproc=2)
    assert finding.timed_out == 5
    assert time.monotonic() - t0 < 30  # killed, not waited for
    row = finding.row()
    assert row[0] == "hang" and "timed out after 5 s" in row[2], row
    assert "timed out after 5 s" in markdown([finding])
    assert finding.token and tagged(finding.token) == []


def test_a_timed_out_run_leaves_no_process_in_any_session(tmp_path: Path) -> None:
    # like torchrun: a parent that ignores SIGTERM starts a child in a session of its own
    code = (
        "import signal,subprocess,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "time.sleep(60)"
    )
    t0 = time.monotonic()
    _code, timed_out, token = run_group([sys.executable, "-c", code], dict(os.environ), tmp_path / "log", 2.0)
    assert timed_out and time.monotonic() - t0 < 20
    assert tagged(token) == []
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "import time; time.sleep(60)" not in out.replace(code, "")


def test_a_bad_injection_name_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["diagnose", "--inject", "straggler", "--inject", "no-such-mode", "--run-dir", str(tmp_path)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-mode" in err[0] and "straggler" in err[0], err
    assert list(tmp_path.iterdir()) == []  # no run started


def test_row_counts_seconds_from_the_injection_on_the_firing_rank() -> None:
    f = Finding(
        "straggler",
        "Straggler",
        [{"alert": "Straggler", "rank": 3, "step": 12, "ts": 107.5, "pp_stage": 0}],
        inject_step=3,
        started={3: 100.0, 0: 90.0},
    )
    row = f.row()
    assert row[2:6] == ["3", "0", "9", "7.5"], row


def test_row_names_the_culprits_the_events_give() -> None:
    def f(*details: dict) -> Finding:
        return Finding(
            "x",
            "Hang",
            [{"alert": "Hang", "rank": r, "step": 5, "details": d} for r, d in enumerate(details)],
        )

    assert f({"culprits": [3]}, {"culprits": [3]}).row()[6] == "3"
    assert f({"culprits": [], "culprit_unknown": ["1-1"]}).row()[6] == "unknown"
    assert f({"value": 1}).row()[6] == "-"  # an alert of one rank's own signal names no culprit


def test_injection_times_from_the_rank_records(tmp_path: Path) -> None:
    steps = [{"step": s, "t0": 100.0 + s, "step_s": 0.5} for s in range(3)]  # step 3 never ended (hang)
    (tmp_path / "trainer.rank1.json").write_text(json.dumps({"rank": 1, "steps": steps}))
    assert injection_times(tmp_path, 3, False) == {1: 102.5}
    assert injection_times(tmp_path, 2, False) == {1: 102.0}
    assert injection_times(tmp_path, 3, True) == {1: 100.5}  # built in: from the end of step 0
