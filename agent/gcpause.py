"""Keep the agent's short-lived object bursts from triggering the interpreter's garbage collector.

A full flight-recorder read unpickles ~40,000 small objects (2,000 entries) and drops them a few
milliseconds later. Counted as allocations, they push the collector's generation counters over their
thresholds, and in a process that holds torch's and dynamo's large heap a generation-2 collection
then runs on the agent thread with the GIL held: 240 ms measured on a 4-rank CPU run, a stall of
every rank's training thread (and with it of the whole synchronous job). Pausing collection for the
burst and releasing the objects before it ends leaves the counters where they were: the objects die
by reference counting, as they would anyway, and no collection is owed for them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block (a no-op where the user already disabled it).

    The user's setting wins: collection is switched back on only if it was on when the block began.
    Callers drop what they allocated before leaving the block."""
    was_on = gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
