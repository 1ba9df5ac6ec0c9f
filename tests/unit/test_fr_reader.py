"""The reader process (HPAR_FR_READER=process, the default): full flight-recorder reads fetched from
torch's worker server, decoded and processed in a child process, on a real gloo group; the same
counts and kept entries as reads on the agent thread, and an in-process fallback that counts nothing
twice when the child dies."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from hpar_agent.agent import Agent
from hpar_agent.collectors import fr_reader
from hpar_agent.collectors.fr_ledger import Ledger
from hpar_agent.torch_compat import flight_recorder as fr

L = {"rank": "0", "pp_stage": "0", "pg": "default_pg", "op": "all_reduce"}


@pytest.fixture
def agent(tmp_path, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # every tick a new fr_interval slot: a full read whenever something moved; only the test's ticks
    # (no agent thread: it would probe the ring, empty at attach, and read it between them)
    monkeypatch.setattr(Agent, "_run", lambda self: None)
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600.0, fr_interval=1e-6,
              fr_reader="process")
    a.start()
    try:
        yield a
    finally:
        a.stop()
        dist.destroy_process_group()


def _all_reduces(n: int, numel: int = 8) -> None:
    x = torch.ones(numel)
    for _ in range(n):
        dist.all_reduce(x)


def test_the_reader_process_counts_and_keeps_what_an_in_process_read_does(agent) -> None:
    c = agent.component("collectives")
    _all_reduces(12, numel=16)
    agent.tick()
    state = c.reader_state()
    assert state["mode"] == "process" and state["reads"] == 1 and state["cpu_s"] > 0
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", L) == 12
    assert get("hpar_collective_bytes_total", L) == 12 * 64
    # the same dump through the ledger on this thread gives the same kept entries
    inline = Ledger(attach_ns=c._attach_ns).process("gloo", fr.dump("gloo"), nccl_timing=False, now_ns=0)
    def keep(e):
        return {k: e[k] for k in ("pg", "seq", "op", "input_sizes", "input_dtypes", "record_id")}
    assert [keep(e) for e in c.recent_entries] == [keep(e) for e in inline.kept]
    assert len(c.recent_entries) == 12
    _all_reduces(3)
    agent.tick()
    assert get("hpar_collectives_total", L) == 15 and c.reader_state()["reads"] == 2


def test_a_dead_reader_gives_way_to_in_process_reads_at_its_cursor(agent) -> None:
    c = agent.component("collectives")
    _all_reduces(10)
    agent.tick()
    proc = c._reader.proc
    proc.kill()
    proc.wait(10)
    _all_reduces(5)
    agent.tick()  # the read fails, the agent thread reads from where the child stopped
    get = agent.registry.get_sample_value
    state = c.reader_state()
    assert state["mode"] == "inline" and state["reader"]["reads"] == 1 and "failed" in state["reader"]
    assert get("hpar_collectives_total", L) == 15
    assert get("hpar_collective_unobserved_total", {"rank": "0", "pp_stage": "0", "pg": "default_pg"}) is None
    assert get("hpar_agent_errors_total", {"rank": "0", "pp_stage": "0", "component": "collectives"}) == 1
    _all_reduces(2)
    agent.tick()
    assert get("hpar_collectives_total", L) == 17


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_reader_starved_at_sched_idle_is_started_again_at_nice_19(agent, monkeypatch, caplog) -> None:
    """A host with no idle core starves SCHED_IDLE helpers: a read that times out there (the child
    stopped, here) gives that read to the agent thread and starts a new reader at nice 19, which
    reads on from the applied cursor: nothing counted twice or lost, and it is not tried again."""
    import signal

    c = agent.component("collectives")
    _all_reduces(10)
    agent.tick()
    old = c._reader.proc
    assert c._reader.sched == "idle"
    monkeypatch.setattr(fr_reader, "TIMEOUT_S", 0.5)
    os.kill(old.pid, signal.SIGSTOP)
    try:
        _all_reduces(5)
        agent.tick()  # times out: this read inline
    finally:
        with contextlib.suppress(ProcessLookupError):  # closed (killed) by then
            os.kill(old.pid, signal.SIGCONT)
    get = agent.registry.get_sample_value
    assert c._reader is None and c._want_reader and get("hpar_collectives_total", L) == 15
    assert "restarting it at nice 19" in caplog.text
    _all_reduces(3)
    agent.tick()  # the new reader, below training at nice 19
    new = c._reader
    assert new is not None and new.sched == "nice" and new.proc.pid != old.pid
    assert os.sched_getscheduler(new.proc.pid) == os.SCHED_OTHER and os.getpriority(os.PRIO_PROCESS, new.proc.pid) == 19
    assert get("hpar_collectives_total", L) == 18 and c.reader_state()["mode"] == "process"
    assert get("hpar_collective_unobserved_total", {"rank": "0", "pp_stage": "0", "pg": "default_pg"}) is None


def test_a_read_prefetched_between_slices_is_applied_before_the_next_read(agent) -> None:
    """A paced pass spreads over most of the interval: a turnover read due within it is sent to the
    reader between two slices (the dump happens then) and applied at the next poll, first."""
    c = agent.component("collectives")
    _all_reduces(4)
    agent.tick()
    _all_reduces(6)
    c._due["gloo"] = time.time()  # the ring's turnover: due now
    agent._prefetch(time.time_ns() + 50_000_000)  # between two slices of a pass
    assert c._outstanding == {"gloo"} and c.read_reasons["ring refill"] == 1
    agent._prefetch(time.time_ns())  # already asked: not twice
    _all_reduces(5)  # the child may dump before or after these: a later read has the rest
    agent.tick()
    get = agent.registry.get_sample_value
    assert 10 <= get("hpar_collectives_total", L) <= 15 and not c._outstanding
    agent.stop()  # the final read
    assert get("hpar_collectives_total", L) == 15 and c.read_reasons["ring refill"] >= 1
    assert [e["seq"] for e in c.recent_entries] == list(range(1, 16))  # each once, in order


def test_a_reader_that_dies_with_a_prefetch_outstanding_gives_way_at_the_applied_cursor(agent) -> None:
    c = agent.component("collectives")
    _all_reduces(10)
    agent.tick()
    c._due["gloo"] = time.time()
    agent._prefetch(time.time_ns())
    c._reader.proc.kill()  # its answer never comes: the agent thread reads those entries itself
    c._reader.proc.wait(10)
    _all_reduces(5)
    agent.tick()
    get = agent.registry.get_sample_value
    assert c.reader_state()["mode"] == "inline"
    assert get("hpar_collectives_total", L) == 15  # each once: not from the ring's start, not skipped
    assert get("hpar_collective_unobserved_total", {"rank": "0", "pp_stage": "0", "pg": "default_pg"}) is None


def test_the_reader_process_yields_the_cpu_and_ends_with_the_agent(agent) -> None:
    c = agent.component("collectives")
    _all_reduces(1)
    agent.tick()
    proc = c._reader.proc
    assert proc.poll() is None
    if hasattr(os, "SCHED_IDLE"):  # HPAR_HELPER_SCHED's default: below training, not beside it
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
    agent.stop()
    assert proc.wait(5) == 0 and c._reader is None
    state = c.reader_state()  # what the summary says after detach: the final tick read too
    assert state == {"mode": "process", "recorders": ["gloo"], "reads": 2, "cpu_s": state["cpu_s"]}


def test_no_reader_process_without_a_process_group(tmp_path) -> None:
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600.0, fr_interval=1e-6)
    a.start()
    try:
        a.tick()
        assert a.component("collectives").reader_state() == {"mode": "inline"}
    finally:
        a.stop()


@pytest.mark.parametrize(("cpus", "local", "mode"), [(16, "4", "process"), (2, "4", "inline"), (2, None, "process")])
def test_auto_runs_the_reader_only_where_each_local_rank_has_two_cpus(tmp_path, monkeypatch, cpus, local, mode):
    """On an oversubscribed host (4 ranks on 2 cores) the reader and torch's dump thread take CPU from
    training: reads stay on the agent thread there."""
    monkeypatch.setattr(fr_reader.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600.0, fr_interval=1e-6)
    a.start()
    try:
        _all_reduces(1)
        a.tick()
        assert a.component("collectives").reader_state()["mode"] == mode
    finally:
        a.stop()
        dist.destroy_process_group()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")
def test_a_forked_child_drops_the_readers_pipes_and_the_parent_reads_on(tmp_path) -> None:
    """A DataLoader worker forked from a rank holds no copy of the reader's pipes (the reader still
    sees EOF when the rank ends) and the rank's reader keeps answering."""

    import hpar_agent

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    agent = hpar_agent.attach(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600.0,
                              fr_interval=1e-6, fr_reader="process")  # attached: the fork hook knows it
    try:
        _forked_child_and_parent(agent)
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()


def _forked_child_and_parent(agent) -> None:
    import time

    c = agent.component("collectives")
    _all_reduces(2)
    agent.tick()
    fds = (c._reader.proc.stdin.fileno(), c._reader.proc.stdout.fileno())
    pid = os.fork()
    if pid == 0:  # the child: the agent forgot its reader; the pipe fds are closed
        closed = 0
        for fd in fds:
            try:
                os.fstat(fd)
            except OSError:
                closed += 1
        os._exit(0 if c._reader is None and closed == 2 else 1)
    deadline = time.monotonic() + 30
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    if not done[0]:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0
    _all_reduces(3)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_collectives_total", L) == 5
    assert c.reader_state()["mode"] == "process"


def test_the_reader_outlives_the_signals_a_launcher_sends_its_process_group(agent) -> None:
    """Ctrl-C or torchrun's SIGTERM reach the reader too; it stays for the rank's final read and ends
    when the rank closes its stdin."""
    import signal
    import time

    c = agent.component("collectives")
    _all_reduces(1)
    agent.tick()
    proc = c._reader.proc
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc.send_signal(sig)
    time.sleep(0.3)
    assert proc.poll() is None
    _all_reduces(2)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_collectives_total", L) == 3
    assert c.reader_state()["mode"] == "process"


def test_a_torch_without_the_worker_server_reads_inline_and_counts_no_error(tmp_path, monkeypatch) -> None:
    from hpar_agent.torch_compat import fr_server

    monkeypatch.setattr(fr_server, "handler_names", lambda: set())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600.0, fr_interval=1e-6,
              fr_reader="process")
    a.start()
    try:
        _all_reduces(4)
        a.tick()
        assert a.component("collectives").reader_state() == {"mode": "inline"}
        assert a.registry.get_sample_value("hpar_collectives_total", L) == 4
        assert not a.errors
    finally:
        a.stop()
        dist.destroy_process_group()
