"""Gradient-sync coverage on 2 gloo ranks of the reference trainer (dp2, eager, 6 steps each, ~10 s):
a clean run reads 1, a block left outside DDP (ddp-nesting) reads below 1 and fires GradSyncIncomplete."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpar_agent.tools.diagnose import read_alerts
from hpar_agent.tools.launch import run_trainer

pytestmark = pytest.mark.distributed


def _run(tmp_path: Path, *extra: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    env = {"HPAR_RUN_DIR": str(tmp_path), "HPAR_JOB_ID": "gradsync", "HPAR_METRICS_PORT": "-1", "HPAR_TRACES": "none"}
    args = ["--dp", "2", "--dp-mode", "ddp", "--compile", "eager", "--steps", "6", *extra, "--out", str(tmp_path / "t.json")]
    proc = run_trainer(2, args, env=env, timeout=240)
    assert proc.returncode == 0, (proc.stdout or "")[-2000:] + (proc.stderr or "")[-2000:]
    summaries = [json.loads((tmp_path / f"summary.rank{r}.json").read_text())["components"] for r in (0, 1)]
    return summaries, read_alerts(tmp_path)


def test_clean_ddp_covers_the_whole_gradient(tmp_path: Path) -> None:
    summaries, alerts = _run(tmp_path)
    for comps in summaries:
        gs = comps["gradsync"]
        assert gs["last_step"] >= 4 and gs["required_elements"] > 0, gs
        assert 1.0 <= gs["coverage_min"] < 1.001, gs  # a loss all-reduced over dp adds a few millionths
    assert not [a for a in alerts if a["alert"] == "GradSyncIncomplete"]


def test_ddp_nesting_shows_the_missing_share_at_once(tmp_path: Path) -> None:
    summaries, alerts = _run(tmp_path, "--inject", "ddp-nesting")
    for comps in summaries:
        gs = comps["gradsync"]
        assert 0.5 < gs["coverage"] < 0.95 and gs["coverage_min"] == gs["coverage"], gs  # every step short
        det = comps["detectors"]["GradSyncIncomplete"]
        assert det["fired"] == 1 and det["value"] == pytest.approx(gs["coverage"])
    assert {a["rank"] for a in alerts if a["alert"] == "GradSyncIncomplete" and a["state"] == "firing"} == {0, 1}
