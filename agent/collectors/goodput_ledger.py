"""The goodput ledger's arithmetic: a rank's wall time since its process started, cut into causes.

The ledger keeps one watermark, ``covered_ns``: everything from the process's start up to it has been
given to exactly one cause, so the causes add up to ``covered_ns - start_ns`` by construction. Each
accounted stretch starts at the watermark and moves it to its end; a stretch that begins before the
watermark (a step that ended after a hang was counted up to its end) only counts its part after it.

A step ``[start, end]`` is split, in this order, into the checkpoint calls and compiles inside it (wall
clock, from their own records), the data wait and the host time before its first forward and its
exposed communication (the step anatomy's shares of the step, applied to the step's wall time; the
checkpoint is taken out of the host share, where it runs), and what is left: productive, the step's own
compute. Exposed communication is a wait for the culprit when one is named; while none is, the last
``UNDECIDED_STEPS`` steps' of it stay undecided (the one part of the wall time in no cause yet), a wait
for the culprit if one is named in time, else productive: the step's own communication. Before the
Straggler detector has judged at all (``judged``), none of it is decided: a short run can end so.
Pure functions of their inputs: the goodput collector and the tests share it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hpar_agent.catalogue import GOODPUT_CAUSES as CAUSES
from hpar_agent.collectors.phases import Interval, exposed_ns, seconds, union

MAX_CULPRITS = 16  # distinct culprits a rank keeps a wait series for (the label's bound)
#: Steps whose exposed communication waits undecided for a culprit: the Straggler detector confirms one
#: over a window of recent collectives, so the waits of that window are for it too.
UNDECIDED_STEPS = 32


def within(merged: Sequence[Interval], lo: int, hi: int) -> Sequence[Interval]:
    """The intervals of ``merged`` (``phases.union``'s output: sorted, disjoint) that overlap [lo, hi],
    found by bisection: a pass accounts thousands of steps against thousands of compiles."""
    i = bisect.bisect_right(merged, (lo, lo))
    if i > 0 and merged[i - 1][1] > lo:
        i -= 1
    j = bisect.bisect_left(merged, (hi, hi), lo=i)
    return merged[i:j]


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """Intervals sorted and made disjoint, as ``Ledger.step`` takes them."""
    return union(intervals)


@dataclass(frozen=True)
class Shares:
    """Fractions of a step's time: in the data loader and on the host before the first forward, and in
    communication no compute hid (``comm_exposed``)."""

    data_wait: float = 0.0
    host: float = 0.0
    comm: float = 0.0


@dataclass
class Ledger:
    start_ns: int
    covered_ns: int = 0
    productive: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    wait_by: dict[int, float] = field(default_factory=dict)  # culprit rank -> seconds waited for it
    steps: int = 0  # steps accounted
    #: exposed communication of the recent steps no culprit was named for yet: a wait if one is named
    #: within UNDECIDED_STEPS steps, else the step's own communication (productive)
    undecided: deque[float] = field(default_factory=deque)
    older: float = 0.0  # the undecided seconds of steps before those, while nothing was judged

    def __post_init__(self) -> None:
        self.covered_ns = max(self.covered_ns, self.start_ns)

    @property
    def wall(self) -> float:
        return (self.covered_ns - self.start_ns) / 1e9

    def decide(self, culprit: int | None = None) -> None:
        """The undecided seconds: waits for ``culprit``, or (None) productive."""
        if culprit is None:
            self.productive += self.pending()
        else:
            self._wait(self.pending(), culprit)
        self.undecided.clear()
        self.older = 0.0

    def pending(self) -> float:
        """The undecided seconds."""
        return self.older + sum(self.undecided)

    def ratio(self) -> float | None:
        wall = self.wall
        return self.productive / wall if wall > 0 else None

    def _wait(self, secs: float, culprit: int | None) -> None:
        if secs <= 0:
            return
        if culprit is not None and (culprit in self.wait_by or len(self.wait_by) < MAX_CULPRITS):
            self.wait_by[culprit] = self.wait_by.get(culprit, 0.0) + secs
        self.lost["wait"] += secs

    def _fixed(self, lo: int, hi: int, ckpt: Iterable[Interval], compiles: Iterable[Interval]) -> float:
        """Checkpoint and compile seconds in [lo, hi] (a compile inside a checkpoint counts once, as
        checkpoint), added to the ledger; returns the checkpoint part."""
        c = exposed_ns(ckpt, [], lo, hi)
        k = exposed_ns(compiles, c, lo, hi)
        self.lost["checkpoint"] += seconds(c)
        self.lost["compile"] += seconds(k)
        return seconds(c)

    def span(
        self, end_ns: int, cause: str, ckpt: Iterable[Interval] = (), compiles: Iterable[Interval] = ()
    ) -> None:
        """[watermark, end_ns] outside any step: checkpoints and compiles in it, the rest to ``cause``."""
        lo, hi = self.covered_ns, end_ns
        if hi <= lo:
            return
        ckpt, compiles = list(ckpt), list(compiles)
        total = (hi - lo) / 1e9
        fixed = seconds(exposed_ns([*ckpt, *compiles], [], lo, hi))
        self._fixed(lo, hi, ckpt, compiles)
        self.lost[cause] += max(0.0, total - fixed)
        self.covered_ns = hi

    def step(
        self,
        start_ns: int,
        end_ns: int,
        shares: Shares,
        culprit: int | None = None,
        ckpt: Sequence[Interval] = (),
        compiles: Sequence[Interval] = (),
        recomputed: bool = False,
        judged: bool = True,
    ) -> None:
        """One step. Before the first one, the time since the process started is startup; in the first
        one, so is its host time before the forward (process group, model and loader set-up when the
        agent attached before them). ``judged``: whether the Straggler detector has judged (a single rank
        needs none). ``recomputed``: an earlier attempt did this step already, so all of
        it but its checkpoints, compiles and set-up is ``recomputed``. ``ckpt`` and ``compiles``: sorted and
        disjoint (``merged``)."""
        first = self.steps == 0
        if first and start_ns > self.covered_ns:
            self.span(start_ns, "startup", ckpt, compiles)
        lo, hi = max(start_ns, self.covered_ns), end_ns
        self.steps += 1
        if hi <= lo:
            return
        total = (hi - lo) / 1e9
        ckpt, compiles = within(ckpt, lo, hi), within(compiles, lo, hi)
        in_ckpt = self._fixed(lo, hi, ckpt, compiles)
        rem = total - seconds(exposed_ns([*ckpt, *compiles], [], lo, hi))
        self.covered_ns = hi
        host = max(0.0, shares.host * total - in_ckpt)
        if recomputed:  # all of it but its set-up (the first step's host time)
            host = min(host, rem) if first else 0.0
            self.lost["startup"] += host
            self.lost["recomputed"] += max(0.0, rem - host)
            return
        data = min(max(0.0, shares.data_wait) * total, rem)
        rem -= data
        host = min(host, rem)
        self.lost["startup" if first else "host"] += host
        rem -= host
        comm = min(max(0.0, shares.comm) * total, rem)
        rem -= comm
        self.lost["data_wait"] += data
        if culprit is not None:
            self.decide(culprit)
            self._wait(comm, culprit)
        else:
            if judged and self.older:  # judged: no slow rank in the steps it saw first
                self.productive, self.older = self.productive + self.older, 0.0
            self.undecided.append(comm)
            if len(self.undecided) > UNDECIDED_STEPS:
                old = self.undecided.popleft()
                if judged:
                    self.productive += old
                else:
                    self.older += old
        self.productive += max(0.0, rem)

    def add(self, other: Ledger) -> None:
        """Add another ledger's seconds and wall time to this one's (a total over attempts: its
        ``covered_ns`` is then no instant, only ``wall`` means something)."""
        self.covered_ns += other.covered_ns - other.start_ns
        self.productive += other.productive
        self.older += other.pending()
        for cause, secs in other.lost.items():
            self.lost[cause] = self.lost.get(cause, 0.0) + secs
        for r, secs in other.wait_by.items():
            if r in self.wait_by or len(self.wait_by) < MAX_CULPRITS:
                self.wait_by[r] = self.wait_by.get(r, 0.0) + secs
        self.steps += other.steps

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Ledger:
        """A ledger written by ``to_dict`` (an earlier attempt's)."""
        start, end = float(d["start"]), float(d["end"])  # type: ignore[arg-type]
        lost: dict[str, float] = dict.fromkeys(CAUSES, 0.0)
        for k, v in dict(d.get("lost_seconds") or {}).items():  # type: ignore[call-overload]
            if k in lost:
                lost[k] = float(v)
        wait_by = {int(k): float(v) for k, v in dict(d.get("wait_by_culprit") or {}).items()}  # type: ignore[call-overload]
        return cls(
            start_ns=int(start * 1e9),
            covered_ns=int(end * 1e9),
            productive=float(d.get("productive_seconds") or 0.0),  # type: ignore[arg-type]
            lost=lost,
            wait_by=wait_by,
            steps=int(d.get("steps") or 0),  # type: ignore[call-overload]
            older=float(d.get("undecided_seconds") or 0.0),  # type: ignore[arg-type]
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "undecided_seconds": round(self.pending(), 6),
            "start": self.start_ns / 1e9,
            "end": self.covered_ns / 1e9,
            "wall_seconds": round(self.wall, 6),
            "productive_seconds": round(self.productive, 6),
            "lost_seconds": {c: round(v, 6) for c, v in self.lost.items() if v > 0},
            "wait_by_culprit": {str(r): round(v, 6) for r, v in sorted(self.wait_by.items())},
            "goodput_ratio": None if (r := self.ratio()) is None else round(r, 6),
            "steps": self.steps,
        }
