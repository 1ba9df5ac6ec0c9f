"""Zero-code mode without starting torch: the shim (plain `python -c`), the launcher side, the note."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpar_agent.tools.run_cmd import (
    NOT_ATTACHED,
    RANK_LINES_MAX,
    SHIM_DIR,
    child_env,
    fresh_run_dir,
    rank_lines,
    run,
)

#: What a launcher around the test run may have set; the shim reads them.
LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}
PROBE = (
    "import json, os, sys; sc = sys.modules['sitecustomize']; "
    "print(json.dumps([sc.__file__, sc._hpar_mode, os.environ.get('HPAR_AUTOATTACH'), 'torch' in sys.modules, "
    "[type(f).__name__ for f in sys.meta_path if getattr(f, '_hpar_autoattach', False)]]))"
)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("HPAR_", "TORCHELASTIC_", "PYTHONPATH")) and k not in LAUNCH_VARS}  # fmt: skip


def _probe(env: dict[str, str]) -> list[Any]:
    base = _clean_env()
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    return json.loads(out.stdout)


def test_shim_is_shipped_in_the_package() -> None:
    assert (SHIM_DIR / "sitecustomize.py").is_file()


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


@pytest.mark.parametrize(
    "launch_env", [{}, {"TORCHELASTIC_RUN_ID": "x"}, {"WORLD_SIZE": "2"}, {"SLURM_NTASKS": "8"}, {"WORLD_SIZE": "1"}]
)
def test_every_process_arms_the_same_way_and_imports_nothing(tmp_path: Path, launch_env: dict[str, str]) -> None:
    """Whatever launched it: one finder waits for c10d and torch, nothing is imported, and the marker
    stays in the environment for the process's own children (mp.spawn ranks, Lightning's ranks)."""
    sc, mode, var, torch_loaded, finders = _probe({**child_env({}, tmp_path), **launch_env})
    assert Path(sc).resolve() == (SHIM_DIR / "sitecustomize.py").resolve()
    assert (mode, var, torch_loaded, finders) == ("armed", "1", False, ["_AfterImport"])


@pytest.mark.parametrize("extra", [{"HPAR_DISABLE": "1"}, {"HPAR_AUTOATTACH": ""}])
def test_disable_or_no_marker_installs_nothing(tmp_path: Path, extra: dict[str, str]) -> None:
    _, mode, _, _, finders = _probe({**child_env({}, tmp_path), **extra})
    assert (mode, finders) == ("off", [])


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = child_env({"PYTHONPATH": str(theirs)}, tmp_path / "run")
    base = _clean_env()
    out = subprocess.run([sys.executable, "-c", "import os, sitecustomize; print(os.environ.get('THEIRS_RAN'), "
                          "sitecustomize._hpar_mode)"], env={**base, **env}, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    assert out.stdout.split() == ["yes", "armed"]


def test_run_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["--"], environ={}) == 2
    assert "give the command after --" in capsys.readouterr().err


def test_missing_program_exits_127(tmp_path: Path) -> None:
    assert run(["--", str(tmp_path / "nope")], run_dir=str(tmp_path / "run"), environ={}) == 127


def _write_summaries(run_dir: Path, world: int, ranks: list[int], steps: int = 5) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        (run_dir / f"summary.rank{r}.json").write_text(json.dumps({
            "rank": r, "topology": {"world_size": str(world), "backend": "gloo", "dp": str(world)},
            "errors": {"steps": r % 2},
            "components": {"steps": {"steps": steps + r, "step_seconds_p50": 0.01},
                           "zerocode": {"attached_at": "init_process_group"}},
        }))  # fmt: skip


def test_end_of_run_says_how_many_ranks_were_observed_and_names_the_missing(tmp_path: Path) -> None:
    assert rank_lines(tmp_path) == [NOT_ATTACHED]
    assert "hpar_agent.current().step()" in NOT_ATTACHED  # the advice for a loop the agent cannot see
    _write_summaries(tmp_path, 3, [0, 2])
    lines = rank_lines(tmp_path)
    assert lines[0] == "  ranks observed: 2 of 3 (summary.rank<R>.json, events.rank<R>.jsonl)"
    assert lines[1].startswith("  not observed: rank(s) 1 of 3 (")
    assert lines[2].startswith("  rank 0/3 (gloo, dp 3): 5 steps, step p50 10.0 ms, attached at init_process_group")
    assert lines[3].startswith("  rank 2/3 (gloo, dp 3): 7 steps") and len(lines) == 4


def test_end_of_run_totals_many_ranks(tmp_path: Path) -> None:
    n = RANK_LINES_MAX + 4
    _write_summaries(tmp_path, n, list(range(n)))
    lines = rank_lines(tmp_path)
    assert lines[1:] == [f"  steps per rank: min 5, max {5 + n - 1}; agent errors: {n // 2}"]


@pytest.mark.parametrize(("local_rank", "steps", "lines"), [(0, 0, 1), (1, 0, 0), (0, 3, 0)])
def test_no_step_line_once_per_host(
    caplog: pytest.LogCaptureFixture, local_rank: int, steps: int, lines: int
) -> None:
    from hpar_agent.collectors.steps import StepCollector
    from hpar_agent.collectors.zerocode import NO_STEPS, ZeroCode
    from hpar_agent.config import AgentConfig
    from hpar_agent.context import AgentContext
    from hpar_agent.topology import Topology

    counter = StepCollector()  # never installed: no hook
    counter.count = steps
    comp = ZeroCode("init_process_group")
    comp.install(AgentContext(AgentConfig(), Topology(local_rank=local_rank), components=[counter]))
    with caplog.at_level("WARNING", logger="hpar_agent"):
        comp.uninstall()
        comp.uninstall()
    assert [r.getMessage() for r in caplog.records].count(NO_STEPS) == lines
    assert ("note" in comp.summary()) == (steps == 0)  # every rank's summary carries it
