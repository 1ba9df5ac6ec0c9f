"""``hpar-agent compare`` on synthetic run directories, the anatomy summary section and the report."""

from __future__ import annotations

import json
from pathlib import Path

import plotly  # noqa: F401  (a core dependency: losing it must fail, not skip)
import pytest

from hpar_agent.tools.cli import main as cli_main
from hpar_agent.tools.compare import digest, parse_threshold, regressions, rows
from hpar_agent.tools.summary import load_rank_summaries, render_summary


def _run(path: Path, step: float, backward: float, verdicts: tuple[str, str] = ("compute-bound", "compute-bound"),
         alerts: tuple[str, ...] = ()) -> Path:
    path.mkdir(parents=True)
    for rank in (0, 1):
        phases = {"data_wait": 0.01, "forward": 0.02, "backward": backward, "optimizer": 0.005}
        summary = {
            "rank": rank, "pp_stage": 0, "errors": {},
            "components": {
                "steps": {"steps": 10, "step_seconds_p50": step},
                "anatomy": {"step_seconds_p50": step - 0.001 * rank, "phase_seconds_p50": phases,
                            "verdict": verdicts[rank], "clock": "cpu",
                            "evidence": {"shares": {k: v / step for k, v in phases.items()}, "other_share": 0.0}},
                "collectives": {"table": [{"pg": "dp", "op": "all_reduce", "count": 20, "p50_s": None}]},
                "memory": {"rss_bytes": 100 << 20, "allocator": {}},
                "compile": {"compile_seconds_total": 1.5},
            },
        }  # fmt: skip
        (path / f"summary.rank{rank}.json").write_text(json.dumps(summary))
        events = [{"kind": "alert", "state": "firing", "alert": a, "rank": rank} for a in alerts if rank == 1]
        (path / f"events.rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "trainer.json").write_text(json.dumps({"losses": [4.0, 3.0], "step_times": [1.0, step, step]}))
    return path


def test_digest_takes_the_slowest_rank_and_reads_alerts(tmp_path: Path) -> None:
    d = digest(_run(tmp_path / "a", 0.1, 0.05, alerts=("Straggler",)))
    assert d["step"] == pytest.approx(0.1) and d["phases"]["backward"] == pytest.approx(0.05)
    assert d["collectives"]["dp/all_reduce"]["count"] == 40
    assert d["alerts"] == {"Straggler": 1} and d["compile"] == 1.5 and d["memory_peak"] == 100 << 20
    assert d["final_loss"] == 3.0 and d["trainer_step"] == pytest.approx(0.1)


def test_regression_past_the_threshold_fails_and_a_named_phase_is_checked(tmp_path: Path) -> None:
    a = digest(_run(tmp_path / "a", 0.100, 0.050))
    b = digest(_run(tmp_path / "b", 0.104, 0.060))  # step +4%, backward +20%
    table = rows(a, b)
    assert regressions(table, ("step",), 0.05) == []
    bad = regressions(table, ("step", "backward"), 0.05)
    assert [r.key for r in bad] == ["backward"] and bad[0].change == pytest.approx(0.2)
    assert [r.key for r in regressions(table, ("step",), 0.03)] == ["step"]
    assert regressions(table, ("comm_exposed",), 0.05)[0].change is None  # asked for, not measured: fails


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run(tmp_path / "a", 0.100, 0.050)
    b = _run(tmp_path / "b", 0.130, 0.050, alerts=("Straggler",))
    assert cli_main(["compare", str(a), str(a)]) == 0
    assert "ok: step within +5.0%" in capsys.readouterr().out
    assert cli_main(["compare", str(a), str(b), "--max-regression", "35%"]) == 0
    assert cli_main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: step time p50 (slowest rank) +30.0%" in out
    assert "alert Straggler fired" in out
    assert cli_main(["compare", str(a), str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.1", 0.1), ("12.5%", 0.125)])
def test_threshold_parsing(text: str, value: float) -> None:
    assert parse_threshold(text) == pytest.approx(value)


def test_summary_shows_phases_verdicts_and_who_holds_the_others(tmp_path: Path) -> None:
    run = _run(tmp_path / "a", 0.100, 0.050, verdicts=("compute-bound", "input-bound"))
    text = render_summary({}, load_rank_summaries(run), run, 1.0, 0)
    assert "where the step time goes" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("1 ") and "input-bound" in ln)
    assert "50.0 ms 50%" in line  # backward p50 and its share
    assert "rank 1 holds the others back" in text
    unknown = _run(tmp_path / "b", 0.100, 0.050, verdicts=("unknown", "host-bound"))
    for path in unknown.glob("summary.rank0.json"):
        s = json.loads(path.read_text())
        s["components"]["anatomy"]["evidence"]["reason"] = "the phases explain 9% of the step"
        path.write_text(json.dumps(s))
    text = render_summary({}, load_rank_summaries(unknown), unknown, 1.0, 0)
    assert "rank 0: unknown: the phases explain 9% of the step" in text and "rank 1 holds the others back" in text


def test_report_shows_anatomy_and_the_comparison(tmp_path: Path) -> None:
    from hpar_agent.tools.report import build_report

    a = _run(tmp_path / "a", 0.100, 0.050, verdicts=("compute-bound", "input-bound"))
    b = _run(tmp_path / "b", 0.130, 0.050)
    assert cli_main(["report", str(a), "--compare", str(b), "-o", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "Where the step time goes" in page and "<b>input-bound</b>" in page
    assert "Compared with b" in page and "+30.0%" in page
    assert "Compared with" not in build_report(a).read_text()
