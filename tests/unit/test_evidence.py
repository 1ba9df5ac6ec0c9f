"""Evidence files: py-spy stacks and profiles (bounded, rate-limited, never waited on), flight-recorder
dumps, private modes, never through a planted link."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from typing import Any

import pytest

from hpar_agent.detectors.local import MemoryLeak
from hpar_agent.evidence import Evidence


def test_evidence_pyspy_json_and_rate_limit(tmp_path: Any) -> None:
    ev = Evidence(str(tmp_path), rank=3, min_interval_s=60)
    paths = ev.py_spy("Hang-1")
    assert sorted(p.rsplit(".", 2)[-2:][1] for p in paths) == ["json", "txt"]
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and ".rank3." in p
    with open(next(p for p in paths if p.endswith(".json")), encoding="utf-8") as fh:
        assert any(t.get("frames") for t in json.load(fh))
    assert stat.S_IMODE(os.stat(tmp_path / "evidence").st_mode) == 0o700
    assert ev.py_spy("Hang-2") == []  # rate-limited
    assert ev.allocator_snapshot("x") == []  # no CUDA history started on CPU


def _spin_for_profile(stop: Any) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_evidence_pyspy_record_profile_is_bounded_and_never_waited_on(tmp_path: Any) -> None:
    import threading

    stop = threading.Event()
    busy = threading.Thread(target=_spin_for_profile, args=(stop,), daemon=True)
    busy.start()
    try:
        ev = Evidence(str(tmp_path), rank=2, min_interval_s=60)
        t0 = time.monotonic()
        (path,) = ev.collect("MemoryLeak-1", MemoryLeak.evidence)[-1:]  # the profile comes last
        assert time.monotonic() - t0 < 1.5  # the 1-5 s recording is not waited for
        assert path.endswith(".profile.speedscope.json") and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.path.getsize(path) > 0 and ev.recording is not None  # a placeholder until py-spy is done
        ev.recording.join(30)
        with open(path, encoding="utf-8") as fh:
            prof = json.load(fh)
        names = {f["name"] for f in prof["shared"]["frames"]}
        assert "_spin_for_profile" in names and prof["profiles"]
        assert ev.py_spy_record("MemoryLeak-2", seconds=1) == []  # rate-limited
    finally:
        stop.set()


def test_evidence_fr_dump_and_missing_pyspy(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ev = Evidence(str(tmp_path), rank=0)
    paths = ev.fr_dump("CollectiveMismatch-1")
    assert paths and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    with open(paths[0], encoding="utf-8") as fh:
        assert "version" in json.load(fh)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("hpar_agent.evidence._beside_python", lambda name: None)
    caplog.set_level(logging.WARNING, logger="hpar_agent")
    assert Evidence(str(tmp_path / "b"), rank=0).py_spy("Hang-1") == []
    assert any("py-spy not found" in r.getMessage() for r in caplog.records)
