"""What keeps the agent thread's passes from stalling the training thread: GC pauses around the
flight-recorder bursts, GIL hand-backs by time, one anatomy judgement per pass, cached FR parsing."""

from __future__ import annotations

import gc
import time

import pytest

from hpar_agent import gcpause
from hpar_agent.detectors import signals as sig
from hpar_agent.gil import Yielder


def test_a_burst_inside_paused_triggers_no_collection() -> None:
    runs: list[int] = []

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(cb)
    try:
        with gcpause.paused():
            burst = [{"record_id": i, "sizes": [[i]]} for i in range(50_000)]  # ~100k tracked objects
            del burst
        assert gc.isenabled()
        assert runs == []
        # the counters are back where they were: the next small allocations owe no collection
        keep = [[i] for i in range(100)]
        assert runs == [] and len(keep) == 100
        with_gc = [{"record_id": i} for i in range(50_000)]  # the same burst unpaused does collect
        assert runs, "gc callbacks saw no collection: the test would not show a pause"
        del with_gc
    finally:
        gc.callbacks.remove(cb)


def test_paused_leaves_a_user_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


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


def test_the_yielder_hands_the_gil_back_by_time_not_per_call(monkeypatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: sleeps.append(s))
    y = Yielder(hold_ns=50_000_000)
    for _ in range(1000):  # 1000 cheap units well inside 50 ms: no hand-back
        y()
    assert sleeps == []
    y.since -= 60_000_000  # as if 60 ms of work had passed
    y()
    assert sleeps == [0]
    y()
    assert sleeps == [0]


def test_pause_points_use_the_pass_of_their_own_thread_only(monkeypatch) -> None:
    import threading

    from hpar_agent import gil

    calls: list[int] = []
    y = Yielder(hold_ns=0)
    monkeypatch.setattr(Yielder, "__call__", lambda self: calls.append(threading.get_ident()))
    gil.pause_point()  # no pass: nothing
    with gil.running(y):
        gil.pause_point()
        t = threading.Thread(target=gil.pause_point)
        t.start()
        t.join()
    gil.pause_point()
    assert calls == [threading.get_ident()]


def test_anatomy_judges_once_per_pass(monkeypatch) -> None:
    from hpar_agent.collectors.anatomy import AnatomyCollector
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    judged: list[int] = []
    monkeypatch.setattr(c, "_judge", lambda: judged.append(len(c.history)))
    for i in range(50):
        c.on_step(StepRecord(step=i, start_ns=i * 10_000_000, end_ns=(i + 1) * 10_000_000))
    assert len(c.history) == 50 and judged == []
    c.end_pass()
    c.end_pass()  # nothing new: no second judgement
    assert judged == [50]


@pytest.mark.parametrize(("sizes", "dtypes", "expect"), [
    ("[[1024, 4]]", "Float", 16384), ("[[8], [8]]", "BFloat16", 32), ("", "Float", 0),
    ("[[2", "Float", -1), ("[[4]]", "Long", -1),
])
def test_entry_bytes_cached_gives_the_same_answers(sizes: str, dtypes: str, expect: int) -> None:
    e = ("dp@0", 1, "allreduce", sizes, dtypes, 0)
    assert sig.entry_bytes(e) == expect
    assert sig.entry_bytes(e) == expect  # a cache hit
    assert sig._message_bytes.cache_info().hits >= 1
