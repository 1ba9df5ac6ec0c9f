"""``hpar-agent run`` (``tools.run_cmd``): the child's environment, a fresh run directory, refusals, and
the end-of-run lines per rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpar_agent.tools.run_cmd import (
    NOT_ATTACHED,
    RANK_LINES_MAX,
    SHIM_DIR,
    child_env,
    fresh_run_dir,
    oom_line,
    rank_lines,
    run,
)


def test_child_env_prepends_the_shim_and_keeps_user_settings(tmp_path: Path) -> None:
    env = child_env({"PYTHONPATH": "/x", "TORCH_NCCL_ENABLE_TIMING": "0"}, tmp_path / "r1")
    assert env["PYTHONPATH"] == f"{SHIM_DIR}{os.pathsep}/x"
    assert env["TORCH_NCCL_ENABLE_TIMING"] == "0"  # the user's value wins
    assert env["HPAR_AUTOATTACH"] == "1" and env["HPAR_RUN_DIR"] == str(tmp_path / "r1")
    assert env["HPAR_JOB_ID"] == "r1"
    env = child_env({"HPAR_JOB_ID": "mine"}, tmp_path / "r2")
    assert env["PYTHONPATH"] == str(SHIM_DIR) and env["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert env["HPAR_JOB_ID"] == "mine"


def test_fresh_run_dir_never_reuses_one(tmp_path: Path) -> None:
    first = fresh_run_dir(tmp_path)
    first.mkdir()
    second = fresh_run_dir(tmp_path)
    assert second != first and second.name.startswith(first.name)


def test_run_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--"], environ={}) == 2
    assert "give the command after --" in capsys.readouterr().err


def test_missing_program_exits_127(tmp_path: Path) -> None:
    assert run(["--", str(tmp_path / "nope")], run_dir=str(tmp_path / "run"), environ={}) == 127


def test_a_linked_default_parent_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "hpar-runs").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert run(["--", "true"], environ={}) == 2  # nothing started
    assert "hpar-runs is a symbolic link" in capsys.readouterr().err
    assert list((tmp_path / "elsewhere").iterdir()) == []


def _write_summaries(run_dir: Path, world: int, ranks: list[int], steps: int = 5) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        (run_dir / f"summary.rank{r}.json").write_text(
            json.dumps(
                {
                    "rank": r,
                    "topology": {"world_size": str(world), "backend": "gloo", "dp": str(world)},
                    "errors": {"steps": r % 2},
                    "components": {
                        "steps": {"steps": steps + r, "step_seconds_p50": 0.01},
                        "zerocode": {"attached_at": "init_process_group"},
                    },
                }
            )
        )


def test_end_of_run_says_how_many_ranks_were_observed_and_names_the_missing(tmp_path: Path) -> None:
    assert rank_lines(tmp_path) == [NOT_ATTACHED]
    assert "hpar_agent.current().step()" in NOT_ATTACHED  # the advice for a loop the agent cannot see
    _write_summaries(tmp_path, 3, [0, 2])
    lines = rank_lines(tmp_path)
    assert lines[0] == "  ranks observed: 2 of 3 (summary.rank<R>.json, events.rank<R>.jsonl, state.rank<R>)"
    assert lines[1].startswith("  not observed: rank(s) 1 of 3 (")
    assert lines[2].startswith(
        "  rank 0/3 (gloo, dp 3): 5 steps, step p50 10.0 ms, attached at init_process_group"
    )
    assert lines[3].startswith("  rank 2/3 (gloo, dp 3): 7 steps") and len(lines) == 4


def test_end_of_run_says_each_ranks_degrees_and_pipeline_stage(tmp_path: Path) -> None:
    _write_summaries(tmp_path, 2, [0, 1])
    for r in (0, 1):
        path = tmp_path / f"summary.rank{r}.json"
        summary = json.loads(path.read_text())
        summary["pp_stage"], summary["topology"]["pp"], summary["topology"]["dp"] = r, "2", "1"
        summary["topology"]["tp"] = "2" if r else "1"
        path.write_text(json.dumps(summary))
    lines = rank_lines(tmp_path)
    assert lines[1].startswith("  rank 0/2 (gloo, dp 1, pp 2 stage 0): 5 steps"), lines
    assert lines[2].startswith("  rank 1/2 (gloo, dp 1, tp 2, pp 2 stage 1): 6 steps"), lines


def test_end_of_run_totals_many_ranks(tmp_path: Path) -> None:
    n = RANK_LINES_MAX + 4
    _write_summaries(tmp_path, n, list(range(n)))
    lines = rank_lines(tmp_path)
    assert lines[1:] == [f"  steps per rank: min 5, max {5 + n - 1}; agent errors: {n // 2}"]


GiB = 1 << 30


def _oom(rank: int, fatal: bool, count: int = 1) -> dict:
    rec = {
        "fatal": fatal,
        "step": 7,
        "site": "train.py:41 in forward",
        "requested_bytes": 20 * GiB,
        "device_free_bytes": GiB // 2,
        "device_limit_bytes": 80 * GiB,
        "allocated_bytes": 76 * GiB,
        "evidence": [
            "run/evidence/OutOfMemory.rank1.t.0.allocator.pickle",
            "run/evidence/OutOfMemory.rank1.t.1.oom.json",
        ],
    }
    return {"rank": rank, "components": {"oom": {"count": count, "record": rec}}}


def test_an_oom_is_one_line_saying_where_what_and_the_record() -> None:
    assert oom_line({"rank": 0, "components": {"oom": {"count": 0, "record": None}}}) is None
    assert oom_line({"rank": 0, "components": {}}) is None
    assert oom_line(_oom(1, fatal=True)) == (
        "  rank 1: died of CUDA out of memory after 7 completed steps at train.py:41 in forward; asked 20.00 GiB "
        "with 0.50 GiB free of 80.00 GiB; allocated 76.00 GiB; record: run/evidence/OutOfMemory.rank1.t.1.oom.json"
    )
    assert oom_line(_oom(1, fatal=False, count=3)).startswith(  # type: ignore[union-attr]
        "  rank 1: ran out of CUDA memory 3 time(s) and went on; the first after 7 completed steps at train.py:41"
    )


def test_the_end_of_run_names_each_rank_that_ran_out(tmp_path: Path) -> None:
    _write_summaries(tmp_path, 2, [0, 1])
    path = tmp_path / "summary.rank1.json"
    doc = json.loads(path.read_text())
    doc["components"].update(_oom(1, fatal=True)["components"])
    path.write_text(json.dumps(doc))
    lines = rank_lines(tmp_path)
    assert (
        lines[-1].startswith("  rank 1: died of CUDA out of memory after 7 completed steps")
        and len(lines) == 4
    )
    n = RANK_LINES_MAX + 4
    _write_summaries(tmp_path / "many", n, list(range(n)))
    for r in range(n):
        p = tmp_path / "many" / f"summary.rank{r}.json"
        doc = json.loads(p.read_text())
        doc["components"].update(_oom(r, fatal=True)["components"])
        p.write_text(json.dumps(doc))
    lines = rank_lines(tmp_path / "many")
    assert (
        lines[-1] == "  ... and 4 more rank(s) ran out of CUDA memory"
        and len(lines) == 2 + RANK_LINES_MAX + 1
    )
