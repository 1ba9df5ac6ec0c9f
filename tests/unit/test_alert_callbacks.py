"""agent.on_alert / agent.active_alerts: callbacks off the training and agent threads, never breaking either."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from hpar_agent.alert_callbacks import Alert
from tests.unit.harness import make_agent, steps


def _hang_agent(tmp_path: Any) -> tuple[Any, Any, Any]:
    st = steps(5, last_ts=time.time() - 30)
    agent, det = make_agent(tmp_path, comps=(st,), **{"Hang.timeout_s": 10.0})
    agent.config.evidence = False
    return agent, det, st


def test_callback_once_per_transition_and_active_alerts(tmp_path: Any) -> None:
    agent, _, st = _hang_agent(tmp_path)
    got: queue.Queue[tuple[Alert, str]] = queue.Queue()
    agent.on_alert(lambda a: got.put((a, threading.current_thread().name)))
    assert agent.active_alerts() == []
    agent.tick()
    agent.tick()  # still active: no second call
    alert, thread = got.get(timeout=5)
    assert (alert.name, alert.state, alert.rank) == ("Hang", "firing", 0)
    assert alert.value >= 30 and alert.threshold == 10.0 and isinstance(alert.details, dict)
    assert thread == "hpar-agent-alerts"  # neither the training thread nor the agent thread
    active = agent.active_alerts()
    assert [a.name for a in active] == ["Hang"] and active[0].value >= 30
    st.last_step_ts = time.time()
    agent.tick()
    resolved, _ = got.get(timeout=5)
    assert (resolved.name, resolved.state) == ("Hang", "resolved")
    assert got.empty() and agent.active_alerts() == []
    agent.alert_callbacks.stop()


def test_raising_callback_is_counted_and_others_still_run(tmp_path: Any) -> None:
    agent, _, _ = _hang_agent(tmp_path)
    got: queue.Queue[Alert] = queue.Queue()

    def bad(alert: Alert) -> None:
        raise RuntimeError("user bug")

    agent.on_alert(bad)
    agent.on_alert(got.put)
    agent.tick()
    assert got.get(timeout=5).name == "Hang"
    agent.alert_callbacks.stop()
    assert agent.errors["alert_callbacks"] == 1


def test_slow_callback_delays_no_tick_and_overflow_drops(tmp_path: Any) -> None:
    agent, det, st = _hang_agent(tmp_path)
    agent.alert_callbacks._queue.maxsize = 1  # one waiting transition at most
    release = threading.Event()
    started = threading.Event()

    def slow(alert: Alert) -> None:
        started.set()
        release.wait(10)

    agent.on_alert(slow)
    try:
        t0 = time.perf_counter()
        agent.tick()  # fires: the worker takes it and blocks in the callback
        assert started.wait(5)
        st.last_step_ts = time.time()
        agent.tick()  # resolves: queued behind the slow callback
        st.last_step_ts = time.time() - 30
        agent.tick()  # fires again: the queue is full, dropped and counted
        assert time.perf_counter() - t0 < 1.0
        assert det.states["Hang"].fired == 2
        assert agent.alert_callbacks.dropped == 1 and agent.errors["alert_callbacks"] == 1
    finally:
        release.set()
        agent.alert_callbacks.stop()


def test_forked_child_forgets_the_callbacks_worker(tmp_path: Any) -> None:
    agent, _, _ = _hang_agent(tmp_path)
    agent.on_alert(lambda a: None)
    parent = agent.alert_callbacks
    agent.forget_in_child()  # what os.register_at_fork runs in a child
    assert agent.alert_callbacks is not parent and agent.alert_callbacks._thread is None
    assert agent.alert_callbacks._callbacks == []  # the parent's worker thread is not in the child
    parent.stop()
