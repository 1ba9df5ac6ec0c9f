"""How a pass shares the GIL: a hand-back after about a millisecond of work, not per unit, and pause
points that act only on the pass's own thread."""

from __future__ import annotations

import time

from hpar_agent.gil import Yielder


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
