"""``hpar-agent compare`` on synthetic run directories: the distribution judgement, its exit codes, bad
input named and refused, the anatomy summary section and the report's comparison."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import plotly  # noqa: F401  (a core dependency: losing it must fail, not skip)
import pytest

from hpar_agent import catalogue as cat
from hpar_agent.tools import compare as compare_mod
from hpar_agent.tools.cli import main as cli_main
from hpar_agent.tools.compare import compare, parse_threshold
from hpar_agent.tools.stats import MIN_STEPS, block_length, compare_medians
from hpar_agent.tools.summary import load_rank_summaries, render_summary

STEPS = 120


def ar1(seed: int, n: int = STEPS, phi: float = 0.5, base: float = 0.1, sd: float = 0.05) -> np.ndarray:
    """Step times with slow phases: log-normal noise correlated from step to step (AR(1), ``phi``)."""
    rng = np.random.default_rng(seed)
    e = rng.normal(0.0, sd * np.sqrt(1 - phi**2), n)
    x = np.empty(n)
    x[0] = rng.normal(0.0, sd)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + e[i]
    return base * np.exp(x)


def _run(
    path: Path,
    times: list[np.ndarray] | None = None,
    *,
    seed: int = 0,
    scale: float = 1.0,
    backward: float = 0.05,
    verdicts: tuple[str, str] = ("compute-bound", "compute-bound"),
    alerts: tuple[str, ...] = (),
    samples: bool = True,
    cpu_wait: float | None = 0.02,
) -> Path:
    """A 2-rank run directory as the agent leaves it, each rank's summary carrying its step times."""
    path.mkdir(parents=True)
    if times is None:
        job = ar1(seed) * scale
        times = [job, job * 0.98]  # the ranks move together, rank 1 a bit faster
    for rank in (0, 1):
        phases = {"data_wait": 0.01, "forward": 0.02, "backward": backward, "optimizer": 0.005}
        step = 0.1 * scale
        steps: dict = {
            "steps": STEPS,
            "step_seconds_p50": float(np.median(times[rank])),
            "cpu_wait_share": cpu_wait,
        }
        if samples:
            steps |= {
                "recent_step_seconds": [round(float(v), 7) for v in times[rank]],
                "recent_first_step": 0,
            }
        summary = {
            "rank": rank,
            "pp_stage": 0,
            "errors": {},
            "topology": {"world_size": "2"},
            "components": {
                "steps": steps,
                "anatomy": {
                    "step_seconds_p50": step,
                    "phase_seconds_p50": phases,
                    "verdict": verdicts[rank],
                    "clock": "cpu",
                    "evidence": {"shares": {k: v / step for k, v in phases.items()}, "other_share": 0.0},
                },
                "collectives": {"table": [{"pg": "dp", "op": "all_reduce", "count": 20, "p50_s": None}]},
                "memory": {"rss_bytes": 100 << 20, "allocator": {}},
                "compile": {"compile_seconds_total": 1.5},
            },
        }
        (path / f"summary.rank{rank}.json").write_text(json.dumps(summary))
        events = [{"kind": "alert", "state": "firing", "alert": a, "rank": rank} for a in alerts if rank == 1]
        (path / f"events.rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "trainer.json").write_text(json.dumps({"losses": [4.0, 3.0], "step_times": [1.0, 0.1]}))
    return path


# ----------------------------------------------------------------------------------- statistics
def test_identical_runs_pass_and_a_ten_percent_slower_run_fails_19_of_20() -> None:
    """The gate's promise on synthetic steps with slow phases (AR(1), 5% noise): identical runs judged
    "no regression" at least 19 times in 20, a run 10% slower "regressed" at least 19 times in 20."""
    same = [compare_medians(ar1(s), ar1(100 + s)).verdict(0.05) for s in range(20)]
    slow = [compare_medians(ar1(s), ar1(100 + s) * 1.10).verdict(0.05) for s in range(20)]
    assert sum(v != "regressed" for v in same) >= 19, same
    assert sum(v == "regressed" for v in slow) >= 19, slow


def test_the_block_bootstrap_keeps_slow_phases_from_looking_significant() -> None:
    """Strongly correlated steps (phi 0.9: phases of ~10 steps): the interval of two identical runs
    holds "no change" far more often with blocks than with an i.i.d. resampling of steps, which takes
    every step of a slow phase as fresh evidence."""
    pairs = [(ar1(s, 400, phi=0.9), ar1(100 + s, 400, phi=0.9)) for s in range(20)]
    assert all(block_length(a) >= 10 for a, _ in pairs)
    blocks = sum(compare_medians(a, b).verdict(0.0) == "no change" for a, b in pairs)
    iid = sum(compare_medians(a, b, block=1).verdict(0.0) == "no change" for a, b in pairs)
    assert blocks >= 17, blocks
    assert iid <= blocks - 5, (iid, blocks)


def test_too_few_steps_is_unknown_not_a_verdict(tmp_path: Path) -> None:
    few = ar1(0, MIN_STEPS + 1)  # the first 2 steps are warm-up
    a = _run(tmp_path / "a", [few, few])
    assert cli_main(["compare", str(a), str(a)]) == 2


def test_the_same_runs_always_get_the_same_interval() -> None:
    a, b = ar1(1), ar1(2)
    assert compare_medians(a, b) == compare_medians(a, b)


# ------------------------------------------------------------------------------------- the gate
def test_cli_verdicts_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _run(tmp_path / "a", seed=1)
    same = _run(tmp_path / "same", seed=2)
    slow = _run(tmp_path / "slow", seed=2, scale=1.3, alerts=("Straggler",))
    bit = _run(tmp_path / "bit", seed=1, scale=1.03)
    assert cli_main(["compare", str(a), str(same)]) == 0
    out = capsys.readouterr().out
    assert "step time: no significant change" in out and "95% interval" in out
    assert cli_main(["compare", str(a), str(slow)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: step time regressed by +30." in out and "past the +5.0% limit" in out
    assert "alert Straggler fired" in out and "A (baseline)" in out
    assert cli_main(["compare", str(a), str(slow), "--max-regression", "35%"]) == 0
    assert "slower by +30." in capsys.readouterr().out
    assert cli_main(["compare", str(a), str(bit)]) == 0  # significant, within the limit: said, not failed
    assert "step time: slower by +3.0%" in capsys.readouterr().out
    assert cli_main(["compare", str(slow), str(a)]) == 0
    assert "faster by -23." in capsys.readouterr().out


def test_runs_the_machine_treated_differently_are_not_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The training threads waited for a CPU 20% of the time in B, 2% in A: a +20% step time may be the
    machine's, so the verdict is unknown (with what was measured); 2% against 3% is judged; 35% and 34%
    is an oversubscribed machine, where equal waits do not mean equal treatment."""
    a = _run(tmp_path / "a", seed=1)
    busy = _run(tmp_path / "busy", seed=2, scale=1.2, cpu_wait=0.20)
    assert cli_main(["compare", str(a), str(busy)]) == 2
    out = capsys.readouterr().out
    assert (
        "UNKNOWN: step time: the training threads waited for a CPU 2% of the time in A and 20% in B: the "
        "machine's load alone could make B's steps 22.5% longer, and without it the change would read -1.5%"
        in out
    ), out
    assert "(no change); rerun both on a quiet machine (measured +20." in out and "+18.0 pts" in out, out
    calm = _run(tmp_path / "calm", seed=2, scale=1.3, cpu_wait=0.03)
    assert cli_main(["compare", str(a), str(calm)]) == 1
    unmeasured = _run(tmp_path / "unmeasured", seed=2, scale=1.3, cpu_wait=None)  # an older agent: judged
    assert cli_main(["compare", str(a), str(unmeasured)]) == 1
    capsys.readouterr()
    busy_a, busy_b = (
        _run(tmp_path / "busy_a", seed=1, cpu_wait=0.35),
        _run(tmp_path / "busy_b", seed=2, cpu_wait=0.34),
    )
    assert cli_main(["compare", str(busy_a), str(busy_b)]) == 2  # equally busy, but oversubscribed
    assert (
        "waited for a CPU 35% of the time in A and 34% in B: on a machine that busy"
        in capsys.readouterr().out
    )


def test_a_load_that_cannot_explain_the_change_leaves_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guard withholds a verdict only when the load difference could explain its direction and
    size. A quiet B 72% slower than a baseline that waited 16% of the time: the load could only make B
    look faster, so it is "regressed" (once reported "unknown", exit 2); likewise against a baseline
    past the oversubscription mark. B busier and 30% slower, where the load explains at most 22.5%:
    still regressed. A quiet B equal to a loaded baseline reads faster, which the load explains:
    unknown, never "faster"."""
    loaded = _run(tmp_path / "loaded", seed=1, cpu_wait=0.16)
    quiet_slow = _run(tmp_path / "quiet_slow", seed=2, scale=1.72, cpu_wait=0.0)
    assert cli_main(["compare", str(loaded), str(quiet_slow)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: step time regressed by +7" in out, out
    assert "load alone could make B's steps 16.0% shorter; without it the change would read +10" in out, out
    swamped = _run(tmp_path / "swamped", seed=1, cpu_wait=0.60)
    assert cli_main(["compare", str(swamped), str(quiet_slow)]) == 1
    assert "the load can only have hidden part of this change, not made it" in capsys.readouterr().out
    assert cli_main(["compare", str(quiet_slow), str(swamped)]) == 0  # B busier past the mark, yet faster
    assert "step time: faster by -42." in capsys.readouterr().out
    assert cli_main(["compare", str(swamped), str(swamped)]) == 2  # oversubscribed, no change: unknown
    capsys.readouterr()
    base = _run(tmp_path / "base", seed=1)
    busy_slow = _run(tmp_path / "busy_slow", seed=2, scale=1.3, cpu_wait=0.20)
    assert cli_main(["compare", str(base), str(busy_slow)]) == 1
    assert "22.5% longer; without it the change would read +6." in capsys.readouterr().out
    quiet_same = _run(tmp_path / "quiet_same", seed=2, scale=0.84, cpu_wait=0.0)
    assert cli_main(["compare", str(loaded), str(quiet_same)]) == 2
    out = capsys.readouterr().out
    assert "UNKNOWN: step time:" in out and "(no change); rerun both" in out, out


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.1", 0.1), ("12.5%", 0.125)])
def test_threshold_parsing(text: str, value: float) -> None:
    assert parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["nan", "inf", "-1%", "five"])
def test_bad_usage_exits_2(tmp_path: Path, bad: str) -> None:
    a = _run(tmp_path / "a")
    assert cli_main(["compare", str(a), str(a), f"--max-regression={bad}"]) == 2
    assert cli_main(["compare", str(a), str(tmp_path / "missing")]) == 2
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(a)])
    assert exc.value.code == 2


def test_a_bug_in_the_tool_is_neither_a_regression_nor_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_d: Path) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(compare_mod, "load", broken)
    a = _run(tmp_path / "a")
    assert cli_main(["compare", str(a), str(a)]) == 3
    assert "internal error" in capsys.readouterr().err


def test_a_phase_is_judged_from_the_sampled_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _run(tmp_path / "a", seed=1), _run(tmp_path / "b", seed=2)
    for run, scale in ((a, 1.0), (b, 1.5)):
        _traces(
            run,
            {r: {s: 0.05 * scale * (1 + 0.01 * (s % 7)) for s in range(0, STEPS, 2)} for r in (0, 1)},
            phase="backward",
        )
    assert cli_main(["compare", str(a), str(b), "--phase", "backward"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: backward regressed by +50.0%" in out and "step time:" in out
    c = _run(tmp_path / "c")  # no traces: the phase cannot be judged
    assert cli_main(["compare", str(a), str(c), "--phase", "backward"]) == 2
    assert (
        "UNKNOWN: backward: run B: none from rank(s) 0, 1 (sampled step.backward or pp.backward spans"
        in capsys.readouterr().out
    )


def test_a_pipeline_stages_phases_are_judged_from_its_microbatch_spans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pipeline stage's steps carry no ``step.forward``/``step.backward``: its microbatches'
    ``pp.forward``/``pp.backward`` spans, summed a step, are the phase (once "unknown" for ever)."""
    a, b = _run(tmp_path / "a", seed=1), _run(tmp_path / "b", seed=2)
    for run, scale in ((a, 1.0), (b, 1.5)):
        _traces(
            run,
            {r: {s: 0.05 * scale * (1 + 0.01 * (s % 7)) for s in range(0, STEPS, 2)} for r in (0, 1)},
            phase="backward",
            chunks=4,
        )
    assert cli_main(["compare", str(a), str(b), "--phase", "backward", "--phase", "forward"]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: backward regressed by +50.0%" in out, out
    assert "UNKNOWN: forward: run A: none from rank(s) 0, 1 (sampled step.forward or pp.forward" in out


def _traces(
    run: Path,
    per_rank: dict[int, dict[int, float]],
    phase: str | None = None,
    reason: str = "sampled",
    chunks: int = 0,
) -> None:
    """``traces.rank<R>.jsonl`` with a train.step span (and a ``step.<phase>`` child, or with ``chunks``
    a pipeline stage's ``pp.<phase>`` spans, one a microbatch, summing to it) per given step."""
    for rank, steps in per_rank.items():
        lines = []
        for step, secs in steps.items():
            t0 = 10**18 + step * 10**9
            spans = [(cat.SPAN_STEP, secs * 2 if phase else secs, {cat.ATTR_TRACE_REASON: reason})]
            if phase and chunks:
                spans += [(f"pp.{phase}", secs / chunks, {})] * chunks
            elif phase:
                spans.append((cat.SPAN_STEP_PHASES[phase], secs, {}))
            otlp = [
                {
                    "name": name,
                    "startTimeUnixNano": str(t0),
                    "endTimeUnixNano": str(t0 + int(d * 1e9)),
                    "attributes": [
                        {"key": cat.ATTR_STEP, "value": {"intValue": str(step)}},
                        *({"key": k, "value": {"stringValue": v}} for k, v in extra.items()),
                    ],
                }
                for name, d, extra in spans
            ]
            res = {"attributes": [{"key": cat.ATTR_RANK, "value": {"intValue": str(rank)}}]}
            lines.append(json.dumps({"resourceSpans": [{"resource": res, "scopeSpans": [{"spans": otlp}]}]}))
        (run / f"traces.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_summaries_without_step_times_fall_back_to_sampled_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An older agent's summaries carry no step times: the traces' sampled steps stand in; the slow
    steps the traces also keep are left out (they would bias the median)."""
    a, b = _run(tmp_path / "a", samples=False), _run(tmp_path / "b", samples=False)
    assert cli_main(["compare", str(a), str(b)]) == 2  # nothing per step at all
    assert (
        "UNKNOWN: step time: run A: none from rank(s) 0, 1 (sampled train.step spans"
        in capsys.readouterr().out
    )
    for run, seed, scale in ((a, 1, 1.0), (b, 2, 1.25)):
        x = ar1(seed, 60) * scale
        _traces(run, {r: {10 * i: float(v) for i, v in enumerate(x)} for r in (0, 1)})
    slow_kept = {r: {10 * i + 5: 50.0 for i in range(60)} for r in (0, 1)}
    for rank, steps in slow_kept.items():  # appended: kept because they were slow
        with (a / f"traces.rank{rank}.jsonl").open("a") as fh:
            for step, secs in steps.items():
                t0 = 10**18 + step * 10**9
                fh.write(
                    json.dumps(
                        {
                            "resourceSpans": [
                                {
                                    "scopeSpans": [
                                        {
                                            "spans": [
                                                {
                                                    "name": cat.SPAN_STEP,
                                                    "startTimeUnixNano": str(t0),
                                                    "endTimeUnixNano": str(t0 + int(secs * 1e9)),
                                                    "attributes": [
                                                        {
                                                            "key": cat.ATTR_STEP,
                                                            "value": {"intValue": str(step)},
                                                        },
                                                        {
                                                            "key": cat.ATTR_RANK,
                                                            "value": {"intValue": str(rank)},
                                                        },
                                                        {
                                                            "key": cat.ATTR_TRACE_REASON,
                                                            "value": {"stringValue": "slow"},
                                                        },
                                                    ],
                                                }
                                            ]
                                        }
                                    ]
                                }
                            ]
                        }
                    )
                    + "\n"
                )
    assert cli_main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: step time regressed by +2" in out


# ---------------------------------------------------------------------------------- bad input
def _summary_path(run: Path, rank: int = 1) -> Path:
    return run / f"summary.rank{rank}.json"


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p: p.write_text(p.read_text()[:200]), "summary.rank1.json: not JSON: "),
        (lambda p: p.write_bytes(pickle.dumps({"rank": 1})), "summary.rank1.json: not UTF-8 text"),
        (
            lambda p: p.write_text(
                p.read_text().replace('"step_seconds_p50": 0.', '"step_seconds_p50": NaN, "x": 0.')
            ),
            "summary.rank1.json: not valid JSON: holds NaN",
        ),
        (
            lambda p: p.write_text(
                p.read_text().replace('"step_seconds_p50": 0.', '"step_seconds_p50": 1e999, "x": 0.')
            ),
            "summary.rank1.json: not valid JSON: holds 1e999",
        ),
        (lambda p: p.write_text("[1, 2]"), "summary.rank1.json: not the expected document"),
        (lambda p: (p.unlink(), os.mkfifo(p)), "summary.rank1.json: a FIFO, not a regular file: skipped"),
        (lambda p: p.unlink(), "rank(s) 1 of 2 wrote no summary"),
    ],
    ids=["truncated", "pickle", "nan", "overflow", "array", "fifo", "missing"],
)
@pytest.mark.timeout(60)
def test_unreadable_input_is_named_and_judged_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, says: str
) -> None:
    """A truncated, binary, NaN-holding or odd summary, a FIFO in its place (reading it would wait
    forever) or a missing rank: exit 2 naming the file, never "ok" and never a traceback."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    damage(_summary_path(b))
    assert cli_main(["compare", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert says in out, out
    assert "UNKNOWN: run B" in out and "the slowest rank may be among them" in out and "ok" not in out.split()


def test_an_odd_field_is_dropped_and_named_the_rest_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    doc = json.loads(_summary_path(b).read_text())
    doc["components"]["memory"]["allocator"] = [1, 2]
    _summary_path(b).write_text(json.dumps(doc))
    assert cli_main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "summary.rank1.json: components.memory.allocator: [1, 2] is not of type 'object' (ignored)" in out
    doc["components"]["steps"]["recent_step_seconds"] = ["x"] * STEPS
    _summary_path(b).write_text(json.dumps(doc))
    assert cli_main(["compare", str(a), str(b)]) == 2  # rank 1's step times were the odd field
    out = capsys.readouterr().out
    assert "components.steps.recent_step_seconds[" in out
    assert "UNKNOWN: step time: run B: none from rank(s) 1 (the summaries' step times)" in out


# ------------------------------------------------------------------------ verdicts and the page
def test_changed_bottleneck_verdicts_are_said_plainly(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", seed=1)
    b = _run(tmp_path / "b", seed=2, verdicts=("compute-bound", "input-bound"))
    text = compare_mod.render_text(compare(a, b))
    assert "BOTTLENECK CHANGED: rank 1: compute-bound in A, input-bound in B" in text
    assert "bottleneck: the same in both runs (compute-bound on every rank)" in compare_mod.render_text(
        compare(a, a)
    )


def test_summary_shows_phases_verdicts_and_who_holds_the_others(tmp_path: Path) -> None:
    run = _run(tmp_path / "a", verdicts=("compute-bound", "input-bound"))
    text = render_summary({}, load_rank_summaries(run), run, 1.0, 0)
    assert "where the step time goes" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("1 ") and "input-bound" in ln)
    assert "50.0 ms 50%" in line  # backward p50 and its share
    assert "rank 1 holds the others back" in text
    unknown = _run(tmp_path / "b", verdicts=("unknown", "host-bound"))
    for path in unknown.glob("summary.rank0.json"):
        s = json.loads(path.read_text())
        s["components"]["anatomy"]["evidence"]["reason"] = "the phases explain 9% of the step"
        path.write_text(json.dumps(s))
    text = render_summary({}, load_rank_summaries(unknown), unknown, 1.0, 0)
    assert (
        "rank 0: unknown: the phases explain 9% of the step" in text
        and "rank 1 holds the others back" in text
    )


def test_report_labels_the_baseline_and_shows_the_judgement(tmp_path: Path) -> None:
    from hpar_agent.tools.report import build_report

    base = _run(tmp_path / "base", seed=1, verdicts=("compute-bound", "input-bound"))
    cand = _run(tmp_path / "cand", seed=2, scale=1.3)
    assert cli_main(["report", str(cand), "--compare", str(base), "-o", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "Compared with the baseline base" in page
    assert "<th>baseline: base</th><th>this run: cand</th><th>change from the baseline</th>" in page
    assert "REGRESSION: step time regressed by +30." in page
    assert "BOTTLENECK CHANGED: rank 1: input-bound in the baseline, compute-bound in this run" in page
    assert "Compared with" not in build_report(base).read_text()


def test_the_traces_cadence_counts_its_slow_steps_and_leaves_the_others_out() -> None:
    """Every 10th step is kept by cadence; step 30 was slow (kept as "slow", still the cadence's) and
    step 35 was slow only (kept besides): the median must see 30 and not 35."""
    from hpar_agent.tools.run_files import Span

    def step(n: int, secs: float, why: str) -> Span:
        return Span(cat.SPAN_STEP, 0, 0, int(secs * 1e9), {cat.ATTR_STEP: n, cat.ATTR_TRACE_REASON: why})

    spans = [step(n, 0.1, "sampled") for n in (0, 10, 20, 40)] + [
        step(30, 0.5, "slow"),
        step(35, 0.9, "slow"),
    ]
    assert compare_mod.traced_steps(spans, cat.SPAN_STEP) == {0: {10: 0.1, 20: 0.1, 30: 0.5, 40: 0.1}}


def test_the_traces_are_read_in_bounded_memory() -> None:
    """A stream of three times ``MAX_TRACED_STEPS`` sampled steps: only each rank's last
    ``MAX_TRACED_STEPS`` are kept (1 GiB of traces once took 20 GiB)."""
    from hpar_agent.tools.run_files import Span

    cap = compare_mod.MAX_TRACED_STEPS

    def spans():
        for n in range(3 * cap):
            attrs = {cat.ATTR_STEP: n, cat.ATTR_TRACE_REASON: "sampled"}
            yield Span(cat.SPAN_STEP, 0, 0, 10**8, attrs)
            yield Span(cat.SPAN_PP_FORWARD, 0, 0, 10**7, {cat.ATTR_STEP: n})
            yield Span(cat.SPAN_PP_FORWARD, 0, 0, 10**7, {cat.ATTR_STEP: n})

    out = compare_mod.traced_series(spans(), {"forward": compare_mod.SERIES_SPANS["forward"]})
    assert sorted(out["forward"][0]) == list(range(2 * cap, 3 * cap))
    assert all(v == pytest.approx(0.02) for v in out["forward"][0].values())


def test_a_slow_ranks_waiting_tp_peer_is_not_said_to_hold_the_others_back(tmp_path: Path) -> None:
    """Rank 1's verdict is slow-rank, rank 0's waits-for-slow-rank, each naming rank 1 (the demo's
    straggler run: rank 3 slow, its tp peer rank 2 waiting): only rank 1 holds the others back."""
    run = _run(tmp_path / "a", verdicts=("waits-for-slow-rank", "slow-rank"))
    for path in run.glob("summary.rank*.json"):
        s = json.loads(path.read_text())
        s["components"]["anatomy"]["evidence"]["slow_rank"] = 1
        path.write_text(json.dumps(s))
    text = render_summary({}, load_rank_summaries(run), run, 1.0, 0)
    assert "rank 1 holds the others back" in text and "rank 0, 1 holds" not in text
