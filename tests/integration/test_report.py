"""``hpar-agent report``: a run directory of 4 ranks becomes one offline HTML page whose plots really
draw in headless Chromium, with every text from the files escaped and evidence linked relatively."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import stat
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import plotly  # noqa: F401  (a core dependency: losing it must fail, not skip)
import pytest

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.events import EventLog
from hpar_agent.exporters.otel import Tracing
from hpar_agent.spans import SpanRecord, StepRecord
from hpar_agent.tools import report, report_figures, run_files, summary
from hpar_agent.tools.cli import main as cli_main
from hpar_agent.topology import Topology

pytestmark = pytest.mark.integration

JOB = "job-report"
MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
RANKS = 4  # dp1 x tp2 x pp2: ranks 0,1 are stage 0, ranks 2,3 stage 1
STEPS = 6
HOSTILE = "<script>alert('x')</script>"  # free text a graph break could carry
GUARD = "0/0: L['x'].size()[0] == 8  # x.view(-1)  # model.py:41 in forward"


def step_ms(rank: int, step: int) -> int:
    """Step time of the fixture: the first step compiles, rank 3 straggles at step 4."""
    return 900 if step == 0 else 100 + 10 * rank + (250 if (rank, step) == (3, 4) else 0)


def allreduce_ms(rank: int, step: int) -> int:
    return 2 + (rank + step) % 3


def _stage(rank: int) -> int:
    return rank // 2


def _tracing(run_dir: Path, rank: int) -> Tracing:
    """The agent's own span pipeline writing ``traces.rank<R>.jsonl`` (the real OTLP/JSON exporter)."""
    agent = Agent(metrics_port=-1, run_dir=str(run_dir), trace_every=1, traces="file")
    agent.topology = Topology(
        rank=rank,
        world_size=RANKS,
        job_id=JOB,
        host="node0",
        tp=2,
        pp=2,
        tp_rank=rank % 2,
        pp_rank=_stage(rank),
        pp_stage=_stage(rank),
    )
    agent.outputs.run_dir = str(run_dir)
    tracing = Tracing(agent.context)
    assert tracing.kind == "file"
    return tracing


def _step_record(rank: int, step: int) -> StepRecord:
    start = T0 + step * 2000 * MS
    dur = step_ms(rank, step)
    # GPipe on 2 stages: stage 1's forwards start after stage 0's, its backwards come first; the gaps
    # (stage 0 waiting for stage 1's backward, stage 1 waiting for stage 0's forward) are the bubble.
    lag = 10 * _stage(rank)
    kids = [
        SpanRecord(
            cat.SPAN_PP_FORWARD,
            start + (5 + lag + 10 * mb) * MS,
            start + (14 + lag + 10 * mb) * MS,
            step,
            {cat.ATTR_MICROBATCH: mb, cat.ATTR_STREAM: "cpu"},
        )
        for mb in range(2)
    ]
    kids += [
        SpanRecord(
            cat.SPAN_PP_BACKWARD,
            start + (60 - lag + 12 * (1 - mb)) * MS,
            start + (71 - lag + 12 * (1 - mb)) * MS,
            step,
            {cat.ATTR_MICROBATCH: mb, cat.ATTR_STREAM: "cpu"},
        )
        for mb in range(2)
    ]
    ar = start + 50 * MS
    kids.append(
        SpanRecord(
            cat.SPAN_COLLECTIVE_PREFIX + "all_reduce",
            ar,
            ar + allreduce_ms(rank, step) * MS,
            step,
            {cat.ATTR_PG: "tp", cat.ATTR_OP: "all_reduce", cat.ATTR_BYTES: 4096, cat.ATTR_SEQ: step},
        )
    )
    if _stage(rank) == 0:
        kids.append(
            SpanRecord(
                cat.SPAN_COLLECTIVE_PREFIX + "send",
                ar + 5 * MS,
                ar + 6 * MS,
                step,
                {cat.ATTR_PG: "pp", cat.ATTR_OP: "send", cat.ATTR_PEER: rank + 2},
            )
        )
    return StepRecord(step=step, start_ns=start, end_ns=start + dur * MS, children=kids)


def _summary(rank: int, run_dir: Path) -> dict:
    return {
        "rank": rank,
        "pp_stage": _stage(rank),
        "topology": {
            "job": JOB,
            "host": "node0",
            "world_size": str(RANKS),
            "dp": "1",
            "tp": "2",
            "pp": "2",
            "backend": "gloo",
            "device": "cpu",
            "torch_version": "2.13.0",
        },
        "metrics_url": None,
        "run_dir": str(run_dir),
        "errors": {"collectives": 1} if rank == 1 else {},
        "components": {
            "steps": {
                "steps": STEPS,
                "tokens": 0,
                "step_seconds_p50": step_ms(rank, 2) / 1e3,
                "step_seconds_max": max(step_ms(rank, s) for s in range(STEPS)) / 1e3,
            },
            "pipeline": {"bubble_ratio": 0.25 + 0.05 * _stage(rank)},
            # the agent's histogram percentiles (bucket bounds): 10 ms, not the spans' 2-4 ms samples
            "collectives": {
                "ops": {"tp/all_reduce": 6 * STEPS},
                "timed": 6 * STEPS,
                "table": [
                    {
                        "pg": "tp",
                        "op": "all_reduce",
                        "count": 6 * STEPS,
                        "bytes": 4096 * 6 * STEPS,
                        "timed": 6 * STEPS,
                        "p50_s": 0.01 if rank != 3 else 0.025,
                        "p99_s": 0.05,
                        "busbw_bytes_per_s": 2.5e9,
                    }
                ],
            },
            "memory": {
                "rss_bytes": (900 + 100 * rank) * 2**20,
                "post_step_last": {"rss": (890 + 100 * rank) * 2**20},
                "allocator": {},
            },
            "nvml": {"up": False, "process_bytes": None},
        },
    }


def make_run(run_dir: Path) -> Path:
    """A run directory as 4 ranks of ``hpar-agent demo`` leave it (events, summaries, traces, trainer)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    evidence = run_dir / "evidence"
    evidence.mkdir()
    stack = evidence / "MemoryLeak-rank2-pyspy.txt"
    stack.write_text("Thread 0x1 (active): MainThread\n    step (train.py:120)\n")
    t0 = T0 / 1e9
    for rank in range(RANKS):
        log = EventLog(str(run_dir / f"events.rank{rank}.jsonl"), rank)
        log.emit("attach", topology={"job": JOB})
        log.emit("compile", compile_id="0/0", function="Block.forward model.py:40", outcome="ok", seconds=4.2)
        if rank in (0, 2):
            log.emit("graph_break", reason="gb0170", user_frame="model.py:57", text=f"print() {HOSTILE}")
            # as the compile collector writes it: the first guard in guard, failed_guards and message
            log.emit(
                "recompile",
                compile_id="0/1",
                function="forward /src/pkg/model.py:40",
                reason="size",
                guard=GUARD,
                failed_guards=[GUARD],
                message=f"Recompiling function forward:\n  triggered by:\n  - {GUARD}",
            )
        if rank == 2:
            log.emit(
                "alert",
                alert="MemoryLeak",
                state="firing",
                value=4.5e7,
                threshold=2**20,
                step=4,
                details={"source": "rss", "slope_bytes_per_step": 8 * 2**20},
                evidence=[str(stack)],
            )
            log.emit("alert", alert="MemoryLeak", state="resolved", value=0.0, evidence=[])
        log.emit("detach")
        log.close()
        (run_dir / f"summary.rank{rank}.json").write_text(json.dumps(_summary(rank, run_dir)))
        tracing = _tracing(run_dir, rank)
        for step in range(STEPS):
            assert tracing.export_step(_step_record(rank, step))
        tracing.shutdown(5.0)
        assert tracing.dropped == 0
    # events' ts are wall time; pin them so the compile timeline is ordered and ranks interleave
    for rank in range(RANKS):
        path = run_dir / f"events.rank{rank}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for i, rec in enumerate(lines):
            rec["ts"] = t0 + i + 0.1 * rank
        path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"ts": 1, "kind": "torn')
    for rank in range(RANKS):  # the reference trainer's per-rank records: every step, RSS leaking on rank 2
        steps = [
            {"step": i, "step_s": step_ms(rank, i) / 1e3, "rss_mb": 400.0 + (8 * i if rank == 2 else 0)}
            for i in range(STEPS)
        ]
        (run_dir / f"trainer.rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": steps}))
    losses = [4.0 - 0.3 * i for i in range(STEPS)]
    (run_dir / "trainer.json").write_text(json.dumps({"losses": losses, "step_times": [0.9, 0.1, 0.1, 0.1]}))
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run")


# ---------------------------------------------------------------------------------------- parsing
def test_load_run_reads_every_file(run_dir: Path) -> None:
    run = run_files.load_run(run_dir)
    assert run.ranks == [0, 1, 2, 3]
    assert sorted(run.summaries) == [0, 1, 2, 3]
    steps = {(s.rank, s.attrs[cat.ATTR_STEP]): s.seconds for s in run.spans if s.name == cat.SPAN_STEP}
    assert len(steps) == RANKS * STEPS
    for (rank, step), secs in steps.items():
        assert secs == pytest.approx(step_ms(rank, step) / 1e3)
    samples = report_figures.collective_samples(run)
    assert sorted(samples) == [("pp", "send"), ("tp", "all_reduce")]
    assert len(samples[("pp", "send")]) == 2 * STEPS  # stage-0 ranks only
    expected = sorted(allreduce_ms(r, s) / 1e3 for r in range(RANKS) for s in range(STEPS))
    assert sorted(samples[("tp", "all_reduce")]) == pytest.approx(expected)
    kinds = [e["kind"] for e in run.events]
    assert kinds.count("alert") == 2 and kinds.count("graph_break") == 2 and kinds.count("attach") == 4
    assert run.trainer["losses"][0] == 4.0
    assert [r["rss_mb"] for r in run.trainer_steps[2]] == [400.0 + 8 * i for i in range(STEPS)]
    assert sum("unreadable line" in p for p in run.problems) == RANKS  # the torn last lines


# ------------------------------------------------------------------------------------------ page
def _tags(page: str) -> list[tuple[str, dict[str, str | None]]]:
    """Every start tag of the page (script bodies are not parsed as markup, as in a browser)."""
    found: list[tuple[str, dict[str, str | None]]] = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            found.append((tag, dict(attrs)))

    Collect().feed(page)
    return found


def test_page_is_offline_escaped_and_links_evidence(run_dir: Path, tmp_path: Path) -> None:
    out = report.build_report(run_dir)
    assert out == run_dir / "report.html"
    page = out.read_text()
    assert 'data-plots-expected="8"' in page.replace("'", '"')
    tags = _tags(page)
    assert not [a for t, a in tags if "src" in a or ("href" in a and t == "link")]  # nothing to fetch
    assert [t for t, _ in tags].count("script") == 3  # plotly.js inline, the figures, the drawing code
    assert "Plotly.newPlot" in page and len(page) > 1_000_000
    assert HOSTILE not in page and "alert(&#x27;x&#x27;)" in page
    assert '<a href="evidence/MemoryLeak-rank2-pyspy.txt">' in page
    assert (
        "MemoryLeak" in page and "gb0170" in page and "job-report" in page and "<td>4.50e+07</td>" in page
    )  # three significant digits
    # written elsewhere, the link still reaches the file relative to the page
    other = report.build_report(run_dir, tmp_path / "pages" / "r.html")
    assert '<a href="../run/evidence/MemoryLeak-rank2-pyspy.txt">' in other.read_text()
    for page_path in (out, other):  # the README's promise: 0600 files in 0700 directories
        assert stat.S_IMODE(page_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(other.parent.stat().st_mode) == 0o700


def test_pipeline_timeline_shows_each_microbatch_and_the_bubble(run_dir: Path) -> None:
    run = run_files.load_run(run_dir)
    found = report_figures.pipeline_step(run)
    assert found is not None
    step, spans = found
    assert step == STEPS - 1 and {s.rank for s in spans} == set(range(RANKS))  # latest step on every rank
    fig = report_figures.fig_pipeline(run)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {cat.SPAN_PP_FORWARD, cat.SPAN_PP_BACKWARD}
    fwd, bwd = by_name[cat.SPAN_PP_FORWARD], by_name[cat.SPAN_PP_BACKWARD]
    assert list(fwd.text).count("F0") == RANKS and list(bwd.text).count("B1") == RANKS
    assert list(fwd.y).count("stage 1 · rank 3") == 2
    # stage 1 starts its first forward 10 ms after stage 0 (time from the step's first chunk)
    starts = {(y, t): b for y, t, b in zip(fwd.y, fwd.text, fwd.base, strict=True)}
    assert starts[("stage 0 · rank 0", "F0")] == pytest.approx(0.0)
    assert starts[("stage 1 · rank 2", "F0")] == pytest.approx(10.0)
    # the bubble: on every rank the bars cover less than the span from first to last chunk
    for rank in range(RANKS):
        mine = [s for s in spans if s.rank == rank]
        busy = sum(s.end_ns - s.start_ns for s in mine)
        assert busy < max(s.end_ns for s in mine) - min(s.start_ns for s in mine)


def test_collective_percentiles_are_the_terminal_summarys(run_dir: Path) -> None:
    """One source of truth: the report's p50/p99 are the agent's histogram figures that the terminal
    summary prints, not percentiles of the traced spans (2-4 ms here)."""
    from hpar_agent.tools.summary import _render_collectives, load_rank_summaries

    terminal = "\n".join(_render_collectives("collectives", load_rank_summaries(run_dir)))
    row = next(ln.split() for ln in terminal.splitlines() if "all_reduce" in ln)
    assert row[4:8] == ["25.0", "ms", "50.0", "ms"]  # worst rank's p50 and p99
    run = run_files.load_run(run_dir)
    rows = summary.collective_rows([{"rank": r, **s} for r, s in run.summaries.items()])
    table = report.collectives_table(run, report_figures.collective_samples(run), rows)
    cells = re.findall(r"<td>([^<]*)</td>", table)
    i = cells.index("all_reduce")
    assert cells[i + 4 : i + 6] == ["25.0 ms", "50.0 ms"]
    assert cells[i + 6] == "2.50x" and cells[i + 7] == "2.50 GB/s"  # p50 skew across ranks, bus bandwidth
    assert cells[i + 3] == "576 KiB"  # 4 KiB x 36 ops x 4 ranks
    assert (
        summary.COLLECTIVE_PERCENTILE_SOURCE in terminal
        and html.escape(summary.COLLECTIVE_PERCENTILE_SOURCE) in table
    )
    skew = report_figures.fig_collective_ranks(rows)
    assert [round(v, 3) for v in skew.data[0].y] == [10.0, 10.0, 10.0, 25.0]


def test_recompile_rows_show_the_guard_once_shortened(run_dir: Path) -> None:
    run = run_files.load_run(run_dir)
    table = report.compile_table(run)
    guard = "L[&#x27;x&#x27;].size()[0] == 8"
    assert table.count(guard) == 2  # one row per recompile (ranks 0 and 2), the guard once in each
    assert "forward model.py:40 · size: " + guard in table
    assert "Recompiling function" not in table and "failed_guards" not in table and "0/0:" not in table
    assert "/src/pkg" not in table  # the function by file name, not the install path
    assert (
        report_figures.short_guard("x" * 500).endswith("…")
        and len(report_figures.short_guard("x" * 500)) == report_figures.GUARD_CHARS
    )


def test_compile_events_sit_on_the_step_axis(run_dir: Path) -> None:
    """Events carry wall time only; placed between the traced steps of their rank (2 s apart here)."""
    run = run_files.load_run(run_dir)
    fig = report_figures.fig_compile(run)
    assert fig.layout.xaxis.title.text.startswith("step")
    xs = [x for t in fig.data for x in t.x]
    assert xs and all(0 <= x <= STEPS for x in xs)
    anchors = report_figures.step_anchors(run)
    t0 = T0 / 1e9
    assert report_figures.event_step({"rank": 0, "ts": t0 + 2.0}, anchors) == pytest.approx(
        1.0
    )  # step 1 starts
    assert report_figures.event_step({"rank": 0, "ts": t0 + 2.05}, anchors) == pytest.approx(
        1.5
    )  # mid step 1 (100 ms)
    assert report_figures.event_step({"rank": 0, "ts": t0 + 3.0}, anchors) == pytest.approx(
        2.0
    )  # between steps 1 and 2
    assert report_figures.event_step({"rank": 0, "ts": t0 - 5}, anchors) == 0.0
    assert report_figures.event_step({"rank": 0, "ts": t0, "step": 4}, anchors) == 4.0


def test_own_script_run_gets_a_useful_page(run_dir: Path) -> None:
    """A user's script writes no trainer files: no empty loss section, a line saying what is shown."""
    for p in [run_dir / "trainer.json", *run_dir.glob("trainer.rank*.json")]:
        p.unlink()
    page = report.build_report(run_dir).read_text()
    assert "no losses" not in page and "<h2>Loss</h2>" not in page
    assert "A run of your own script" in page
    assert "<h2>Pipeline</h2>" in page and "<h2>Collectives</h2>" in page


def test_empty_run_dir_still_renders(tmp_path: Path) -> None:
    out = report.build_report(tmp_path)
    page = out.read_text()
    assert 'data-plots-expected="0"' in page.replace("'", '"')
    assert "no train.step spans" in page and "no alerts fired" in page


def test_the_page_names_the_culprits(tmp_path: Path) -> None:
    """A hang's culprit from the ranks' events, and the first rank to end from a state file of a rank that
    died without exiting (a state file as a SIGKILL leaves it)."""
    import struct

    from hpar_agent import rankstate

    for rank in (0, 1):
        log = EventLog(str(tmp_path / f"events.rank{rank}.jsonl"), rank)
        log.emit(
            "alert",
            alert="Hang",
            state="firing",
            step=40,
            value=20.0,
            threshold=16.0,
            evidence=[],
            details={
                "culprits": [2],
                "victims": [0, 1],
                "kind": "missing",
                "waits": [
                    {"pg": "default_pg", "seq": 46, "op": "all_reduce", "waiting": [0, 1], "missing": [2]}
                ],
            },
        )
        log.close()
    data = bytearray(rankstate.SIZE)
    struct.pack_into("<4siiiqqqiiq", data, 0, rankstate.MAGIC, 999_999, 2, 3, 1, 40, 0, 0, 0, 0)
    data[struct.calcsize("<4siiiqqqiiq") :][:7] = b"no-such"  # another host: its process cannot be read here
    (tmp_path / "state.rank2").write_bytes(bytes(data))
    page = report.build_report(tmp_path).read_text()
    assert "<h2>Culprits</h2>" in page
    assert (
        "culprit: rank 2 (Hang: not in default_pg all_reduce #46, which ranks 0, 1 wait in"
        in html.unescape(page)
    )
    assert (
        "first to end abnormally: rank 2, no end recorded (on another host: killed, or still running)"
        in html.unescape(page)
    )


def test_cli_and_demo_hook(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli.html"
    assert cli_main(["report", str(run_dir), "-o", str(target)]) == 0
    assert target.stat().st_size > 1_000_000 and str(target) in capsys.readouterr().out
    assert cli_main(["report", str(tmp_path / "missing")]) == 2  # refused in one line, nothing written
    assert report.write_report(tmp_path / "missing") is None  # the demo's call never raises
    assert report.write_report(run_dir) == run_dir / "report.html"


# -------------------------------------------------------------------------------------- browser
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def _browser(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    exe = _chromium()
    assert exe
    flags = [
        *"--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking --disable-component-update --disable-sync".split(),
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
    ]
    return subprocess.run(
        [exe, *flags, *extra, page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install chromium)")
def test_every_plot_draws_in_chromium(run_dir: Path, tmp_path: Path) -> None:
    page = report.build_report(run_dir)
    res = _browser(page, tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    body = re.search(r"<body[^>]*>", res.stdout)
    assert body, res.stdout[:500]
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(0)))
    assert attrs.get("plots-expected") == "8"
    assert attrs.get("plots-drawn") == "8", (attrs, res.stderr[-2000:])
    assert "errors" not in attrs, attrs
    console = [ln for ln in res.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    # the collective box plot drew one box per (pg, op); the step plot one line per rank
    assert res.stdout.count('class="trace boxes"') == 2
    # steps: a trainer line and a span trace per rank; RSS over steps: one line per rank; loss; compile kinds
    assert res.stdout.count('class="trace scatter') == 2 * RANKS + RANKS + 1 + 3
    if os.environ.get("HPAR_REPORT_SCREENSHOT"):
        shot = Path(os.environ["HPAR_REPORT_SCREENSHOT"])
        _browser(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,4200")
        assert shot.stat().st_size > 10_000
