"""The event log and the traces file are size-capped with rotation, and one event is bounded."""

from __future__ import annotations

import json

import pytest

import hpar_agent
from hpar_agent import AgentConfig
from hpar_agent.events import MAX_FIELD_CHARS, MAX_RECORD_BYTES, EventLog


@pytest.fixture(autouse=True)
def _detach():
    yield
    hpar_agent.detach()


def test_event_log_rotates_at_the_cap_and_keeps_n_backups(tmp_path):
    path = tmp_path / "events.rank0.jsonl"
    log = EventLog(str(path), 0, max_bytes=4096, backups=2)
    for i in range(400):
        log.emit("graph_break", i=i, reason="x" * 100)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.rank0.jsonl", "events.rank0.jsonl.1", "events.rank0.jsonl.2"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 4096
    last = [json.loads(x) for x in path.read_text().splitlines()]
    assert last[-1]["i"] == 399  # the newest events are in the live file


def test_one_event_is_truncated_to_a_documented_size(tmp_path):
    path = tmp_path / "events.rank0.jsonl"
    log = EventLog(str(path), 0)
    log.emit("recompile", reason="r" * 200_000, frames=["f" * 1000] * 500)
    log.emit("many", **{f"k{i}": ["v" * 2000] * 8 for i in range(300)})
    log.close()
    lines = path.read_text().splitlines()
    first, second = (json.loads(x) for x in lines)
    assert first["reason"].startswith("r" * 1000) and "truncated" in first["reason"]
    assert len(first["reason"]) < MAX_FIELD_CHARS + 64
    assert all(len(line.encode()) <= MAX_RECORD_BYTES for line in lines)
    assert second["kind"] == "many" and second["truncated_bytes"] > MAX_RECORD_BYTES


def test_rotation_is_configured_from_the_environment(tmp_path, monkeypatch):
    """HPAR_LOG_MAX_BYTES caps each file; two rotated files are kept, so a log takes at most three times that."""
    monkeypatch.setenv("HPAR_LOG_MAX_BYTES", "2048")
    assert AgentConfig.load().log_max_bytes == 2048
    agent = hpar_agent.attach(
        metrics_port=-1, traces="file", trace_every=1, detectors=False, run_dir=str(tmp_path)
    )
    for _ in range(4):  # four export batches: the traces file rotates between them
        for _ in range(15):
            agent.events.emit("note", text="y" * 200)
            agent.step()
        agent.tick(final=True)
        agent.tracing.flush(10)
    hpar_agent.detach()
    names = sorted(p.name for p in tmp_path.iterdir())
    for log in ("events", "traces"):
        assert {f"{log}.rank0.jsonl.1", f"{log}.rank0.jsonl.2"} <= set(names), names
        assert f"{log}.rank0.jsonl.3" not in names, names
