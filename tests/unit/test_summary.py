"""The demo's end-of-run summary from synthetic per-rank summaries."""

from __future__ import annotations

import json
from pathlib import Path

from hpar_agent.tools.summary import load_rank_summaries, render_summary


def _rank(rank: int, stage: int, p50: dict[str, float], bubble: float | None = 0.25) -> dict:
    return {
        "rank": rank,
        "pp_stage": stage,
        "metrics_url": None,
        "errors": {},
        "components": {
            "steps": {"steps": 5, "step_seconds_p50": 0.5},
            "pipeline": {"schedule": "Schedule1F1B", "chunk_seconds_p50": p50, "bubble_ratio": bubble},
        },
    }


def _section(text: str, title: str) -> list[list[str]]:
    """The rows (split into cells) of the table under the line starting with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_per_stage_table_shows_forward_and_backward_p50_of_the_slowest_rank():
    ranks = [  # tp2 x pp2: two ranks per stage
        _rank(0, 0, {"0/forward": 0.010, "0/backward": 0.020}),
        _rank(1, 0, {"0/forward": 0.012, "0/backward": 0.018}),
        _rank(2, 1, {"1/forward": 0.030, "1/backward": 1.5}),
        _rank(3, 1, {"1/forward": 0.029, "1/backward": 1.25}),
    ]
    text = render_summary({"losses": [4.0, 3.0], "step_times": [1.0, 0.5]}, ranks, Path("run"), 12.0, 0)
    rows = _section(text, "pipeline stages")
    assert rows == [
        ["stage", "ranks", "forward", "p50", "backward", "p50"],
        ["0", "0,1", "12.0", "ms", "20.0", "ms"],
        ["1", "2,3", "30.0", "ms", "1.50", "s"],
    ]
    assert _section(text, "ranks:")[1][:2] == ["0", "0"]  # the per-rank table is still there


def test_per_stage_table_lists_virtual_stages_and_missing_phases():
    ranks = [  # interleaved: each rank holds stages r and r + 2; stage 3 saw no backward yet
        _rank(0, 0, {"0/forward": 0.001, "0/backward": 0.002, "2/forward": 0.003, "2/backward": 0.004}),
        _rank(1, 1, {"1/forward": 0.005, "1/backward": 0.006, "3/forward": 0.007}),
    ]
    rows = _section(render_summary({}, ranks, Path("run"), 1.0, 0), "pipeline stages")
    assert [r[:2] for r in rows[1:]] == [["0", "0"], ["1", "1"], ["2", "0"], ["3", "1"]]
    assert rows[-1][2:] == ["7.00", "ms", "-"]  # three significant digits


def test_no_pipeline_no_stage_table():
    ranks = [_rank(0, 0, {}, bubble=None)]
    ranks[0]["components"].pop("pipeline")
    text = render_summary({}, ranks, Path("run"), 1.0, 0)
    assert "pipeline stages" not in text
    assert _section(text, "ranks:")[1][5] == "-"  # bubble column: no pipeline, no bubble


def test_load_rank_summaries_orders_by_rank_number(tmp_path):
    for rank in (10, 2, 0):
        (tmp_path / f"summary.rank{rank}.json").write_text(json.dumps(_rank(rank, 0, {})))
    (tmp_path / "summary.rank3.json").write_text("{not json")
    assert [r["rank"] for r in load_rank_summaries(tmp_path)] == [0, 2, 10]


def _with_detectors(rank: dict, fired: bool = False) -> dict:
    rank["components"]["detectors"] = {"Hang": {"fired": 1 if fired else 0}, "GraphBreak": {"fired": 0}}
    return rank


def test_failed_ranks_are_named_with_their_error_and_silent_ranks_listed():
    """One rank of four wrote a summary; two crashed, one was stopped by torchrun: no clean-run claims."""
    ranks = [_with_detectors(_rank(0, 0, {}))]
    text = render_summary(
        {"losses": [4.0]},
        ranks,
        Path("run"),
        9.0,
        1,
        nproc=4,
        failures={2: "RuntimeError: Numpy is not available", 3: "RuntimeError: Numpy is not available"},
        exit_codes={1: -15, 2: 1, 3: 1},
    )
    assert "FAILED ranks: 2, 3" in text
    assert "  rank 2 (exit 1): RuntimeError: Numpy is not available" in text
    assert "stopped by torchrun after the failure: ranks 1" in text
    assert "no summary from ranks: 1, 2, 3" in text
    assert "every rank" not in text
    assert "alerts: none fired on ranks 0; ranks 1, 2, 3 wrote no summary" in text


def test_a_run_that_never_stepped_claims_no_alerts():
    ranks = [_with_detectors(_rank(r, 0, {})) for r in range(2)]
    for r in ranks:
        r["components"]["steps"]["steps"] = 0
    text = render_summary({}, ranks, Path("run"), 3.0, 1, nproc=2, failures={0: "ValueError: x"})
    assert "the run never stepped" in text and "alerts" not in text


def test_a_clean_run_says_every_rank_ran_the_detectors():
    ranks = [_with_detectors(_rank(r, 0, {})) for r in range(2)]
    text = render_summary({"losses": [1.0]}, ranks, Path("run"), 3.0, 0, nproc=2)
    assert "alerts: none fired (2 detectors ran on every rank)" in text
    assert "FAILED" not in text and "no summary from" not in text


def test_outputs_line_lists_only_files_that_exist(tmp_path):
    (tmp_path / "logs").mkdir()
    assert render_summary({}, [], tmp_path, 1.0, 1).splitlines()[-1] == "  logs/ (torchrun and rank logs)"
    for r in range(2):
        (tmp_path / f"events.rank{r}.jsonl").write_text("")
    (tmp_path / "trainer.json").write_text("{}")
    last = render_summary({}, [], tmp_path, 1.0, 0).splitlines()[-1]
    assert last == "  events.rank<R>.jsonl (event log) x2, trainer.json, logs/ (torchrun and rank logs)"
    assert render_summary({}, [], tmp_path / "none", 1.0, 1).splitlines()[-1] == "  nothing was written"
