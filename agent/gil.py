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

Better than a slot is a stretch in which the training thread waits with the GIL released and would
not use it anyway: a CPU pipeline rank waiting for its peer's activations or gradients (its bubble:
~19 % of the wall clock of the 4-rank CPU trainer, in ~13 waits a second over a millisecond, on the
2-core VM). Where the pipeline's p2p waits block the host (gloo), the wait wrapper marks them
(``Windows``), and a paced pass parks at each hand-back until such a wait begins or its next slot
comes, whichever is first; in a wait it works until the Works waited on complete.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: Longest stretch of agent-thread Python between two hand-backs of the GIL.
HOLD_NS = 1_000_000
#: A paced pass holds the GIL in one slice per this many ns of wall clock, at its multiples.
SLOT_NS = 100_000_000
#: Longest stretch a pass works in a wait of the training thread before it lets the process's other
#: threads have the GIL for a moment (the wait normally ends first: its Works complete).
WINDOW_MAX_NS = 10_000_000


class Windows:
    """The training thread's waits on Works with the GIL released, for a paced pass to work in.

    Training thread: ``enter(works)`` before the wait and ``leave()`` after it (attribute stores; a
    lock release only while a pass is parked and the wait is real, i.e. a Work is still incomplete).
    Agent thread: ``park(until_ns)`` between slices, ``over(serial)`` at each unit inside a window.
    The end of a wait is seen from its Works (``is_completed``, a mutex in C++), not from ``leave``:
    the training thread cannot run ``leave`` until it has the GIL back, which the pass then holds.
    ``active`` says whether any wait can open a window (a pipeline whose p2p waits block the host);
    passes pace by slots alone while it is False."""

    __slots__ = ("_sem", "_serial", "active", "at_slot", "in_wait", "open", "wanted", "works")

    def __init__(self) -> None:
        self.active = False
        self.open = 0  # serial of the wait in progress; 0 between waits
        self.works: tuple[Any, ...] | list[Any] = ()
        self.wanted = False  # a pass is parked for a window
        self.in_wait = 0  # parks that ended in a wait of the training thread (agent thread's count)
        self.at_slot = 0  # parks that ended at the slot
        self._serial = 0
        self._sem = threading.Lock()  # held while nobody wakes the parked pass
        self._sem.acquire()

    def enter(self, works: tuple[Any, ...] | list[Any], pending: bool) -> None:
        """Training thread, before a wait on ``works`` (``pending``: one is not complete yet)."""
        self._serial += 1
        self.works = works
        self.open = self._serial if pending else 0
        if pending and self.wanted:
            try:
                self._sem.release()
            except RuntimeError:  # already released: the pass wakes anyway
                pass

    def leave(self) -> None:
        """Training thread, after the wait."""
        self.open = 0
        self.works = ()

    def over(self, serial: int) -> bool:
        """Agent thread: whether the wait ``serial`` ended (or its Works completed: the training
        thread is about to want the GIL)."""
        if self.open != serial:
            return True
        try:
            return all(w.is_completed() for w in self.works)
        except Exception:  # a Work that cannot say: treat the wait as over
            return True

    def park(self, until_ns: int) -> int:
        """Agent thread, the GIL released: wait for a window until ``until_ns`` (epoch ns). The
        window's serial, or 0 when ``until_ns`` came first."""
        while True:
            self.wanted = True  # before looking at ``open``: ``enter`` stores it before looking at this
            try:
                serial = self.open
                if serial and not self.over(serial):
                    self.in_wait += 1
                    return serial
                left = until_ns - time.time_ns()
                if left <= 0:
                    self.at_slot += 1
                    return 0
                self._sem.acquire(timeout=left / 1e9)  # a wake that raced a timeout returns at once next time
            finally:
                self.wanted = False


#: The process's waits (one training thread; ``torch_compat.p2p`` marks them).
WINDOWS = Windows()


class Yielder:
    """Call after each unit of agent work; it yields the GIL once ``hold_ns`` has passed since the
    last yield (or since it was made): ``sleep(0)``, or with ``deadline_ns`` (epoch ns) set and not
    reached, a sleep to the next slot of the wall clock (``sleep(0)`` once ``cancel`` is set: the
    agent is stopping). With ``windows`` active, that sleep ends early when the training thread
    begins a wait, and the pass works on until the wait ends instead of for ``hold_ns``."""

    __slots__ = ("cancel", "deadline_ns", "hold_ns", "idle", "since", "slot_ns", "window", "windows")

    def __init__(
        self, hold_ns: int = HOLD_NS, deadline_ns: int = 0, slot_ns: int = SLOT_NS,
        cancel: threading.Event | None = None, idle: Callable[[int], None] | None = None,
        windows: Windows | None = None,
    ) -> None:  # fmt: skip
        self.hold_ns = hold_ns
        self.deadline_ns = deadline_ns
        self.slot_ns = slot_ns
        self.cancel = cancel
        self.idle = idle  # called before a paced sleep with its end (epoch ns); must not raise
        self.windows = windows
        self.window = 0  # serial of the training thread's wait this slice works in; 0: a slot's slice
        self.since = time.perf_counter_ns()

    def __call__(self) -> None:
        if self.window:
            if not self.windows.over(self.window):  # type: ignore[union-attr]
                if time.perf_counter_ns() - self.since >= WINDOW_MAX_NS:
                    time.sleep(0)  # the wait goes on: the process's other threads (a scrape) get a turn
                    self.since = time.perf_counter_ns()
                return
            self.window = 0
        elif time.perf_counter_ns() - self.since < self.hold_ns:
            return
        self._hand_back()

    def start(self) -> None:
        """Before a paced pass's first unit: wait for a window of the training thread, or for the
        next slot at the latest (no-op without active windows)."""
        if self.windows is not None and self.windows.active and time.time_ns() < self.deadline_ns:
            self._hand_back()

    def _hand_back(self) -> None:
        now = time.time_ns()
        paced = now < self.deadline_ns and not (self.cancel is not None and self.cancel.is_set())
        wait = self.slot_ns - now % self.slot_ns if paced else 0
        if wait and self.idle is not None:
            self.idle(now + wait)  # its work comes out of the sleep: the slice still starts at the slot
        until = min(now + wait, self.deadline_ns)
        w = self.windows
        if wait and w is not None and w.active:
            self.window = w.park(until)
        else:
            time.sleep(max(0, until - time.time_ns()) / 1e9)
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
