"""Alert callbacks: let the training loop act on an alert (checkpoint, lower the LR, stop cleanly).

Callbacks run on their own daemon worker thread, fed through a bounded queue: a slow callback delays
neither the training thread nor the agent thread (the detectors keep ticking), a full queue drops the
newest transition, and an exception in a callback is counted in
``hpar_agent_errors_total{component="alert_callbacks"}`` and logged once, never raised.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

COMPONENT = "alert_callbacks"


@dataclass(frozen=True)
class Alert:
    """One alert transition (``state`` firing or resolved), or an active alert in ``active_alerts()``."""

    name: str
    state: str
    value: float
    threshold: float
    step: int
    rank: int
    details: dict[str, Any] = field(default_factory=dict)
    evidence: tuple[str, ...] = ()


class QueueFull(Exception):
    """A transition dropped because the callbacks' queue was full (a callback is too slow)."""


class AlertCallbacks:
    """Registered callbacks and the worker thread that calls them, started on the first registration."""

    def __init__(self, on_error: Callable[[str, BaseException], None], capacity: int = 256) -> None:
        self._on_error = on_error
        self._callbacks: list[Callable[[Alert], Any]] = []
        self._queue: queue.Queue[Alert | None] = queue.Queue(maxsize=capacity)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.dropped = 0

    def add(self, callback: Callable[[Alert], Any]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hpar-agent-alerts", daemon=True)
                self._thread.start()

    def dispatch(self, alert: Alert) -> None:
        """Agent thread: queue the transition for the worker; never blocks."""
        if not self._callbacks:
            return
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            self._on_error(COMPONENT, QueueFull(f"{alert.name} {alert.state} dropped: a callback is slow"))

    def stop(self, timeout: float = 1.0) -> None:
        """Let queued transitions run for at most ``timeout`` seconds, then leave the worker (daemon)."""
        thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        thread.join(timeout)

    def _run(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                with self._lock:
                    self._thread = None
                return
            for cb in list(self._callbacks):
                try:
                    cb(alert)
                except Exception as exc:
                    self._on_error(COMPONENT, exc)
