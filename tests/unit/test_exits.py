"""How a rank ended, seen from outside: its state file (rankstate) and the exit watcher of hpar-agent run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpar_agent import rankstate
from hpar_agent.tools.culprits import culprit_lines, endings, failure_lines
from hpar_agent.tools.exits import ExitWatcher, describe_status

#: A parent that reaps its child the way torchrun does (a poll every 0.1 s), so the watcher, which is
#: not the child's parent, sees it as everyone but the launcher does.
PARENT = "import subprocess, sys, time\np = subprocess.Popen(sys.argv[1:])\nwhile p.poll() is None:\n    time.sleep(0.1)\n"


def _rank(tmp_path: Path, ending: str) -> Path:
    """A process that attaches the agent as rank 0 of 1, takes 3 steps, then ends by ``ending``."""
    run_dir = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, signal, hpar_agent
        agent = hpar_agent.attach(None, run_dir={str(run_dir)!r}, metrics_port=-1, traces="none", interval=3600)
        for _ in range(3):
            agent.step()
        {ending}
    """)
    script = tmp_path / "rank.py"
    script.write_text(code)
    return script


@pytest.mark.parametrize(
    ("ending", "how"),
    [
        ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9 (SIGKILL)"),
        ("raise RuntimeError('boom')", "exception: RuntimeError: boom (exit code 1)"),
        ("pass", "exit code 0"),
    ],
)
def test_the_watcher_and_the_state_file_say_how_and_when_a_rank_ended(
    tmp_path: Path, ending: str, how: str
) -> None:
    script = _rank(tmp_path, ending)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    watcher = ExitWatcher(run_dir).start()
    subprocess.run([sys.executable, "-c", PARENT, sys.executable, str(script)], timeout=120, check=False)
    exits = watcher.stop(grace_s=2)
    rec = rankstate.read(str(run_dir / "state.rank0"))
    assert rec is not None and rec.steps == 3 and rec.pid == exits[0].pid
    (e,) = endings(run_dir, exits)
    assert (e.rank, e.step, e.how, e.failed) == (0, 3, how, ending != "pass")
    lines = failure_lines([e])
    if ending == "pass":
        assert lines == []
    else:
        assert lines[0].startswith(f"  culprit: rank 0, the first to end abnormally: {how}, at step 3")


def test_a_state_file_without_an_exit_record_is_a_death_without_exiting(tmp_path: Path) -> None:
    script = _rank(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    subprocess.run([sys.executable, str(script)], timeout=120, check=False)  # no watcher
    (e,) = endings(tmp_path / "run")
    assert e.failed and e.how.startswith("died without exiting") and e.step == 3


def test_describe_status() -> None:
    assert describe_status(None) == ""
    assert describe_status(9) == "killed by signal 9 (SIGKILL)"
    assert describe_status(1 << 8) == "exit code 1"


def test_garbage_is_not_a_state_file(tmp_path: Path) -> None:
    (tmp_path / "state.rank0").write_bytes(b"garbage" * 100)
    (tmp_path / "state.rank1").write_bytes(b"")
    assert (
        rankstate.read(str(tmp_path / "state.rank0")) is None
        and rankstate.read(str(tmp_path / "state.rank1")) is None
    )
    assert endings(tmp_path) == []


def _alert(rank: int, alert: str, ts: float, **details: object) -> dict[str, object]:
    return {"kind": "alert", "state": "firing", "alert": alert, "rank": rank, "ts": ts, "details": details}


def test_culprit_lines_come_in_the_order_the_alerts_first_fired() -> None:
    events = [
        _alert(
            0,
            "Hang",
            10.0,
            culprits=[2],
            kind="missing",
            waits=[
                {"pg": "default_pg@", "seq": 46, "op": "all_reduce", "waiting": [0, 1, 3], "missing": [2]}
            ],
        ),
        _alert(
            2, "Hang", 10.1, culprits=[2], kind="missing", stack=["train.py:43 in <module>: time.sleep(3600)"]
        ),
        _alert(
            1,
            "RankGone",
            20.0,
            culprits=[0],
            ranks={"0": {"ended": "exception: RuntimeError: x", "last_step": 40}},
        ),
        _alert(3, "ReplicaDivergence", 5.0, culprits=[], culprit_unknown=["dp group [0, 1]: no majority"]),
        {
            "kind": "alert",
            "state": "resolved",
            "alert": "Straggler",
            "rank": 0,
            "ts": 1.0,
            "details": {"culprits": [9]},
        },
    ]
    lines = culprit_lines(events)
    assert lines[0] == "  ReplicaDivergence on rank 3: culprit unknown (dp group [0, 1]: no majority)"
    assert lines[1].startswith(
        "  culprit: rank 2 (Hang: not in default_pg all_reduce #46, which ranks 0, 1, 3 "
        "wait in; at train.py:43 in <module>: time.sleep(3600); raised on ranks 0, 2)"
    )
    assert lines[2].startswith("  culprit: rank 0 (RankGone: rank 0 at step 40: exception: RuntimeError: x")
    assert len(lines) == 3  # a resolution names nobody


def test_a_culprit_line_says_which_raising_ranks_could_not_tell() -> None:
    events = [
        _alert(0, "Hang", 10.0, culprits=[5], kind="missing"),
        _alert(
            1,
            "Hang",
            10.2,
            culprits=[],
            culprit_unknown="rank 9 waits in dp for members beyond the ranks read",
        ),
        _alert(2, "Hang", 10.3, culprits=[5], kind="missing"),
    ]
    (line,) = culprit_lines(events)
    assert line.startswith("  culprit: rank 5 (Hang")
    assert line.endswith(
        "raised on ranks 0, 1, 2; rank 1 could not tell: rank 9 waits in dp for members beyond the ranks read)"
    )
    assert culprit_lines(events[:1] + events[2:])[0].endswith("raised on ranks 0, 2)")


def test_the_first_to_end_is_not_the_culprit_when_an_alert_named_one(tmp_path: Path) -> None:
    from hpar_agent.tools.culprits import Ending, ending_lines

    ended = [
        Ending(1, 2, "exception: RuntimeError: Timed out waiting 20000ms", 40, 5.0, True, "communication"),
        Ending(2, 2, "killed by signal 15 (SIGTERM)", 40, 5.1, True, "signal"),
    ]
    named = ending_lines(ended, [_alert(1, "Hang", 1.0, culprits=[2])])
    assert named[0].startswith("  culprit: rank 2 (Hang")
    assert named[1].startswith("  first to end abnormally: rank 1, exception: RuntimeError: Timed out")
    assert not any(line.startswith("  culprit: rank 1") for line in named)
    # no alert named the rank the waits point to: a timeout is a consequence, never the culprit
    (unknown, _then) = ending_lines(ended, [])
    assert unknown.startswith(
        "  culprit unknown: the first to end abnormally, rank 1, ended of a communication"
    )
    # an ending of its own is the culprit; the launcher's SIGTERM is only when run forwarded none
    own = Ending(0, 2, "exception: ValueError: bad batch (exit code 1)", 40, 4.0, True)
    assert ending_lines([own, *ended], [])[0].startswith("  culprit: rank 0, the first to end abnormally")
    assert ending_lines(ended[1:], [])[0].startswith("  culprit: rank 2, the first to end abnormally")
    assert ending_lines(ended[1:], [], forwarded=True)[0].startswith("  culprit unknown:")
    # every rank raised the same error of its own: no rank is named for it
    # every rank raised the same error of its own (the launcher terminated the later one): no rank named
    error = "exception: TypeError: needs NCCL"
    alike = [
        Ending(1, 2, f"{error} (exit code 1)", 0, None, True, "", error),
        Ending(0, 2, f"{error} (killed by signal 15 (SIGTERM))", 0, None, True, "signal", error),
    ]
    (line, _then) = ending_lines(alike, [])
    assert line.startswith("  culprit unknown: every rank ended of the same error of its own"), line
    assert line.endswith("needs NCCL (exit code 1), at step 0, first on rank 1"), line
    assert ending_lines([alike[0]], [])[0].startswith("  culprit: rank 1, the first")  # rank 0 did not end
    other = Ending(0, 2, "exception: ValueError: bad batch (exit code 1)", 3, None, True, "", "ValueError")
    assert ending_lines([alike[0], other], [])[0].startswith("  culprit: rank 1, the first")
    assert os.path.basename(rankstate.file_name(3)) == "state.rank3"


def test_one_incident_has_one_culprit_line_and_names_no_rank_that_only_waited() -> None:
    """DDP, rank 2 asleep: Hang names it; the others end of the gloo timeout and an agent that still
    saw RankGone name them (an older agent's events) adds no second culprit line."""
    events = [
        _alert(0, "Hang", 10.0, culprits=[2], victims=[0, 1, 3], kind="missing", waits=[]),
        _alert(2, "RankGone", 30.0, culprits=[0, 1, 3], ranks={}),
    ]
    lines = culprit_lines(events)
    assert len(lines) == 1 and lines[0].startswith("  culprit: rank 2 (Hang"), lines


def test_a_pipeline_hang_says_who_waits_for_the_culprit_point_to_point() -> None:
    waits = [
        {"pg": "pp", "op": "recv", "peer": 1, "p2p": True, "waiting": [0], "missing": [1]},
        {"pg": "pp", "op": "send", "peer": 2, "p2p": True, "waiting": [1], "missing": [2]},
        {"pg": "pp", "op": "recv", "peer": 2, "p2p": True, "waiting": [3], "missing": [2]},
    ]
    (line,) = culprit_lines(
        [_alert(0, "Hang", 1.0, culprits=[2], victims=[0, 1, 3], kind="missing", waits=waits)]
    )
    assert line.startswith(
        "  culprit: rank 2 (Hang: ranks 1, 3 wait for it point to point (rank 1: send to rank 2; "
        "rank 3: recv from rank 2); raised on rank 0)"
    ), line


def test_a_culprits_stack_is_the_one_of_its_latest_firing() -> None:
    """An early firing's py-spy stack (a slow compile) is not the stack of a later firing whose evidence
    the rate limit skipped."""
    events = [
        _alert(3, "Hang", 1.0, culprits=[], kind="stuck", stack=["train.py:248 in step: compile()"]),
        _alert(3, "Hang", 50.0, culprits=[3], kind="desync", sides={"default_pg: barrier": [3]}),
    ]
    (line,) = culprit_lines(events)
    assert "compile()" not in line and line.startswith(
        "  culprit: rank 3 (Hang: desync: rank 3 in default_pg"
    ), line
