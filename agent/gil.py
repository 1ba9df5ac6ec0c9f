"""How the agent thread shares the GIL with the training thread.

The training thread drops the GIL around every torch op and must win it back after each; against a
thread that keeps it, it waits up to the interpreter's 5 ms switch interval, op after op. So long agent
work hands the GIL back once it has held it about a millisecond. Not after every item: each hand-back
is a thread switch the training thread pays for too (a futex wake and a reschedule, tens of µs on a
busy host), and a pass over 100 completed steps of ~5 µs each would otherwise force 100 of them.
"""

from __future__ import annotations

import threading
import time

#: Longest stretch of agent-thread Python between two hand-backs of the GIL.
HOLD_NS = 1_000_000


class Yielder:
    """Call after each unit of agent work: it yields the GIL (``sleep(0)``) once ``hold_ns`` has passed
    since the last yield, or since it was made."""

    __slots__ = ("hold_ns", "since")

    def __init__(self, hold_ns: int = HOLD_NS) -> None:
        self.hold_ns = hold_ns
        self.since = time.perf_counter_ns()

    def __call__(self) -> None:
        if time.perf_counter_ns() - self.since >= self.hold_ns:
            time.sleep(0)
            self.since = time.perf_counter_ns()


_current: tuple[int, Yielder] | None = None  # (thread id, yielder) of the pass running now


def pause_point() -> None:
    """A place inside a component's long work where the running pass may hand the GIL back (a no-op
    outside a pass, and on any thread but the pass's)."""
    cur = _current
    if cur is not None and cur[0] == threading.get_ident():
        cur[1]()


class running:
    """``with running(yielder):`` makes ``pause_point()`` on this thread use it (one pass)."""

    def __init__(self, y: Yielder) -> None:
        self.y = y

    def __enter__(self) -> Yielder:
        global _current
        _current = (threading.get_ident(), self.y)
        return self.y

    def __exit__(self, *exc: object) -> None:
        global _current
        _current = None
