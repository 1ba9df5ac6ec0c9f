"""Collectives: the flight-recorder reader on synthetic FR dumps, and the p2p wrappers (decoding: test_fr_decode)."""

from __future__ import annotations

import gc
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpar_agent.agent import Agent
from hpar_agent.agent_thread import AgentThread
from hpar_agent.detectors import sources as src
from hpar_agent.spans import realize
from hpar_agent.torch_compat import flight_recorder as fr

L = {"rank": "0", "pp_stage": "0"}


class FakeRecorder:
    """Stands in for the NCCL flight recorder: a ring of entries plus pg_status."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.status: dict[str, dict] = {}
        self.full_dumps = 0

    def add(
        self, rid, pg_id, pg, desc, seq, name="nccl:all_reduce", n=256, dur=None, state="completed", p2p=False
    ):
        self.entries.append(
            {
                "record_id": rid,
                "pg_id": pg_id,
                "process_group": (pg, desc),
                "collective_seq_id": seq,
                "p2p_seq_id": seq if p2p else 0,
                "is_p2p": p2p,
                "profiling_name": name,
                "time_created_ns": time.time_ns(),
                "time_discovered_started_ns": time.time_ns(),
                "input_sizes": [[n]],
                "input_dtypes": ["Float"],
                "output_sizes": [[n]],
                "output_dtypes": ["Float"],
                "state": state,
                "duration_ms": dur,
            }
        )
        if not p2p:  # pg_status counts collectives only
            self.status[str(pg_id)] = {"last_enqueued_collective": seq, "last_completed_collective": seq}

    def dump(self, recorder, include_collectives=True):
        assert recorder == "nccl"
        if not include_collectives:
            return {"pg_status": {k: dict(v) for k, v in self.status.items()}}
        self.full_dumps += 1
        return {"entries": [dict(e) for e in self.entries], "pg_status": self.status}


@pytest.fixture
def ring_at_attach() -> list[tuple]:
    """``FakeRecorder.add`` arguments of entries already in the ring when the agent attaches."""
    return []


@pytest.fixture
def fake(monkeypatch, tmp_path, ring_at_attach):
    rec = FakeRecorder()
    for args in ring_at_attach:
        rec.add(*args)
    # the agent sets TORCH_NCCL_ENABLE_TIMING at attach when NCCL is there: keep it off, and per test
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "")
    monkeypatch.setattr(fr, "available_recorders", lambda: ["nccl"])
    monkeypatch.setattr(fr, "dump", rec.dump)
    monkeypatch.setattr(fr, "process_groups", list)  # the fake's groups only (none a test before left)
    monkeypatch.setattr(AgentThread, "_run", lambda self: None)  # only the test's own ticks: they count reads
    # every tick a new fr_interval slot: full reads whenever something moved
    agent = Agent(
        metrics_port=-1, traces="file", run_dir=str(tmp_path), trace_every=1, job_id="j", fr_interval=1e-6
    )
    agent.start()
    c = agent.component("collectives")
    c.groups.sizes.update({name: 4 for name in "0123"})  # as _sync_groups learns them from torch
    try:
        yield rec, agent, c
    finally:
        agent.stop()


def test_reads_entries_once_times_them_and_attaches_spans(fake):
    rec, agent, c = fake
    agent.step()  # the ops below run in step 1
    rec.add(0, 1, "1", "mesh_dp", 1, n=1000, dur=2.0)
    rec.entries[0]["time_discovered_started_ns"] += 10**12  # discovered late: must not move the step
    rec.add(1, 2, "3", "mesh_tp", 1, name="nccl:_allgather_base", n=10)
    agent.tick()
    agent.tick()  # nothing new: must not count again
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1
    assert get("hpar_collective_bytes_total", {**L, "pg": "dp", "op": "all_reduce"}) == 4000
    assert get("hpar_collectives_total", {**L, "pg": "tp", "op": "all_gather"}) == 1
    hl = {**L, "pg": "dp", "op": "all_reduce", "stream": "nccl:dp"}
    assert get("hpar_collective_duration_seconds_count", hl) == 1
    assert get("hpar_collective_duration_seconds_sum", hl) == pytest.approx(0.002)
    # all_reduce busbw = bytes / t * 2(n-1)/n with n = 4
    bw = get("hpar_collective_busbw_bytes_per_second", {**L, "pg": "dp", "op": "all_reduce"})
    assert bw == pytest.approx(4000 / 0.002 * 1.5)
    spans = [realize(s) for ss in agent.span_schedule.pending.values() for s in ss]
    assert [(s.name, s.step) for s in spans] == [("collective.all_reduce", 1)]
    assert spans[0].attributes["collective.pg"] == "dp" and spans[0].attributes["cuda.stream"] == "nccl:dp"
    assert [(e["pg"], e["seq"], e["op"]) for e in c.recent_entries] == [
        ("dp", 1, "all_reduce"),
        ("tp", 1, "all_gather"),
    ]
    assert get("hpar_collective_last_completed_seq", {**L, "pg": "dp"}) == 1


def test_nccl_p2p_batch_is_labelled_pp_with_peer_bytes_and_the_coalesced_duration(fake, monkeypatch):
    """batch_isend_irecv on NCCL: the FR records each p2p op (bytes, no events of its own) and then one
    ``nccl:coalesced`` entry (0 bytes) whose duration is the batch's. On a pipeline's group they are
    pg="pp", op send/recv with the global peer; the coalesced entry is their completion, not an op."""
    rec, agent, c = fake
    c.groups.ranks["0"] = [10, 11]  # group rank -> global rank
    c.groups.pp.add(("0", "default_pg"))  # as the _batch_p2p wrapper registers the stage's group
    agent.step()
    rec.add(0, 0, "0", "default_pg", 1, name="nccl:send 0->1", n=1000, state="scheduled", p2p=True)
    rec.add(1, 0, "0", "default_pg", 2, name="nccl:recv 0<-1", n=500, state="scheduled", p2p=True)
    rec.add(2, 0, "0", "default_pg", 1, name="nccl:coalesced", n=0, state="scheduled")
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "pp", "op": "send"}) == 1
    assert get("hpar_collective_bytes_total", {**L, "pg": "pp", "op": "send"}) == 4000
    assert get("hpar_collective_bytes_total", {**L, "pg": "pp", "op": "recv"}) == 2000
    assert get("hpar_collectives_total", {**L, "pg": "default_pg", "op": "coalesced"}) is None
    # not completed at the read: the ops this rank waits in (NCCL's wait does not block the thread)
    (w,) = src.waiting_in(c)
    assert (w.op, w.peer, w.pg) == ("recv+send", 11, "pp") and w.age_s >= 0.0
    rec.entries[2].update(state="completed", duration_ms=4.0)
    agent.tick()
    assert src.waiting_in(c) == []
    hl = {**L, "pg": "pp", "op": "send", "stream": "nccl:pp"}
    assert get("hpar_collective_duration_seconds_count", hl) == 1
    assert get("hpar_collective_duration_seconds_sum", hl) == pytest.approx(0.004)
    assert get("hpar_collective_busbw_bytes_per_second", {**L, "pg": "pp", "op": "recv"}) == pytest.approx(
        2000 / 0.004
    )
    spans = sorted(
        (realize(s) for ss in agent.span_schedule.pending.values() for s in ss), key=lambda s: s.name
    )
    assert [(s.name, s.attributes["collective.pg"], s.attributes["collective.peer"]) for s in spans] == [
        ("collective.recv", "pp", 11),
        ("collective.send", "pp", 11),
    ]
    nccl = c.reader("nccl")
    assert (nccl.pending, nccl.pending_min_ns) == (0, None)  # nothing left holding the span watermark
    assert get("hpar_collective_timing_enabled", {**L, "pg": "pp"}) == 1


def test_record_id_gaps_are_unobserved_per_pg(fake):
    rec, agent, _ = fake
    rec.add(0, 1, "1", "mesh_dp", 1)
    rec.add(1, 2, "3", "mesh_tp", 1)
    agent.tick()
    rec.entries.clear()  # ring overwrote record ids 2..6: dp seqs 2..4 and two entries of unknown pg
    rec.add(7, 1, "1", "mesh_dp", 5)
    rec.add(8, 2, "3", "mesh_tp", 2)
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collective_unobserved_total", {**L, "pg": "dp"}) == 3
    assert get("hpar_collective_unobserved_total", {**L, "pg": "unknown"}) == 2
    assert get("hpar_collective_unobserved_total", {**L, "pg": "tp"}) is None
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 2


def test_entries_lost_are_said_once_with_a_ring_size_that_keeps_them(fake, monkeypatch, caplog):
    """A ring that turns over between two reads loses entries: said once, with a ring that holds twice
    the entries of one ``fr_interval`` at the rate the reads saw."""
    rec, agent, c = fake
    c._ring = 300
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()
    agent.config.fr_interval = 1.0
    for rid in (2000, 4000):  # two reads a second apart that each find the ring turned over (2,000/s)
        rec.entries.clear()
        rec.add(rid, 1, "1", "mesh_dp", rid + 1)
        clock[0] += 1.0
        with caplog.at_level("WARNING", logger="hpar_agent"):
            agent.tick()
    said = [r.getMessage() for r in caplog.records if "overwrote" in r.getMessage()]
    assert len(said) == 1 and "overwrote 1999 entries" in said[0]
    assert said[0].endswith("TORCH_FR_BUFFER_SIZE=4000 before init_process_group")  # 2 x 1 s at 2,000/s
    assert agent.registry.get_sample_value("hpar_collective_unobserved_total", {**L, "pg": "dp"}) == 2 * 1999


def test_pending_nccl_entry_is_timed_when_it_completes_and_inflight_age(fake):
    rec, agent, c = fake
    c._ledger.attach_ns -= 10_000_000_000  # the op below was enqueued 3 s ago, after attach
    rec.add(0, 1, "1", "mesh_dp", 1, state="scheduled")
    rec.status["1"]["last_completed_collective"] = 0
    rec.entries[0]["time_created_ns"] -= 3_000_000_000
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collective_inflight", {**L, "pg": "dp"}) == 1
    assert get("hpar_collective_oldest_inflight_age_seconds", {**L, "pg": "dp"}) >= 3.0
    hl = {**L, "pg": "dp", "op": "all_reduce", "stream": "nccl:dp"}
    assert not get("hpar_collective_duration_seconds_count", hl)
    rec.entries[0].update(state="completed", duration_ms=5.0)
    rec.status["1"]["last_completed_collective"] = 1
    agent.tick()
    assert get("hpar_collective_duration_seconds_count", hl) == 1
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1
    assert get("hpar_collective_inflight", {**L, "pg": "dp"}) == 0
    assert get("hpar_collective_oldest_inflight_age_seconds", {**L, "pg": "dp"}) == 0


@pytest.mark.parametrize("ring_at_attach", [[(0, 1, "1", "mesh_dp", 1)]])
def test_entries_from_before_attach_are_baseline_only(fake):
    rec, agent, _ = fake
    rec.entries[0]["time_created_ns"] -= 10_000_000_000
    rec.add(1, 1, "1", "mesh_dp", 2)
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1
    assert get("hpar_collective_unobserved_total", {**L, "pg": "dp"}) is None


def test_an_empty_ring_at_attach_counts_what_it_overwrote_before_the_first_read(fake):
    """Attached before any group, the ring starts at record id 0 and seq 1: a first read whose oldest
    entry is id 5 (seq 6) lost five entries of that group, not five from before attach."""
    rec, agent, _ = fake
    for i in range(5, 8):
        rec.add(i, 1, "1", "mesh_dp", i + 1)
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 3
    assert get("hpar_collective_unobserved_total", {**L, "pg": "dp"}) == 5


def test_status_probe_skips_full_dump_when_nothing_moved(fake):
    rec, agent, _ = fake
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()
    before = rec.full_dumps
    agent.tick()
    agent.tick()
    assert rec.full_dumps == before
    rec.add(1, 1, "1", "mesh_dp", 2)
    agent.tick()
    assert rec.full_dumps == before + 1


def test_an_empty_recorder_is_read_in_full_once(fake):
    """A CUDA build has both recorders and a job uses one: the other's ring stays empty, and its first
    read must not be due again at every poll (that would be a full read a second per rank)."""
    rec, agent, c = fake
    agent.config.fr_interval = 3600.0
    at_attach = rec.full_dumps  # attach looked at the empty ring once
    agent.tick()
    assert rec.full_dumps == at_attach + 1 and c.read_reasons == {"first": 1}
    for _ in range(5):
        agent.tick()
    assert rec.full_dumps == at_attach + 1
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.config.fr_interval = 1e-6
    agent.tick()  # entries at last: read at the next slot
    assert rec.full_dumps == at_attach + 2 and c.read_reasons == {"first": 1, "slot": 1}
    assert (
        agent.registry.get_sample_value("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1
    )


def test_full_reads_once_per_slot_unless_stuck(fake):
    rec, agent, c = fake
    agent.config.fr_interval = 3600.0  # one slot for the whole test
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()  # the first read is always full
    n = rec.full_dumps
    rec.add(1, 1, "1", "mesh_dp", 2)
    agent.tick()  # moved, same slot: probe only, nothing counted yet
    assert rec.full_dumps == n
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1
    rec.add(2, 1, "1", "mesh_dp", 3, state="scheduled")
    rec.status["1"]["last_completed_collective"] = 2
    agent.tick()  # in flight, but nothing to compare with yet
    assert rec.full_dumps == n
    agent.tick()  # still in flight with no completion since the last probe: read now
    assert rec.full_dumps == n + 1
    agent.tick()  # still stuck, but nothing new since that read: probe only
    assert rec.full_dumps == n + 1
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 3
    rec.add(3, 1, "1", "mesh_dp", 4)
    agent.config.fr_interval = 1e-6
    agent.tick()  # a new slot with something moved
    assert rec.full_dumps == n + 2 and c.read_reasons == {"first": 1, "in flight": 1, "slot": 1}
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 4


def test_reads_wait_for_the_slot_and_count_what_the_ring_overwrote(fake):
    rec, agent, c = fake
    agent.config.fr_interval = 3600.0
    c._ring = 4
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()  # the first read
    n = rec.full_dumps
    for i in range(1, 7):  # the ring refills one and a half times within the slot
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
    del rec.entries[:3]  # a ring of 4 keeps the last four
    agent.tick()
    assert rec.full_dumps == n  # no early read
    agent.config.fr_interval = 1e-6
    agent.tick()  # the next slot
    assert rec.full_dumps == n + 1 and c.read_reasons == {"first": 1, "slot": 1}
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 5  # rid 0 and 3..6
    assert get("hpar_collective_unobserved_total", {**L, "pg": "dp"}) == 2  # rid 1 and 2


def test_p2p_entries_pg_status_does_not_count_are_read_at_the_next_slot(fake):
    rec, agent, c = fake
    for rid in range(3):  # p2p sends, which pg_status does not count
        rec.add(rid, 2, "2", "mesh_pp", rid + 1, name="nccl:send", p2p=True)
    agent.tick()
    rec.add(3, 2, "2", "mesh_pp", 4, name="nccl:send", p2p=True)
    agent.tick()  # pg_status unchanged, but a recorder with p2p entries is read at each slot
    assert c.read_reasons == {"first": 1, "slot": 1}
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "pp", "op": "send"}) == 4


def test_step_trace_waits_for_spans_of_a_later_fr_read(fake):
    rec, agent, c = fake
    c.nccl.on = True
    agent.config.fr_interval = 3600.0
    exported: list[tuple[int, list[str]]] = []
    agent.outputs.tracing = SimpleNamespace(
        export_step=lambda r: exported.append((r.step, [realize(s).name for s in r.children])),
        shutdown=lambda t: None,
    )
    rec.add(0, 1, "1", "mesh_dp", 1, dur=1.0)
    agent.tick()  # first read: the op above
    rec.add(1, 1, "1", "mesh_dp", 2, name="nccl:broadcast", dur=1.0)
    agent.step()  # step 0 ends after both ops
    agent.tick()  # same slot: probe only, so step 0 must wait for its broadcast
    assert exported == []
    agent.config.fr_interval = 1e-6
    agent.tick()
    # with them the step's exposed communication (no model here: nothing hides the two ops)
    ((step, names),) = exported
    assert step == 0 and [n for n in names if n != "step.comm_exposed"] == [
        "collective.all_reduce",
        "collective.broadcast",
    ]
    assert "step.comm_exposed" in names


def test_no_spans_are_built_with_tracing_off(fake):
    rec, agent, _ = fake
    agent.outputs.tracing = None
    rec.add(0, 1, "1", "mesh_dp", 1, dur=1.0)
    agent.tick()
    assert (
        agent.registry.get_sample_value(
            "hpar_collective_duration_seconds_count",
            {**L, "pg": "dp", "op": "all_reduce", "stream": "nccl:dp"},
        )
        == 1
    )
    assert not agent.span_schedule.pending


def test_step_of_uses_boundaries(fake):
    _, agent, c = fake
    c.step_hook(0, 100)
    c.step_hook(1, 200)
    agent.tick()
    assert [c.step_of(t) for t in (50, 100, 150, 250)] == [0, 0, 1, 2]


def test_p2p_wrappers_count_time_and_restore(tmp_path):
    import torch.distributed.pipelining.schedules as sched

    orig_batch, orig_wait = sched._batch_p2p, sched._wait_batch_p2p
    agent = Agent(metrics_port=-1, traces="file", run_dir=str(tmp_path), trace_every=1)
    agent.start()
    try:
        assert sched._batch_p2p is not orig_batch and sched._wait_batch_p2p is not orig_wait
        c = agent.component("collectives")

        class Work:
            def __init__(self, done):
                self.done = done

            def is_completed(self):
                return self.done

            def wait(self):
                time.sleep(0.01)
                return True

        works = [Work(False), Work(True)]
        batch = c.p2p.wrapper.wrap_batch(lambda ops, desc=None: works)
        wait = c.p2p.wrapper.wrap_wait(lambda ws: [w.wait() for w in ws])
        ops = [
            SimpleNamespace(op=dist.isend, tensor=torch.zeros(8), peer=1, group=None),
            SimpleNamespace(op=dist.irecv, tensor=torch.zeros(2, 3, dtype=torch.float64), peer=3, group=None),
        ]
        wait(batch(ops))
        agent.tick()
        get = agent.registry.get_sample_value
        assert get("hpar_collectives_total", {**L, "pg": "pp", "op": "send"}) == 1
        assert get("hpar_collective_bytes_total", {**L, "pg": "pp", "op": "recv"}) == 48
        send = get("hpar_collective_duration_seconds_sum", {**L, "pg": "pp", "op": "send", "stream": "cpu"})
        recv = get("hpar_collective_duration_seconds_sum", {**L, "pg": "pp", "op": "recv", "stream": "cpu"})
        assert send >= 0.01 > recv  # recv was complete when waited: timed to the wait's entry
        spans = {
            s.name: s for s in map(realize, (s for ss in agent.span_schedule.pending.values() for s in ss))
        }
        assert spans["collective.recv"].attributes["collective.peer"] == 3
        assert get("hpar_collective_inflight", {**L, "pg": "pp"}) == 0
        batch(ops)  # issued, never waited: in flight
        agent.tick()
        assert get("hpar_collective_inflight", {**L, "pg": "pp"}) == 2
        agent.component("steps").detailed = False  # a step a fast loop leaves without detail
        works[:] = [Work(True), Work(True)]
        wait(batch(ops))
        agent.tick()
        assert get("hpar_collectives_total", {**L, "pg": "pp", "op": "send"}) == 3  # counted
        assert (
            get("hpar_collective_duration_seconds_count", {**L, "pg": "pp", "op": "send", "stream": "cpu"})
            == 1
        )
        assert (
            get("hpar_collective_inflight", {**L, "pg": "pp"}) == 2
        )  # done, not timed; the earlier two wait on
    finally:
        agent.stop()
    assert sched._batch_p2p is orig_batch and sched._wait_batch_p2p is orig_wait


def test_untimed_nccl_group_from_before_attach_is_said_once_and_later_groups_are_timed(
    monkeypatch, tmp_path, caplog
):
    """A group that existed untimed at attach and cannot be switched on gets the one warning (and its
    timing gauge stays 0); a group built after attach was built with the variable the agent set."""
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "")
    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING")
    old, new = object(), object()
    groups = [old]
    names = {id(old): ("1", "mesh_dp"), id(new): ("2", "mesh_tp")}
    monkeypatch.setattr(fr, "available_recorders", lambda: ["nccl"])
    monkeypatch.setattr(fr, "dump", FakeRecorder().dump)
    monkeypatch.setattr(fr, "process_groups", lambda: list(groups))
    monkeypatch.setattr(fr, "group_backend", lambda pg: "nccl")
    monkeypatch.setattr(fr, "group_name", lambda pg: names[id(pg)])
    monkeypatch.setattr(fr, "enable_timing", lambda pg: False)  # a torch without the switch
    monkeypatch.setattr(AgentThread, "_run", lambda self: None)
    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), job_id="j")
    with caplog.at_level("WARNING", logger="hpar_agent"):
        agent.start()
        try:
            c = agent.component("collectives")
            assert os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"  # set at attach, for later groups
            assert c.nccl.untimed == {("1", "mesh_dp")}
            groups.append(new)
            agent.tick()
            agent.tick()
            assert c.nccl.untimed == {("1", "mesh_dp")} and c.nccl.on  # the new group is timed
        finally:
            agent.stop()
    assert sum("is not timed" in r.getMessage() for r in caplog.records) == 1


def test_kept_entries_are_invisible_to_the_garbage_collector(fake):
    """The 2,048 entries the detectors read are kept as dicts of text and numbers: untracked by the
    collector, so renewing them never pushes the process into a full collection (gcpause)."""
    import gc

    rec, agent, c = fake
    for i in range(5):
        rec.add(i, 1, "1", "mesh_dp", i + 1, n=64)
    agent.tick()
    assert len(c.recent_entries) == 5
    assert not any(gc.is_tracked(e) for e in c.recent_entries)
    assert c.recent_entries[0]["input_sizes"] == "[[64]]" and c.recent_entries[0]["input_dtypes"] == "Float"
    from hpar_agent.detectors import sources

    (e,) = sources.fr_entries(agent.context, 1)
    assert e[3:5] == ("[[64]]", "Float")


def test_a_scatter_is_compared_by_what_every_member_receives(fake):
    """Only a scatter's root records an input (DTensor's ``distribute_tensor`` scatters each TP shard
    from rank 0): the entries the detectors compare carry its output, so the root and the others agree
    and CollectiveMismatch sees nothing (it fired on every rank of a clean FSDP2 x TP program)."""
    from hpar_agent.detectors import signals, sources

    rec, agent, c = fake
    rec.add(0, 2, "3", "mesh_tp", 1, name="gloo:scatter", n=128)
    rec.entries[-1].update(input_sizes=[[2, 128]], output_sizes=[[128]])  # the root: every chunk
    agent.tick()
    (root,) = sources.fr_entries(agent.context, 1)
    rec.entries[-1].update(input_sizes=[], input_dtypes=[], record_id=1)  # another member: no input
    c._ledger._decoded.clear()
    agent.tick()
    other = sources.fr_entries(agent.context, 2)[-1]
    assert root[3:5] == other[3:5] == ("[[128]]", "Float"), (root, other)
    assert signals.collective_mismatches({0: [root], 1: [other]}) == {}


def test_entries_of_one_shape_are_decoded_once_and_counted_each(fake, monkeypatch):
    """A loop repeats a few collectives: their name and shapes are decoded once per distinct text, and
    every entry still counts; a different output (an all-gather's) is another shape; a full cache starts over."""
    from hpar_agent.collectors import fr_ledger as coll

    rec, agent, c = fake
    calls = []
    real = coll.entry_bytes
    monkeypatch.setattr(coll, "entry_bytes", lambda s, d: calls.append(1) or real(s, d))
    for i in range(6):
        rec.add(i, 1, "1", "mesh_dp", i + 1, n=256)
    rec.add(6, 2, "3", "mesh_tp", 1, name="nccl:_allgather_base", n=8)
    rec.entries[-1]["output_sizes"] = [[32]]
    agent.tick()
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 6
    assert get("hpar_collective_bytes_total", {**L, "pg": "dp", "op": "all_reduce"}) == 6 * 1024
    assert get("hpar_collective_bytes_total", {**L, "pg": "tp", "op": "all_gather"}) == 32
    assert len(calls) == 4 and len(c._ledger._decoded) == 2  # in and out bytes of two shapes
    assert [e["input_sizes"] for e in c.recent_entries][-2:] == ["[[256]]", "[[8]]"]
    monkeypatch.setattr(coll, "MAX_DECODED", 2)
    rec.add(7, 1, "1", "mesh_dp", 7, n=512)  # a third shape: the full cache is cleared first
    agent.tick()
    assert len(c._ledger._decoded) == 1
    assert get("hpar_collective_bytes_total", {**L, "pg": "dp", "op": "all_reduce"}) == 6 * 1024 + 2048


def test_a_full_flight_recorder_read_is_processed_with_collection_paused(monkeypatch) -> None:
    from hpar_agent.collectors.collectives import CollectiveCollector

    seen: list[bool] = []

    def read(self, rec, now):
        seen.append(gc.isenabled())
        return {}, None

    monkeypatch.setattr(CollectiveCollector, "_read", read)
    c = CollectiveCollector()
    c.ctx = type("Ctx", (), {"config": type("Cfg", (), {"nccl_timing": False})()})()  # type: ignore[assignment]
    c.recorders = ["gloo", "nccl"]
    monkeypatch.setattr(c, "_patch_p2p", lambda: None)
    c.poll(time.time())
    assert seen == [False, False] and gc.isenabled()


def test_the_p2p_ops_a_wait_blocks_in_are_what_the_rank_waits_in_until_it_returns():
    """A hang's p2p edge: the wrapper's ``enter`` record (put before the wait blocks) names the ops not
    complete; the ``wait`` record that follows ends it."""
    from hpar_agent.collectors.collective_state import OpStats
    from hpar_agent.collectors.fr_ledger import Groups
    from hpar_agent.collectors.pipeline_p2p import P2PTracker
    from hpar_agent.torch_compat import flight_recorder as frc

    tracker = P2PTracker(Groups(), 64, lambda exc: None)
    stats, finished = OpStats(64), []
    t0 = time.time_ns()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frc, "group_backend", lambda g: "gloo")
        mp.setattr(frc, "group_timeout_s", lambda g: 12.0)
        issue = ("issue", t0, ("send", 1, 8, None, "recv", 3, 48, None), (101, 102), True)
        tracker.process([issue, ("enter", t0 + 5, (102,))], stats, False, lambda o, s: finished.append(o))
    t_enter, ops = tracker.waiting_in()
    assert t_enter == t0 + 5 and [(o.op, o.peer, o.pg) for o in ops] == [("recv", 3, "pp")]
    assert tracker.timeout_s == 12.0  # the group's own timeout: no FR entry of gloo p2p says it
    tracker.process([("wait", t0 + 5, (101, True, 102, False), t0 + 9)], stats, False, lambda o, s: None)
    assert tracker.waiting_in() is None


def test_the_default_group_s_timeout_bounds_hang_before_any_collective(tmp_path) -> None:
    """A program that only sends and receives on gloo leaves no flight-recorder entry (gloo records
    no send/recv) to read its group's timeout from: the default group's is read as it appears, so
    Hang fires (at 80 % of it) before that timeout ends the ranks. A hand-written 3-rank pipeline
    with a 30 s timeout and one rank asleep: Hang had 60 s and never fired; now 24 s."""
    import datetime

    from hpar_agent.detectors.liveness import Hang

    dist.init_process_group(
        "gloo", rank=0, world_size=1, store=dist.HashStore(), timeout=datetime.timedelta(seconds=30)
    )
    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    try:
        agent.start()
        agent.tick()
        assert agent.component("collectives").pg_timeout_s == 30.0
        det = agent.component("detectors")
        assert det.detector(Hang).timeout(det.snapshot) == pytest.approx(24.0)
    finally:
        agent.stop()
        dist.destroy_process_group()
