"""The step anatomy on CUDA: phases timed by CUDA events, a slow data loader read as input-bound with its
injected delay in the data wait, and ``hpar-agent compare`` flagging the slow run against the clean one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def anatomy(run: Path) -> dict[str, Any]:
    return dict(json.loads((run / "summary.rank0.json").read_text())["components"]["anatomy"])


def test_phases_are_timed_by_cuda_events(trainer_runs: dict[str, Path]) -> None:
    a = anatomy(trainer_runs["clean"])
    assert a["clock"] == "cuda-events", a
    p50 = a["phase_seconds_p50"]
    assert {"data_wait", "forward", "backward", "optimizer"} <= set(p50), p50
    assert all(p50[p] > 0 for p in ("forward", "backward", "optimizer")), p50
    assert sum(p50.values()) <= 1.2 * a["step_seconds_p50"], a  # the phases partition the step


def test_a_slow_loader_is_input_bound_and_compare_flags_the_run(trainer_runs: dict[str, Path]) -> None:
    slow, clean = anatomy(trainer_runs["slow-data"]), anatomy(trainer_runs["clean"])
    assert slow["verdict"] == "input-bound", slow
    assert slow["phase_seconds_p50"]["data_wait"] >= 0.045, slow  # the injected 50 ms a batch (a sleep)
    assert slow["phase_seconds_p50"]["data_wait"] - clean["phase_seconds_p50"]["data_wait"] > 0.025, (
        slow,
        clean,
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpar_agent",
            "compare",
            str(trainer_runs["clean"]),
            str(trainer_runs["slow-data"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]


def test_under_hpar_agent_run_the_verdict_is_the_attached_runs(
    trainer_runs: dict[str, Path], tmp_path: Path
) -> None:
    """The clean trainer under ``hpar-agent run`` attaching nothing itself (``--no-agent``): the model is
    found at an optimizer step (the trainer keeps it in a list attribute), its phases are CUDA-event
    phases, and the verdict is the attached clean run's."""
    from testkit.zerocode import clean_env, run_cmd

    from .conftest import TRAINER

    run = tmp_path / "zero-code"
    cmd = run_cmd(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc-per-node=1 -m hpar_trainer".split(),
            *TRAINER,
            "--no-agent",
        ]
    )
    env = clean_env(run, HPAR_METRICS_PORT="-1", HPAR_TRACES="none", HPAR_DETAIL_RATE="0")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    zero, attached = anatomy(run), anatomy(trainer_runs["clean"])
    assert zero["model"]["found_by"] in ("wrapper", "optimizer step") and zero["clock"] == "cuda-events", zero
    assert zero["verdict"] == attached["verdict"], (zero, attached)
