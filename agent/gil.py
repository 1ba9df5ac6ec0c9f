"""How the agent thread shares the GIL with the training thread.

The training thread drops the GIL around every torch op and must win it back after each; against a
thread that keeps it, it waits up to the interpreter's 5 ms switch interval, op after op (a 180 ms
agent pass of span building once stretched steps by 100-450 ms). So an agent pass hands the GIL back
once it has held it about a millisecond. Not after every item: each hand-back is a thread switch the
training thread pays for too (a futex wake and a reschedule, tens of µs on a busy host), and a pass
over 100 completed steps of ~5 µs each would force 100 of them.

Handing back is not enough on a CPU-bound rank: the training thread then loses about what the agent
holds, so a 10 ms pass made one step 10 % longer (``benchmarks/rank_timeline.py`` on 4 CPU ranks). A
paced pass (the agent thread's periodic ones) therefore works in slices: after each millisecond held
it sleeps to the next ``SLOT_NS`` instant of the wall clock, so it holds the GIL about
``HOLD_NS / SLOT_NS`` (1 %) of any stretch of time (a unit of work between two pause points that runs
longer holds it longer: components put pause points inside their long loops), and every rank holds it
in the same slots: a synchronous job stalls when any rank stalls, so slices at shared instants
overlap instead of adding up over the ranks. A pass that would outlast its budget (``deadline_ns``) stops pacing and finishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Longest stretch of agent-thread Python between two hand-backs of the GIL.
HOLD_NS = 1_000_000
#: A paced pass holds the GIL in one slice per this many ns of wall clock, at its multiples.
SLOT_NS = 100_000_000


class Yielder:
    """Call after each unit of agent work; it yields the GIL once ``hold_ns`` has passed since the
    last yield (or since it was made): ``sleep(0)``, or with ``deadline_ns`` (epoch ns) set and not
    reached, a sleep to the next slot of the wall clock (``sleep(0)`` once ``cancel`` is set: the
    agent is stopping)."""

    __slots__ = ("cancel", "deadline_ns", "hold_ns", "idle", "since", "slot_ns")

    def __init__(
        self, hold_ns: int = HOLD_NS, deadline_ns: int = 0, slot_ns: int = SLOT_NS,
        cancel: threading.Event | None = None, idle: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.hold_ns = hold_ns
        self.deadline_ns = deadline_ns
        self.slot_ns = slot_ns
        self.cancel = cancel
        self.idle = idle  # called before a paced sleep with its end (epoch ns); must not raise
        self.since = time.perf_counter_ns()

    def __call__(self) -> None:
        if time.perf_counter_ns() - self.since < self.hold_ns:
            return
        now = time.time_ns()
        paced = now < self.deadline_ns and not (self.cancel is not None and self.cancel.is_set())
        wait = self.slot_ns - now % self.slot_ns if paced else 0
        if wait and self.idle is not None:
            self.idle(now + wait)  # its work comes out of the sleep: the slice still starts at the slot
        time.sleep(max(0, min(now + wait, self.deadline_ns) - time.time_ns()) / 1e9)
        self.since = time.perf_counter_ns()


_current: tuple[int, Yielder] | None = None  # (thread id, yielder) of the pass running now


def pause_point() -> None:
    """A place inside a component's work where the running pass may hand the GIL back (a no-op
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
