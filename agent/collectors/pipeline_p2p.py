"""The pipeline's p2p ops between the schedule's issue and its wait, from the ``torch_compat.p2p``
wrapper's records: gloo's only source of pipeline traffic (its flight recorder records no send/recv).
On NCCL the recorder counts and times p2p itself; the wrapper then only names the groups pipelining
runs on (their entries are ``pp``). The ops the training thread waits in now (an ``enter`` record no
``wait`` record followed) are a hang's p2p edges: whom this rank waits for (``waiting_in``)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from hpar_agent import gil
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.collectors.collective_state import OpStats
from hpar_agent.collectors.fr_ledger import PP_PG, Groups, Op
from hpar_agent.streams import comm_stream_label
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat.p2p import (
    EnterRecord,
    IssueRecord,
    P2PRecord,
    P2PWrapper,
    WaitRecord,
    ops_of,
    waits_of,
)

#: Process groups whose backend is remembered (cleared when full).
MAX_GROUPS = 64
#: Waits remembered for ``waited_by``: a few seconds of a pipeline's p2p waits (16 a step for GPipe's 4
#: microbatches), as (exit ns, the ns waited in p2p so far).
MAX_WAITS = 4096


def waited_by(log: Sequence[tuple[int, int]], times_ns: Sequence[int]) -> list[int]:
    """For each time (ns since the epoch): the ns a rank had waited in p2p by then, from its wait log
    ((exit ns, ns waited so far), oldest first); -1 before the log's first wait (unknown). The
    difference of two is what it waited between them: waits for a pipeline neighbour, not its work."""
    exits = [t for t, _ in log]
    return [log[i - 1][1] if (i := bisect.bisect_right(exits, t)) else -1 for t in times_ns]


class P2PTracker:
    """The wrapper, its buffer, and the ops issued and not yet waited for (``pp`` in flight)."""

    def __init__(self, groups: Groups, max_pending: int, on_error: Callable[[BaseException], Any]) -> None:
        self.buffer: BoundedBuffer[P2PRecord] = BoundedBuffer("collectives_p2p", 1 << 16)
        self.wrapper = P2PWrapper(self.buffer.put, on_error)
        self.groups = groups
        self.max_pending = max_pending
        self.pending: dict[int, list[Op]] = {}  # id(Work) -> ops awaiting a wait record
        self.untimed: set[int] = set()  # id(Work) of pending ops issued in a step without detail
        self._backends: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, backend)
        #: (wait entered ns, the ops it blocks on) while the training thread waits in p2p ops
        self.waiting: tuple[int, list[Op]] | None = None
        self.timeout_s: float | None = None  # the shortest timeout of the groups p2p ran on
        self.waited: deque[tuple[int, int]] = deque(maxlen=MAX_WAITS)  # (exit ns, ns waited so far)

    def process(
        self,
        records: list[P2PRecord],
        stats: OpStats,
        nccl_recorded: bool,
        finish: Callable[[Op, float], None],
    ) -> None:
        """Issues are counted in ``stats`` (an op on NCCL only without an NCCL flight recorder,
        ``nccl_recorded``: the recorder counts it); a wait times the ops of its Works with ``finish``."""
        for i, rec in enumerate(records):
            if i % 128 == 127:
                gil.pause_point()
            if rec[0] == "issue":
                self._issue(rec, stats, nccl_recorded)
            elif rec[0] == "enter":
                self._enter(rec)
            else:
                self.waiting = None
                self._wait(rec, finish)

    def _issue(self, rec: IssueRecord, stats: OpStats, nccl_recorded: bool) -> None:
        _, t0, infos, work_ids, timed = rec
        ops = []
        for op, peer, nbytes, group in ops_of(infos):
            backend = self.backend(group)
            if not (backend == "nccl" and nccl_recorded):  # else the FR counts it
                stats.count(PP_PG, op, nbytes)
                ops.append(Op(PP_PG, op, -1, nbytes, nbytes, t0, comm_stream_label(PP_PG, backend), 1, peer))
        if not work_ids or not ops:
            return
        if len(work_ids) == len(ops):
            pairs = [(w, [o]) for w, o in zip(work_ids, ops, strict=True)]
        else:  # coalesced: the last Work completes the batch
            pairs = [(work_ids[-1], ops)]
        untimed = self.untimed
        for wid, wops in pairs:
            self.pending[wid] = wops
            if timed:
                untimed.discard(wid)  # an id a freed Work had
            else:
                untimed.add(wid)
        while len(self.pending) > self.max_pending:
            untimed.discard(wid := next(iter(self.pending)))
            del self.pending[wid]

    def _enter(self, rec: EnterRecord) -> None:
        _, t_enter, open_ids = rec
        ops = [o for wid in open_ids for o in self.pending.get(wid, ())]
        self.waiting = (t_enter, ops) if ops else None

    def waiting_in(self) -> tuple[int, list[Op]] | None:
        """(ns the wait began, its ops: op, peer, pg) while the training thread waits in p2p ops."""
        return self.waiting

    def _wait(self, rec: WaitRecord, finish: Callable[[Op, float], None]) -> None:
        _, t_enter, done, t_exit = rec
        if t_exit > t_enter:
            total = self.waited[-1][1] if self.waited else 0
            self.waited.append((t_exit, total + t_exit - t_enter))
        for wid, was_done in waits_of(done):
            ops = self.pending.pop(wid, [])
            if wid in self.untimed:  # counted at issue; in flight until now
                self.untimed.discard(wid)
                continue
            for item in ops:
                end = t_enter if was_done else t_exit
                finish(item, max(0, end - item.start_ns) / 1e9)

    def backend(self, group: Any) -> str:
        """The backend of a pipeline p2p op's group, asked of torch once per group (an NCCL one is
        registered as pipelining's: its FR entries are pp)."""
        hit = self._backends.get(id(group))
        if hit is None or hit[0] is not group:  # the group object is held: its id is not reused
            if len(self._backends) >= MAX_GROUPS:
                self._backends.clear()
            backend = fr.group_backend(group)
            t = fr.group_timeout_s(group)
            if t is not None:
                self.timeout_s = t if self.timeout_s is None else min(self.timeout_s, t)
            if backend == "nccl":
                self.groups.pp.add(fr.group_name(group))
            hit = self._backends[id(group)] = (group, backend)
        return hit[1]

    def in_flight(self) -> int:
        return sum(len(v) for v in self.pending.values())

    def oldest_ns(self) -> int | None:
        """Enqueue ns of the oldest op in flight (None: none)."""
        return min((o.start_ns for ops in self.pending.values() for o in ops), default=None)
