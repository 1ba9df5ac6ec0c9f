"""Files the agent writes: never through planted links, private modes, checked directories, atomic
summaries; and every write guarded (a full disk is counted, never raised into user code)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys

import pytest

import hpar_agent
from hpar_agent import safefiles
from hpar_agent.evidence import Evidence


def _attach(run_dir, **kw):
    kw.setdefault("metrics_port", -1)
    kw.setdefault("traces", "file")
    kw.setdefault("detectors", False)
    return hpar_agent.attach(run_dir=str(run_dir), **kw)


@pytest.fixture(autouse=True)
def _detach():
    yield
    hpar_agent.detach()


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_planted_symlinks_are_never_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("summary.rank0.json", "events.rank0.jsonl", "traces.rank0.jsonl"):
        (run / name).symlink_to(victim)
    agent = _attach(run)
    agent.step()
    hpar_agent.detach()
    assert victim.read_text() == "precious\n"
    assert not (run / "summary.rank0.json").is_symlink()  # replaced atomically, the link itself
    assert json.loads((run / "summary.rank0.json").read_text())["rank"] == 0
    assert agent.errors["events"] >= 1  # the event log refused the link, and said so in the count
    assert _mode(run) == 0o755  # a run dir the user chose is used as it is; the files in it are private


def test_default_run_dir_is_checked_and_tightened(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hpar-runs").mkdir()
    (tmp_path / "hpar-runs" / "open-job").mkdir(mode=0o777)
    os.chmod(tmp_path / "hpar-runs" / "open-job", 0o777)
    agent = hpar_agent.attach(metrics_port=-1, traces="none", detectors=False, job_id="open-job")
    assert agent.run_dir == os.path.join("hpar-runs", "open-job")
    assert _mode(tmp_path / "hpar-runs" / "open-job") == 0o700
    hpar_agent.detach()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "hpar-runs" / "linked-job").symlink_to(elsewhere, target_is_directory=True)
    agent = hpar_agent.attach(metrics_port=-1, traces="none", detectors=False, job_id="linked-job")
    hpar_agent.detach()
    assert list(elsewhere.iterdir()) == []  # a planted link in place of the run dir is refused
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere",
        "hpar-runs",
    ]  # and nothing lands in cwd
    assert agent.errors["agent"] >= 1


def test_a_linked_hpar_runs_is_refused_and_a_named_one_followed(tmp_path, monkeypatch, caplog):
    """./hpar-runs is the agent's own name: a link there is refused like a linked run dir, with the way
    out in the message; the same link named in HPAR_RUN_DIR is the user's choice and is followed."""
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "hpar-runs").symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = hpar_agent.attach(metrics_port=-1, traces="file", detectors=False, job_id="j1")
        agent.step()
        hpar_agent.detach()
    assert list(elsewhere.iterdir()) == [] and agent.run_dir == ""
    assert agent.errors["agent"] == 1
    assert any(
        "hpar-runs is a symbolic link" in r.getMessage() and "HPAR_RUN_DIR" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(safefiles.UnsafePathError, match="HPAR_RUN_DIR"):
        safefiles.default_run_dir("demo-1")  # the tools' default directories too
    agent = _attach(tmp_path / "hpar-runs" / "j2")
    agent.step()
    hpar_agent.detach()
    assert (elsewhere / "j2" / "summary.rank0.json").is_file()


def test_the_default_parent_is_made_private(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hpar-runs").mkdir(mode=0o755)
    os.chmod(tmp_path / "hpar-runs", 0o755)
    assert safefiles.default_run_dir("j") == os.path.join("hpar-runs", "j")
    assert _mode(tmp_path / "hpar-runs") == 0o700 and _mode(tmp_path / "hpar-runs" / "j") == 0o700


def test_files_and_directories_are_private(tmp_path):
    run = tmp_path / "fresh"
    agent = _attach(run)
    agent.step()
    agent.tick()
    hpar_agent.detach()
    assert _mode(run) == 0o700
    for name in ("summary.rank0.json", "events.rank0.jsonl"):
        assert _mode(run / name) == 0o600, name


def test_every_directory_created_is_private_parents_too(tmp_path):
    """``os.makedirs`` gives its mode to the leaf only: the parents the agent (or ``hpar-agent run``)
    creates on the way, ``hpar-runs`` itself, must be 0700 as well; an existing parent is left alone."""
    (tmp_path / "shared").mkdir(mode=0o755)
    leaf = tmp_path / "shared" / "hpar-runs" / "run-1" / "evidence"
    safefiles.private_dir(str(leaf))
    for d in (tmp_path / "shared" / "hpar-runs", leaf.parent, leaf):
        assert _mode(d) == 0o700, d
    assert _mode(tmp_path / "shared") == 0o755


def test_evidence_refuses_a_symlinked_dir_and_never_overwrites(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "evidence").symlink_to(target, target_is_directory=True)
    errors = []
    ev = Evidence(str(run), 0, on_error=errors.append)
    assert ev.collect("t", ("fr",)) == []
    assert list(target.iterdir()) == [] and errors and isinstance(errors[0], safefiles.UnsafePathError)
    (run / "evidence").unlink()
    (run / "evidence").mkdir(mode=0o755)
    safefiles.private_dir(str(run / "evidence"))
    assert _mode(run / "evidence") == 0o700
    planted = run / "evidence" / "x.json"
    planted.symlink_to(tmp_path / "victim")
    with pytest.raises(OSError):
        safefiles.write_new(str(planted), b"data")
    assert not (tmp_path / "victim").exists()


class _FullDisk:
    """A file object whose every write fails as on a full disk."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        pass


def test_full_disk_is_counted_and_never_raises(tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    agent = _attach(run)
    hpar_agent_summary = run / "summary.rank0.json"
    agent.write_summary()
    good = hpar_agent_summary.read_text()
    agent.events._file._fh = _FullDisk()  # the disk fills mid-run

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safefiles.tempfile, "mkstemp", no_space)
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        for _ in range(5):
            agent.events.emit("something", text="x")
        agent.step()
        hpar_agent.detach()  # the detach event and the summary fail: counted, not raised
    assert agent.errors["events"] >= 6
    assert agent.errors["agent"] >= 1
    assert hpar_agent_summary.read_text() == good  # the previous summary stays whole
    assert sum("events failed" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_unwritable_run_dir_leaves_the_rest_of_the_agent_working(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    agent = _attach(blocker / "run", metrics_port=0, metrics_addr="127.0.0.1")
    assert agent.started and agent.metrics_url is not None
    assert agent.loop.thread is not None and agent.loop.thread.is_alive()
    agent.step()
    agent.tick()
    assert (
        agent.registry.get_sample_value(
            "hpar_agent_errors_total", {"rank": "0", "pp_stage": "0", "component": "agent"}
        )
        >= 1
    )
    hpar_agent.detach()


@pytest.mark.timeout(60)  # a blocking open of a FIFO would hang: fail instead
def test_a_fifo_or_socket_is_refused_by_kind_and_never_blocks(tmp_path):
    import socket

    fifo = tmp_path / "events.rank0.jsonl"
    os.mkfifo(fifo)
    for opener in (safefiles.open_regular, lambda p: safefiles.open_private(str(p))):
        with pytest.raises(safefiles.NotRegularError, match=f"^{fifo} is a FIFO, not a regular file$"):
            opener(fifo)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        with pytest.raises(safefiles.NotRegularError, match="is a socket, not a regular file"):
            safefiles.read_regular(tmp_path / "sock", 10)
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(OSError, match="larger than 10 bytes"):
        safefiles.read_regular(tmp_path / "big", 10)
    # a run state file that is a FIFO reads as no record
    from hpar_agent import rankstate

    assert rankstate.read(str(fifo)) is None


def test_every_tool_names_what_is_not_a_directory_in_the_same_words(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "file").write_text("")
    words = {
        name: safefiles.not_a_directory(tmp_path / name) for name in ("fifo", "loop1", "file", "none", ".")
    }
    assert words == {
        "fifo": "a FIFO, not a directory",
        "loop1": "a symbolic link loop",
        "file": "a regular file, not a directory",
        "none": "not found",
        ".": None,
    }
    for name in ("fifo", "loop1"):
        for argv in (["report", str(tmp_path / name)], ["compare", str(tmp_path / name), str(tmp_path)]):
            res = subprocess.run(
                [sys.executable, "-m", "hpar_agent", *argv], capture_output=True, text=True, timeout=60
            )
            assert res.returncode == 2 and f"{tmp_path / name}: {words[name]}" in res.stderr, res.stderr


def test_the_trainers_files_are_private_as_the_agents(tmp_path):
    from hpar_trainer.metrics import RankRecorder

    rec = RankRecorder(str(tmp_path / "run" / "trainer.json"), 0, {})
    rec.flush()
    assert rec.path is not None and json.loads(rec.path.read_text())["rank"] == 0
    assert stat.S_IMODE(os.stat(rec.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
