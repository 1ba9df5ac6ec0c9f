"""What the offline tools read: regular files only, bounded, strict JSON, summaries of the expected
shape. Every damaged input is named and none stops a tool or makes it raise."""

from __future__ import annotations

import copy
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from hpar_agent.events import EventLog
from hpar_agent.health import finite
from hpar_agent.tools import compare, report, run_cmd, safe_read, summary_schema
from hpar_agent.tools.run_files import load_run, read_summaries
from hpar_agent.tools.summary import collective_rows, render_summary
from tests.unit.conftest import train_linear

pytestmark = pytest.mark.timeout(120)  # a read that blocks must fail the test, not hang the suite


# ------------------------------------------------------------------------------------ safe_read
def test_special_files_are_skipped_without_opening_them_for_long(tmp_path: Path) -> None:
    fifo, sock, folder = (
        tmp_path / "summary.rank0.json",
        tmp_path / "summary.rank1.json",
        tmp_path / "summary.rank2.json",
    )
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    folder.mkdir()
    (tmp_path / "summary.rank3.json").symlink_to("/dev/zero")  # endless: a read without bound never ends
    try:
        for path, kind in (
            (fifo, "a FIFO"),
            (sock, "a socket"),
            (folder, "a directory"),
            (tmp_path / "summary.rank3.json", "a character device"),
        ):
            with pytest.raises(safe_read.Unreadable, match=f"^{kind}, not a regular file: skipped$"):
                safe_read.read_json(path)
        problems: list[str] = []
        assert read_summaries(tmp_path, problems) == {}
        assert sorted(problems) == [
            "summary.rank0.json: a FIFO, not a regular file: skipped",
            "summary.rank1.json: a socket, not a regular file: skipped",
            "summary.rank2.json: a directory, not a regular file: skipped",
            "summary.rank3.json: a character device, not a regular file: skipped",
        ]
        os.rename(fifo, tmp_path / "events.rank0.jsonl")
        problems = []
        assert list(safe_read.read_jsonl(tmp_path / "events.rank0.jsonl", problems)) == []
        assert problems == ["events.rank0.jsonl: a FIFO, not a regular file: skipped"]
    finally:
        server.close()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"a": NaN}', "holds NaN, which is not a JSON number"),
        ('{"a": -Infinity}', "holds -Infinity"),
        ('{"a": 1e999}', "holds 1e999, too large for a float"),
        ('{"a": 1' + "0" * 400 + "}", "an integer past 64 bits"),
        ("[" * 100_000, "nested too deeply"),
        ('{"a": 1', "not JSON: Expecting ',' delimiter (line 1, column 8); the file ends early (cut short?)"),
        ('{"a": "bc', "not JSON: Unterminated string starting at (line 1, column 7); the file ends early"),
        (
            '{"a": 1,, "b": 2}',
            "not JSON: Expecting property name enclosed in double quotes (line 1, column 9)",
        ),
        ("", "empty"),
    ],
)
def test_strict_json(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(safe_read.Unreadable) as exc:
        safe_read.read_json(path)
    assert says in str(exc.value)


def test_reads_are_bounded(tmp_path: Path) -> None:
    big = tmp_path / "summary.rank0.json"
    big.write_text(json.dumps({"pad": "x" * 5000}))
    with pytest.raises(safe_read.Unreadable, match=r"^over 1000 bytes \(the tools' limit\): skipped$"):
        safe_read.read_json(big, limit=1000)
    lines = tmp_path / "events.rank0.jsonl"
    lines.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))  # 10890 bytes
    problems: list[str] = []
    assert len(list(safe_read.read_jsonl(lines, problems, limit=1000))) == 100
    assert problems == [
        "events.rank0.jsonl: read the first 990 bytes of 10890 bytes (the tools' limit for one file)"
    ]
    one_line = tmp_path / "traces.rank0.jsonl"
    one_line.write_bytes(b"x" * (4 << 20))  # no newline: a line reader would take it whole
    problems = []
    assert list(safe_read.read_jsonl(one_line, problems, limit=1000)) == []
    assert problems == ["traces.rank0.jsonl: read the first 0 bytes of 4 MiB (the tools' limit for one file)"]
    budget = safe_read.Budget(1500)  # a run's files share one budget
    problems = []
    assert len(list(safe_read.read_jsonl(lines, problems, limit=1000, budget=budget))) == 100
    assert len(list(safe_read.read_jsonl(lines, problems, limit=1000, budget=budget))) == 52
    assert (
        problems[-1]
        == "events.rank0.jsonl: read the first 510 bytes of 10890 bytes (the read budget of one run)"
    )


def test_jsonl_counts_what_it_cannot_use(tmp_path: Path) -> None:
    path = tmp_path / "events.rank0.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": NaN}\n[1, 2]\n\xff\xfe\n\n{"a": 2}\n{"a": 3')
    problems: list[str] = []
    assert list(safe_read.read_jsonl(path, problems)) == [{"a": 1}, {"a": 2}]
    assert problems == ["events.rank0.jsonl: 4 unreadable line(s) skipped"]


# ------------------------------------------------------------------------- what the agent writes
def test_the_agents_summary_is_strict_json_of_the_expected_shape(attach, tmp_path: Path) -> None:
    """A real agent's summary: no field the tools would drop, and its last steps' times."""
    agent = attach(None)
    train_linear(7)
    agent.tick()
    agent.write_summary()
    path = tmp_path / "summary.rank0.json"
    doc = safe_read.read_json(path)
    assert summary_schema.clean(doc) == []
    steps = doc["components"]["steps"]
    assert steps["recent_first_step"] == 0 and len(steps["recent_step_seconds"]) == steps["steps"] == 7
    assert "cpu_wait_share" in steps  # None here: less than 0.1 s since the first pass
    assert all(v > 0 for v in steps["recent_step_seconds"])


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or not hasattr(os, "sched_setaffinity"), reason="Linux"
)
def test_the_training_threads_wait_for_a_cpu_is_measured() -> None:
    """Two busy processes pinned to the training thread's one CPU: it waits for the CPU about two
    thirds of the time, whatever else the machine runs (the cause is planted on one core)."""
    import subprocess
    import sys
    import threading
    import time

    from hpar_agent.collectors.steps import StepCollector, cpu_wait_ns

    steps = StepCollector()
    steps.tid = threading.get_native_id()
    before = os.sched_getaffinity(0)
    cpu = min(before)
    burn = f"import os, time; os.sched_setaffinity(0, {{{cpu}}}); print(flush=True); t = time.time()\nwhile time.time() - t < 20: pass"
    procs = [subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"\n"  # pinned and burning
        os.sched_setaffinity(0, {cpu})
        steps.wait_origin = (time.monotonic_ns(), cpu_wait_ns(steps.tid) or 0)
        t = time.monotonic()
        while time.monotonic() - t < 1.0:
            pass
        share = steps.cpu_wait_share()
    finally:
        os.sched_setaffinity(0, before)
        for p in procs:
            p.kill()
            p.wait()
    assert share is not None and share > 0.4, share


def test_non_finite_numbers_are_written_as_null(tmp_path: Path) -> None:
    assert finite({"a": [math.nan, 1.0, {"b": math.inf}], "c": "nan"}) == {
        "a": [None, 1.0, {"b": None}],
        "c": "nan",
    }
    log = EventLog(str(tmp_path / "events.rank0.jsonl"), 0)
    log.emit("alert", alert="MemoryLeak", value=math.nan, details={"slope": -math.inf})
    log.close()
    rec = safe_read.loads((tmp_path / "events.rank0.jsonl").read_text())
    assert rec["value"] is None and rec["details"] == {"slope": None}


# ----------------------------------------------------------------------------- odd shapes, named
def rich_summary(rank: int = 0) -> dict[str, Any]:
    """A summary with every field the tools read, filled in."""
    return {
        "rank": rank,
        "pp_stage": 0,
        "metrics_url": "http://127.0.0.1:9470/metrics",
        "run_dir": "/r",
        "topology": {"world_size": "1", "dp": "1", "tp": "1", "pp": "1", "backend": "gloo", "job": "j"},
        "errors": {"collectives": 1},
        "components": {
            "steps": {
                "steps": 30,
                "tokens": 0,
                "step_seconds_p50": 0.1,
                "step_seconds_max": 0.3,
                "detail_stride": 1,
                "recent_step_seconds": [0.1 + 0.001 * i for i in range(30)],
                "recent_first_step": 0,
            },
            "pipeline": {"bubble_ratio": 0.2, "chunk_seconds_p50": {"0/forward": 0.01, "0/backward": 0.02}},
            "anatomy": {
                "clock": "cpu",
                "verdict": "compute-bound",
                "step_seconds_p50": 0.1,
                "phase_seconds_p50": {"forward": 0.03, "backward": 0.05, "optimizer": 0.01},
                "evidence": {
                    "shares": {"forward": 0.3, "backward": 0.5},
                    "other_share": 0.1,
                    "step_seconds_mean": 0.10123456789,
                },
            },
            "collectives": {
                "ops": {"dp/all_reduce": 30},
                "timed": 30,
                "table": [
                    {
                        "pg": "dp",
                        "op": "all_reduce",
                        "count": 30,
                        "timed": 30,
                        "bytes": 4096,
                        "p50_s": 0.01,
                        "p99_s": 0.02,
                        "busbw_bytes_per_s": 1e9,
                    }
                ],
            },
            "memory": {
                "rss_bytes": 1 << 30,
                "post_step_last": {"rss": 1 << 30},
                "allocator": {"peak": 1 << 20},
            },
            "nvml": {"up": False, "process_bytes": None},
            "compile": {
                "graphs": 2,
                "compile_seconds_total": 1.5,
                "fingerprint": 12,
                "recompiles": [{"reason": "size", "count": 1}],
                "graph_breaks": [
                    {"reason": "gb0170", "count": 1, "message": "print", "user_frames": ["m.py:3"]}
                ],
            },
            "detectors": {"Hang": {"fired": 1, "last_fired_step": 3, "evidence": ["evidence/hang.txt"]}},
            "zerocode": {"attached_at": "init_process_group"},
        },
    }


def _paths(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*path, k))
    elif isinstance(doc, list) and doc:
        out += _paths(doc[0], (*path, 0))
    return out


WRONG: list[Any] = ["x", [1], {"k": "v"}, None, -1.5, True, 2**62]


def _every_tool(run_dir: Path) -> str:
    """Run every reader of summaries on ``run_dir``; returns the problems they named."""
    problems: list[str] = []
    summaries = read_summaries(run_dir, problems)
    ranks = [summaries[r] for r in sorted(summaries)]
    render_summary({}, ranks, run_dir, 1.0, 0, nproc=1)
    run_cmd.rank_lines(run_dir)
    digest = compare.load(run_dir)
    compare.render_text(
        compare.Result(digest, digest, compare.rows(digest.figures, digest.figures, []), [], 0.05)
        if digest.figures
        else compare.compare(run_dir, run_dir)
    )
    compare.series(digest, "step")
    run = load_run(run_dir)
    rows = collective_rows([{"rank": r, **s} for r, s in sorted(run.summaries.items())])
    for table in (
        report.ranks_table(run),
        report.anatomy_table(run),
        report.memory_table(run),
        report.collectives_table(run, {}, rows),
        report.slow_rank_note(run),
    ):
        assert isinstance(table, str)
    return "\n".join(problems)


def test_every_field_of_the_wrong_type_is_named_and_no_tool_raises(tmp_path: Path) -> None:
    """Each field of a full summary (and each container) replaced by each wrong type in turn: every
    tool still runs, and a field the schema lists is named as ignored."""
    base = rich_summary()
    listed = 0
    for path in _paths(base):
        for wrong in WRONG:
            doc = copy.deepcopy(base)
            target = doc
            for p in path[:-1]:
                target = target[p]
            if type(target[path[-1]]) is type(wrong) and not isinstance(wrong, (dict, list)):
                continue
            target[path[-1]] = wrong
            run_dir = tmp_path / "run"
            run_dir.mkdir(exist_ok=True)
            (run_dir / "summary.rank0.json").write_text(json.dumps(doc))
            named = _every_tool(run_dir)
            if "(ignored)" in named:
                listed += 1
    assert listed > 200  # the schema covers most of what the tools read


def test_a_page_renders_from_a_summary_of_nothing_but_odd_fields(tmp_path: Path) -> None:
    for wrong in ("x", [1, 2], {"k": "v"}):
        doc = rich_summary()
        for comp in doc["components"].values():
            for key in comp:
                comp[key] = wrong
        run_dir = tmp_path / f"run-{type(wrong).__name__}"
        run_dir.mkdir()
        (run_dir / "summary.rank0.json").write_text(json.dumps(doc))
        (run_dir / "events.rank0.jsonl").write_text(
            json.dumps(
                {
                    "kind": "alert",
                    "rank": [1],
                    "ts": "x",
                    "step": {},
                    "evidence": ["a\u0000b"],
                    "details": {"v": 0.123456789},
                }
            )
        )
        (run_dir / "traces.rank0.jsonl").write_text(
            json.dumps({"resourceSpans": {"x": 1}})
            + "\n"
            + json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": "s"}]}]})
        )
        run = load_run(run_dir)
        assert any("summary.rank0.json: components." in p for p in run.problems)
        page = report.render(run, run_dir)
        assert "(not a usable path)" in page and "0.123456789" not in page and "0.123" in page


def test_report_names_what_it_skips_and_exits_by_the_documented_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpar_agent.tools.cli import main as cli_main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.rank0.json").write_text(json.dumps(rich_summary()))
    os.mkfifo(run_dir / "events.rank0.jsonl")  # reading it would wait for a writer forever
    (run_dir / "summary.rank1.json").write_text('{"rank": 1, "components": {"steps": {"steps": NaN}}}')
    assert cli_main(["report", str(run_dir), "-o", str(tmp_path / "page.html")]) == 0
    err = capsys.readouterr().err
    assert "warning: events.rank0.jsonl: a FIFO, not a regular file: skipped" in err
    assert "warning: summary.rank1.json: not valid JSON: holds NaN" in err
    page = (tmp_path / "page.html").read_text()
    assert "Unreadable input" in page and "summary.rank1.json: not valid JSON: holds NaN" in page
    (run_dir / "summary.rank0.json").write_bytes(b"\x80\x04\x95")  # a pickle: nothing readable is left
    assert cli_main(["report", str(run_dir)]) == 2
    assert "none of its files could be read" in capsys.readouterr().err
    (run_dir / "summary.rank0.json").write_text(json.dumps(rich_summary()))
    (tmp_path / "file").write_text("")
    assert cli_main(["report", str(run_dir), "-o", str(tmp_path / "file" / "page.html")]) == 2
    assert "cannot write the page" in capsys.readouterr().err
    assert cli_main(["report", str(run_dir), "--compare", str(tmp_path / "nowhere")]) == 2
