"""Paced passes in the training thread's waits (``gil.Windows``): parking, working through a wait,
the p2p wait wrapper's marks, and the collector that turns them on for host-blocking (gloo) pipelines."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from hpar_agent import gil
from hpar_agent.agent import Agent
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat import p2p


class Work:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture
def windows():
    """The process's windows, active, and left as they were found."""
    w = gil.WINDOWS
    saved = w.active
    w.active = True
    yield w
    w.active = saved
    w.leave()


def test_a_parked_pass_wakes_when_the_training_thread_begins_a_real_wait(windows) -> None:
    got: list[int] = []
    parked = threading.Thread(target=lambda: got.append(windows.park(time.time_ns() + 10_000_000_000)))
    before = windows.in_wait
    parked.start()
    while not windows.wanted:
        time.sleep(0.001)
    t0 = time.perf_counter()
    windows.enter([Work(done=True)], pending=False)  # its Works are complete: no window, the pass stays parked
    time.sleep(0.05)
    assert parked.is_alive() and got == []
    windows.leave()
    work = Work()
    windows.enter([work], pending=True)
    parked.join(5)
    assert got == [windows.open] and windows.in_wait == before + 1 and time.perf_counter() - t0 < 5
    assert not windows.over(got[0])
    work.done = True  # the data came: the training thread wants the GIL back before it can say so
    assert windows.over(got[0])
    windows.leave()
    assert windows.over(got[0])


def test_without_a_wait_the_park_ends_at_its_slot(windows) -> None:
    before = windows.at_slot
    t0 = time.perf_counter()
    assert windows.park(time.time_ns() + 30_000_000) == 0
    assert 0.02 < time.perf_counter() - t0 < 2 and windows.at_slot == before + 1


def test_a_paced_pass_works_through_a_wait_and_hands_back_when_its_works_complete(windows, monkeypatch) -> None:
    """In a wait the Yielder does not hand back after ``hold_ns``; once the Works complete it does, at
    the next unit, and parks for the next wait or slot."""
    work = Work()
    windows.enter([work], pending=True)
    y = gil.Yielder(hold_ns=0, deadline_ns=time.time_ns() + 60_000_000_000, slot_ns=20_000_000, windows=windows)
    y()  # parks: a wait is in progress, so it returns at once, in it
    assert y.window == windows.open != 0
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    for _ in range(100):  # every unit past hold_ns, none hands back: the training thread waits anyway
        y()
    assert y.window and sleeps == []
    work.done = True
    monkeypatch.undo()
    slots = windows.at_slot
    y()  # hands back: parks until the next 20 ms slot (the wait is over)
    assert y.window == 0 and windows.at_slot == slots + 1


def test_a_pass_without_active_windows_sleeps_to_its_slot(monkeypatch) -> None:
    w = gil.Windows()  # never active: no pipeline waits to work in
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    y = gil.Yielder(hold_ns=0, deadline_ns=time.time_ns() + 60_000_000_000, windows=w)
    y.start()
    assert sleeps == []  # start parks only with active windows
    y()
    assert len(sleeps) == 1 and 0 < sleeps[0] <= gil.SLOT_NS / 1e9 and w.at_slot == 0


def test_the_wait_wrapper_marks_the_wait_only_while_windows_are_on(windows, monkeypatch) -> None:
    seen: list[int] = []

    def orig_wait(works):
        seen.append(gil.WINDOWS.open)
        if works == "boom":
            raise RuntimeError("wait failed")

    mod = types.ModuleType("torch.distributed.pipelining.schedules")
    mod._batch_p2p = lambda ops: ops  # type: ignore[attr-defined]
    mod._wait_batch_p2p = orig_wait  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining.schedules", mod)
    records: list[tuple] = []
    w = p2p.P2PWrapper(records.append, lambda e: None)
    w.active = True
    w.patch()
    mod._wait_batch_p2p([Work()])
    assert seen[-1] != 0 and windows.open == 0  # marked during the wait, cleared after
    mod._wait_batch_p2p([Work(done=True)])
    assert seen[-1] == 0  # complete already: no window
    with pytest.raises(RuntimeError):
        mod._wait_batch_p2p("boom")  # works_of("boom") is not a list of Works: the record fails, not the wait
    assert windows.open == 0
    windows.active = False
    mod._wait_batch_p2p([Work()])
    assert seen[-1] == 0 and len(records) == 3
    w.restore()


@pytest.mark.parametrize(("backend", "setting", "on"), [("gloo", True, True), ("nccl", True, False), ("gloo", False, False)])
def test_a_cpu_pipelines_waits_turn_windows_on(tmp_path, monkeypatch, backend, setting, on) -> None:
    monkeypatch.setattr(fr, "group_backend", lambda group: backend)
    monkeypatch.setattr(fr, "group_name", lambda group: ("1", "pp"))
    saved = gil.WINDOWS.active
    gil.WINDOWS.active = False
    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path), work_in_waits=setting)
    agent.start()
    try:
        c = agent.component("collectives")
        c._p2p_backend(object())
        assert gil.WINDOWS.active is on
        assert c.summary()["work_in_waits"]["on"] is on
    finally:
        agent.stop()
        assert gil.WINDOWS.active is False
        gil.WINDOWS.active = saved
