"""Full flight-recorder dumps through torch's worker server (what the reader process reads): the same
entries as the in-process dump, on a real gloo group, and torch's start/stop log lines kept off stderr."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
import torch.distributed as dist

from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat import fr_server

KEYS = ("record_id", "pg_id", "process_group", "collective_seq_id", "profiling_name", "input_sizes",
        "input_dtypes", "output_sizes", "is_p2p", "time_discovered_started_ns", "time_discovered_completed_ns")


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_normalize_json_spells_the_dump_as_the_pickle_does() -> None:
    data = {"pg_status": {"0": {"last_enqueued_collective": "5", "last_started_collective": "-1"}},
            "entries": [{"process_group": ["0", "default_pg"], "time_discovered_started_ns": 0,
                         "time_discovered_completed_ns": 7}]}
    out = fr_server.normalize_json(data)
    assert out["pg_status"] == {"0": {"last_enqueued_collective": 5, "last_started_collective": -1}}
    (e,) = out["entries"]
    assert e["process_group"] == ("0", "default_pg")
    assert e["time_discovered_started_ns"] is None and e["time_discovered_completed_ns"] == 7


def test_the_worker_server_dump_equals_the_in_process_dump(gloo) -> None:
    x = torch.ones(8)
    for _ in range(20):
        dist.all_reduce(x)
    server = fr_server.DumpServer(["gloo"])
    try:
        via = server.dump("gloo")
        direct = fr.dump("gloo")
        assert os.path.exists(server.path)
    finally:
        server.close()
    assert not os.path.exists(server.path)
    assert via["pg_status"] == direct["pg_status"]
    assert len(via["entries"]) == len(direct["entries"]) >= 20
    for a, b in zip(via["entries"], direct["entries"], strict=True):
        assert {k: a.get(k) for k in KEYS} == {k: b.get(k) for k in KEYS}


def test_a_dump_decoded_from_a_record_id_is_the_tail_of_the_whole(gloo) -> None:
    """The reader parses only the entries past its cursor: the same entries and status as the whole
    dump, none past the newest, and the whole dump wherever the slice is not what it expects."""
    x = torch.ones(8)
    for _ in range(30):
        dist.all_reduce(x)
    server = fr_server.DumpServer(["gloo"])
    try:
        handler, query = server.handlers["gloo"]
        body = fr_server.post(server.path, handler, query)
    finally:
        server.close()
    assert handler.endswith("json")
    whole = fr_server.decode(handler, body)
    ids = [e["record_id"] for e in whole["entries"]]
    assert ids == list(range(ids[0], ids[0] + len(ids))) and len(ids) >= 30
    for first in (ids[0], ids[10], ids[-1], ids[-1] + 1):
        part = fr_server.decode(handler, body, first)
        assert part["pg_status"] == whole["pg_status"] and part["pg_status"]
        assert part["entries"] == [e for e in whole["entries"] if e["record_id"] >= first]
    assert fr_server.decode(handler, body, ids[-1] + 5)["entries"] == whole["entries"]  # not in the ring: all
    # an entry overwritten before the read (the ledger counts the gap), or objects before record_id
    # (stack frames): parsed whole
    def body_of(entries: list) -> bytes:
        return json.dumps({"entries": entries, "pg_status": {"0": {"last_enqueued_collective": "7"}}},
                          separators=(",", ":")).encode()

    plain = body_of([{"process_group": ["0", ""], "record_id": i, "state": "completed"} for i in (5, 6, 7)])
    assert [e["record_id"] for e in fr_server.decode(handler, plain, 6)["entries"]] == [6, 7]
    assert [e["record_id"] for e in fr_server.decode(handler, plain, 3)["entries"]] == [5, 6, 7]
    framed = body_of([{"frames": [{"name": "f"}], "record_id": i, "state": "completed"} for i in (5, 6, 7)])
    assert [e["record_id"] for e in fr_server.decode(handler, framed, 6)["entries"]] == [5, 6, 7]


def test_the_ledger_wants_every_entry_first_and_then_those_past_its_cursor() -> None:
    from hpar_agent.collectors.fr_ledger import Ledger

    led = Ledger(attach_ns=0)
    assert led.wanted_from("gloo") is None
    entries = [{"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1,
                "profiling_name": "gloo:all_reduce", "input_sizes": [[4]], "input_dtypes": ["Float"],
                "output_sizes": [[4]], "output_dtypes": ["Float"], "time_created_ns": 1, "state": "completed"}
               for i in range(3)]
    led.process("gloo", {"entries": entries, "pg_status": {}}, nccl_timing=False, now_ns=2)
    assert led.wanted_from("gloo") == 3


def test_the_server_starts_and_stops_without_writing_to_stderr(gloo, capfd) -> None:
    server = fr_server.DumpServer(["gloo"])
    server.close()
    assert "WorkerServer" not in capfd.readouterr().err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")
def test_a_forked_child_that_drops_the_server_leaves_the_parents_serving(gloo) -> None:
    """Destroying the server in a forked child would shut down the listening socket both share, and
    torch would then terminate the parent (its server thread fails to listen): the child keeps it."""
    import gc
    import time

    server = fr_server.DumpServer(["gloo"])
    try:
        # garbage earlier tests left (a TCPStore server in a cycle) must not be collected in the child:
        # destroying a store's server there joins a thread the child does not have (a segfault)
        gc.collect()
        pid = os.fork()
        if pid == 0:
            del server
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.2)  # the parent's server thread would have failed by now
        assert fr_server.post(server.path, "ping") == b"pong"
        assert server.dump("gloo")["pg_status"]
    finally:
        server.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
                    reason="per-thread scheduling is read from /proc (Linux)")
@pytest.mark.parametrize("sched", ["idle", "nice"])
def test_the_servers_threads_yield_to_training_and_the_callers_do_not(gloo, sched) -> None:
    """Every dump runs on one of the server's threads: all of them are put below training when it
    starts (SCHED_IDLE, or niceness HELPER_NICE), and no other thread of the process (the training
    thread) is touched."""
    mine = (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))
    server = fr_server.DumpServer(["gloo"], sched)
    try:
        tids = fr_server._threads(fr_server._SERVER_THREAD)
        assert tids and server.reniced == tids
        if sched == "idle":
            assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
        else:
            assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}
            assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {fr_server.HELPER_NICE}
        me = threading.get_native_id()
        assert (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)) == mine
        assert server.dump("gloo")["pg_status"]  # and they still answer
    finally:
        server.close()
