"""Collectives: the flight-recorder reader on synthetic FR dumps, and the p2p wrappers (decoding: test_fr_decode)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpar_agent.agent import Agent
from hpar_agent.spans import realize
from hpar_agent.torch_compat import flight_recorder as fr

L = {"rank": "0", "pp_stage": "0"}


class FakeRecorder:
    """Stands in for the NCCL flight recorder: a ring of entries plus pg_status."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.status: dict[str, dict] = {}
        self.full_dumps = 0

    def add(self, rid, pg_id, pg, desc, seq, name="nccl:all_reduce", n=256, dur=None, state="completed", p2p=False):
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
    monkeypatch.setattr(Agent, "_run", lambda self: None)  # only the test's own ticks: they count reads
    # every tick a new fr_interval slot: full reads whenever something moved; the fake recorder lives
    # in this process, so reads stay on the agent thread (the reader process: test_fr_reader)
    agent = Agent(metrics_port=-1, traces="file", run_dir=str(tmp_path), trace_every=1, job_id="j", fr_interval=1e-6,
                  fr_reader="inline")
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
    rec.entries[2].update(state="completed", duration_ms=4.0)
    agent.tick()
    hl = {**L, "pg": "pp", "op": "send", "stream": "nccl:pp"}
    assert get("hpar_collective_duration_seconds_count", hl) == 1
    assert get("hpar_collective_duration_seconds_sum", hl) == pytest.approx(0.004)
    assert get("hpar_collective_busbw_bytes_per_second", {**L, "pg": "pp", "op": "recv"}) == pytest.approx(2000 / 0.004)
    spans = sorted((realize(s) for ss in agent.span_schedule.pending.values() for s in ss), key=lambda s: s.name)
    assert [(s.name, s.attributes["collective.pg"], s.attributes["collective.peer"]) for s in spans] == [
        ("collective.recv", "pp", 11),
        ("collective.send", "pp", 11),
    ]
    assert c._pending["nccl"] == (0, None)  # nothing left holding the span watermark
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


def test_entries_lost_are_said_once_with_a_ring_size_that_keeps_them(fake, caplog):
    rec, agent, c = fake
    c._ring = 300
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()
    c._rate["nccl"] = 2000.0  # the ring turns over every 0.15 s
    for rid in (5, 12):  # two reads that each find entries overwritten
        rec.entries.clear()
        rec.add(rid, 1, "1", "mesh_dp", rid + 1)
        with caplog.at_level("WARNING", logger="hpar_agent"):
            agent.tick()
    said = [r.getMessage() for r in caplog.records if "overwrote" in r.getMessage()]
    assert len(said) == 1 and "overwrote 4 entries" in said[0]
    assert "TORCH_FR_BUFFER_SIZE=" in said[0] and int(said[0].rsplit("=", 1)[1].split()[0]) >= 4000  # 2 x 1 s


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
    read must not be due again at every poll (on the device that was a full read a second per rank)."""
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
    assert agent.registry.get_sample_value("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 1


def test_full_reads_once_per_slot_unless_stuck_or_ring_filling(fake):
    rec, agent, c = fake
    agent.config.fr_interval = 3600.0  # one slot for the whole test
    # a ring no entry rate turns over before the refill part: the ticks come µs apart, and an entry
    # rate over them (thousands a second) made a 2,000-entry ring due for a read now and then
    c._ring = 1 << 30
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
    c._ring = 10
    for i in range(8):
        rec.add(3 + i, 1, "1", "mesh_dp", 4 + i)
    agent.tick()  # eight collectives since the last full read: 0.8 of the ring
    assert rec.full_dumps == n + 2
    rec.add(11, 1, "1", "mesh_dp", 12)
    agent.config.fr_interval = 1e-6
    agent.tick()  # a new slot with something moved
    assert rec.full_dumps == n + 3
    assert get("hpar_collectives_total", {**L, "pg": "dp", "op": "all_reduce"}) == 12


def test_fr_complete_off_reads_at_slots_only_and_counts_what_the_ring_overwrote(fake):
    rec, agent, c = fake
    agent.config.fr_interval = 3600.0
    agent.config.fr_complete = False
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


def test_p2p_entry_rate_reads_at_the_rings_turnover_between_passes(fake, monkeypatch):
    rec, agent, c = fake
    monkeypatch.setattr(c, "_off_gil", lambda rec: True)  # as reads in the reader process are
    c._ring = 40
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    rid = 0

    def send(n: int) -> None:  # p2p sends, which pg_status does not count
        nonlocal rid
        for _ in range(n):
            rec.add(rid, 2, "2", "mesh_pp", rid + 1, name="nccl:send", p2p=True)
            rid += 1

    for _ in range(2):  # 10 sends a second, read in two short slots: the rate (10/s)
        send(10)
        clock[0] += 1.0
        agent.tick()
    # 0.8 of the ring (32 entries) comes at 3.2 s; full at 1.25x the rate (4 s x 0.8) less a grid step first
    assert c.wake_at() == pytest.approx(1002.0 + 3.2 - 0.05, abs=0.01)
    agent.config.fr_interval = 3600.0  # one long slot from here, whose read the turnover's makes moot
    n = rec.full_dumps
    for _ in range(3):
        send(10)
        clock[0] += 1.0
        agent.tick()  # passes before the turnover: no read (half the ring no longer calls for one)
    assert rec.full_dumps == n and c.read_reasons["ring refill"] == 0 and c.read_reasons["slot"] == 1
    assert c.wake_at() == pytest.approx(1002.0 + 3.2, abs=0.01)  # 30 entries in: the fill bound rules
    wait, woken = agent._next_wake()  # the agent thread's next work: the wake, before the next tick
    assert woken == [c] and wait == pytest.approx(0.2, abs=0.01)
    send(2)
    clock[0] += wait
    agent.wake(woken)  # only the collector's poll: it reads
    assert rec.full_dumps == n + 1 and c.read_reasons["ring refill"] == 1
    assert c.wake_at() == pytest.approx(clock[0] + 3.15, abs=0.05)
    get = agent.registry.get_sample_value
    assert get("hpar_collectives_total", {**L, "pg": "pp", "op": "send"}) == rid
    assert not get("hpar_collective_unobserved_total", {**L, "pg": "pp"})


def _first_read_at(fake, monkeypatch, *, ring: int, t0: float, off_gil: bool) -> list[float]:
    """One long slot, a ring of ``ring`` entries, the wall clock at ``t0`` (the returned cell moves it),
    and the first read done; ``off_gil``: reads as in the reader process (wakes between passes)."""
    rec, agent, c = fake
    if off_gil:
        monkeypatch.setattr(c, "_off_gil", lambda rec: True)
    agent.config.fr_interval = 3600.0
    c._ring = ring
    clock = [t0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    rec.add(0, 1, "1", "mesh_dp", 1)
    agent.tick()  # the first read
    return clock


def test_a_wake_that_does_not_clear_waits_a_grid_step_and_collectives_alone_count_from_pg_status(fake, monkeypatch):
    rec, agent, c = fake
    clock = _first_read_at(fake, monkeypatch, ring=100, t0=2000.0, off_gil=True)
    for i in range(1, 21):  # 20 collectives in 0.5 s: pg_status alone gives the rate (40/s)
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
    clock[0] += 0.5
    agent.tick()
    assert c.wake_at() == pytest.approx(2000.0 + 0.8 * 100 / 40)
    monkeypatch.setattr(c, "wake_at", lambda: clock[0] - 1.0)  # a due its poll never clears
    agent._last_wake = clock[0]
    wait, woken = agent._next_wake()
    assert woken == [c] and wait == pytest.approx(0.05, abs=1e-6)  # not at once, not in a loop


def test_the_first_read_takes_its_rate_from_its_entries_creation_stamps(fake, monkeypatch):
    """No rate before two reads or two probes: a loop faster than a pass fills the ring before then.
    The first read's entries, 40 created over 1 s, give 40/s at once: the wake comes at 0.8 of the
    ring, counted from the read (or earlier, by the margin: ``_refill_due``)."""
    rec, agent, c = fake
    monkeypatch.setattr(c, "_off_gil", lambda rec: True)
    agent.config.fr_interval = 3600.0
    c._ring = 100
    t = 1.8e9  # creation stamps are epoch ns
    monkeypatch.setattr(time, "time", lambda: t)
    for i in range(40):
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
        rec.entries[-1]["time_created_ns"] = int((t - 1.0 + i / 39) * 1e9)
    agent.tick()
    assert c.read_reasons == {"first": 1}
    assert c._rate["nccl"] == pytest.approx(40.0)  # 40 entries in the second before the read
    assert c.wake_at() - t == pytest.approx(0.8 * 100 / 40, abs=0.06)  # by 2 round trips + a grid step
    rec.entries[:] = rec.entries[:2]  # two entries made 5 ms before the read: too recent to pace by
    c._rate.clear()
    c._read_ns.clear()
    rec.entries[0]["time_created_ns"] = int((t - 0.005) * 1e9)
    rec.entries[1]["time_created_ns"] = int((t - 0.004) * 1e9)
    c._ledger._cursor.pop("nccl")
    agent.tick()
    assert "nccl" not in c._rate


def test_rings_empty_at_attach_are_probed_between_passes_until_their_rate_is_known(fake, monkeypatch):
    """A loop that turns the ring over within a pass: the agent thread probes every 0.25 s from
    attach, reads the first entries as they come, and takes the rate from their creation stamps;
    then the turnover reads take over and the probing stops."""
    rec, agent, c = fake
    monkeypatch.setattr(c, "_off_gil", lambda rec: True)
    c._want_reader = True  # reads in the reader process (none starts: no real group here)
    agent.config.fr_interval = 3600.0
    c._ring = 200
    t = time.time()  # within WATCH_MAX_S of attach; creation stamps are epoch ns
    clock = [t]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    assert c._watch == {"nccl"}
    agent.tick()  # the first read: the empty ring
    assert c.read_reasons == {"first": 1} and c._watching(t)
    assert c.wake_at() - t == pytest.approx(0.25)
    clock[0] = t + 0.25
    agent.wake([c])  # nothing yet: a probe, no read
    assert c.read_reasons == {"first": 1}
    for i in range(30):  # the loop starts: 30 collectives in 0.1 s
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
        rec.entries[-1]["time_created_ns"] = int((t + 0.3 + i * 0.1 / 29) * 1e9)
    clock[0] = t + 0.5
    agent.wake([c])
    assert c.read_reasons == {"first": 1, "first entries": 1}
    assert c._rate["nccl"] == pytest.approx(150, rel=1e-3)  # 30 since the first, 0.2 s ago; not 30 in 0.5 s
    assert not c._watching(clock[0])
    due = c.wake_at()
    assert due is not None and due - clock[0] <= 0.8 * 200 / 150 + 1e-6  # the turnover read, within the pass
    assert agent.registry.get_sample_value("hpar_collective_unobserved_total", {**L, "pg": "dp"}) is None


def test_inline_reads_and_a_job_without_collectives_are_not_probed(fake):
    _rec, _agent, c = fake
    assert not c._watching(time.time())  # the fixture's reads are inline: they stay at the passes
    c._want_reader = True
    assert c._watching(time.time())
    c._watch_until = time.time() - 1  # a job that never ran a collective: probed for WATCH_MAX_S at most
    assert not c._watching(time.time())


@pytest.mark.parametrize("ring_at_attach", [[(0, 1, "1", "mesh_dp", 1)]])
def test_a_ring_with_entries_at_attach_is_not_probed(fake):
    _rec, _agent, c = fake
    c._want_reader = True
    assert not c._watch and not c._watching(time.time())


def test_step_trace_waits_for_spans_of_a_later_fr_read(fake):
    rec, agent, c = fake
    c._nccl_timing = True
    agent.config.fr_interval = 3600.0
    exported: list[tuple[int, list[str]]] = []
    agent.tracing = SimpleNamespace(
        export_step=lambda r: exported.append((r.step, [realize(s).name for s in r.children])), shutdown=lambda t: None
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
    assert step == 0 and [n for n in names if n != "step.comm_exposed"] == ["collective.all_reduce", "collective.broadcast"]
    assert "step.comm_exposed" in names


def test_no_spans_are_built_with_tracing_off(fake):
    rec, agent, _ = fake
    agent.tracing = None
    rec.add(0, 1, "1", "mesh_dp", 1, dur=1.0)
    agent.tick()
    assert agent.registry.get_sample_value(
        "hpar_collective_duration_seconds_count", {**L, "pg": "dp", "op": "all_reduce", "stream": "nccl:dp"}
    ) == 1
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
        batch = c.p2p.wrap_batch(lambda ops, desc=None: works)
        wait = c.p2p.wrap_wait(lambda ws: [w.wait() for w in ws])
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
        spans = {s.name: s for s in map(realize, (s for ss in agent.span_schedule.pending.values() for s in ss))}
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
        assert get("hpar_collective_duration_seconds_count", {**L, "pg": "pp", "op": "send", "stream": "cpu"}) == 1
        assert get("hpar_collective_inflight", {**L, "pg": "pp"}) == 2  # done, not timed; the earlier two wait on
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
    monkeypatch.setattr(Agent, "_run", lambda self: None)
    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), job_id="j")
    with caplog.at_level("WARNING", logger="hpar_agent"):
        agent.start()
        try:
            c = agent.component("collectives")
            assert os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"  # set at attach, for later groups
            assert c._untimed == {("1", "mesh_dp")}
            groups.append(new)
            agent.tick()
            agent.tick()
            assert c._untimed == {("1", "mesh_dp")} and c._nccl_timing  # the new group is timed
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


def test_inline_reads_stay_at_the_passes_and_read_when_the_turnover_comes_before_the_next(fake, monkeypatch):
    rec, agent, c = fake  # reads on the agent thread (the fixture's fr_reader=inline)
    clock = _first_read_at(fake, monkeypatch, ring=100, t0=3000.0, off_gil=False)
    n = rec.full_dumps
    dumps = []
    for step in range(2):  # 20 collectives every half second (40/s): 0.8 of the ring 2 s after the read
        for i in range(20):
            seq = 2 + 20 * step + i
            rec.add(seq - 1, 1, "1", "mesh_dp", seq)
        clock[0] += 0.5
        agent.tick()
        dumps.append(rec.full_dumps - n)
        assert c.wake_at() is None  # never a wake of its own: an inline read holds the GIL
    # at 3000.5 the turnover (3002.0) comes after the next pass (3001.5); at 3001.0, with it
    assert dumps == [0, 1] and c.read_reasons["ring refill"] == 1


def test_a_turnover_due_within_a_paced_pass_is_read_at_the_pass(fake, monkeypatch):
    """The agent thread wakes only once a pass is done: a read due before the pass would end (a paced
    pass on a loaded host spreads over most of the interval) happens in the pass itself."""
    rec, agent, c = fake
    clock = _first_read_at(fake, monkeypatch, ring=100, t0=4000.0, off_gil=True)
    n = rec.full_dumps
    for i in range(1, 41):  # 40 collectives in 1 s: 0.8 of the ring 2 s after the read, capped by 1.25x
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
    clock[0] += 1.0
    agent.tick()
    assert rec.full_dumps == n and c.wake_at() is not None and c.wake_at() > clock[0] + 0.5
    agent._pass_wall_s = 0.8  # the passes take 0.8 s of wall time: the due falls inside the next one
    for i in range(41, 61):
        rec.add(i, 1, "1", "mesh_dp", 1 + i)
    clock[0] += 0.5
    agent.tick()
    assert rec.full_dumps == n + 1 and c.read_reasons["ring refill"] == 1


def test_the_probe_rate_counts_over_the_span_it_divides_by(fake, monkeypatch):
    """A wake's probe between two passes leaves the probe rate alone; the next pass's rate counts the
    collectives since the probe it is measured from, not since the wake's."""
    rec, agent, c = fake
    clock = _first_read_at(fake, monkeypatch, ring=1000, t0=5000.0, off_gil=True)
    seq = 1

    def run(n: int, seconds: float) -> None:
        nonlocal seq
        for _ in range(n):
            rec.add(seq, 1, "1", "mesh_dp", seq + 1)
            seq += 1
        clock[0] += seconds

    run(40, 1.0)
    agent.tick()
    assert c._probe_rate["nccl"] == pytest.approx(40.0)
    run(8, 0.2)
    agent.wake([c])  # 0.2 s after the pass's probe: too close to measure a rate over
    assert c._probe_rate["nccl"] == pytest.approx(40.0)
    run(16, 0.4)
    agent.tick()  # 24 collectives in the 0.6 s since the pass's probe
    assert c._probe_rate["nccl"] == pytest.approx(40.0)
