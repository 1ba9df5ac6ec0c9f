"""How the agent thread shares the GIL with the training thread.

The training thread drops the GIL around every torch op and must win it back after each; against a
thread that keeps it, it waits up to the interpreter's 5 ms switch interval, op after op (a 180 ms
agent pass of span building once stretched steps by 100-450 ms). So an agent pass hands the GIL back
(``sleep(0)``) once it has held it about a millisecond. Not after every item: each hand-back is a
thread switch the training thread pays for too (a futex wake and a reschedule, tens of µs on a busy
host), and a pass over 100 completed steps of ~5 µs each would force 100 of them.
"""

from __future__ import annotations

import time

#: Longest stretch of agent-thread Python between two hand-backs of the GIL.
HOLD_NS = 1_000_000


class Yielder:
    """Call after each unit of agent work; it yields the GIL once ``hold_ns`` has passed since the
    last yield (or since it was made)."""

    __slots__ = ("hold_ns", "since")

    def __init__(self, hold_ns: int = HOLD_NS) -> None:
        self.hold_ns = hold_ns
        self.since = time.perf_counter_ns()

    def __call__(self) -> None:
        if time.perf_counter_ns() - self.since >= self.hold_ns:
            time.sleep(0)
            self.since = time.perf_counter_ns()
