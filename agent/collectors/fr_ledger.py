"""What the flight recorder's entries add up to, one full read at a time.

Per read: counts and bytes per (pg, op), record-id gaps (unobserved), the ops still open, the timed
ops, the kept entries the detectors compare across ranks, and the gradient elements reduced per step.
Torch-free and agent-free (``gil.pause_point`` is a no-op outside a pass), so it is tested on plain dicts: what only torch knows comes in as ``Groups``
and step boundaries; what a read yields goes out as one ``Update`` of plain data, which the collectives
collector applies.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hpar_agent import gil
from hpar_agent.streams import comm_stream_label
from hpar_agent.torch_compat.fr_decode import (
    OTHER,
    REDUCE_OPS,
    UNKNOWN_PG,
    duration_s,
    entry_backend,
    entry_bytes,
    entry_group,
    entry_numel,
    entry_seq,
    is_epoch_ns,
    op_label,
    p2p_peer,
    pg_label,
)

#: How long a completed NCCL entry may wait for its duration before it is counted untimed.
PENDING_TIMEOUT_NS = 30 * 10**9
#: Step boundaries kept to place entries in their step: covers an ``fr_interval`` of fast steps.
MAX_BOUNDARIES = 4096
#: Distinct entry shapes whose decoding is kept (a loop repeats a few; cleared when full).
MAX_DECODED = 4096
PP_PG = "pp"


class Op(NamedTuple):
    """One collective or p2p op as it is timed."""

    pg: str
    op: str
    seq: int
    nbytes: int
    data_bytes: int  # nccl-tests' size: the larger of input and output bytes
    start_ns: int
    stream: str
    size: int | None = None
    peer: int = -1


@dataclass(slots=True)
class Groups:
    """What the training process knows about its process groups, and the ``pg`` label of each."""

    labels: dict[tuple[str, str], str] = field(default_factory=dict)  # (name, desc) -> pg label
    pp: set[tuple[str, str]] = field(default_factory=set)  # groups pipelining p2p runs on
    sizes: dict[str, int] = field(default_factory=dict)  # group name -> size
    ranks: dict[str, list[int]] = field(default_factory=dict)  # group name -> global rank by group rank
    max_pgs: int = 16

    def label(self, name: str, desc: str) -> str:
        """The group's ``pg`` label, assigned on first sight; past ``max_pgs`` labels new ones share OTHER."""
        key = (str(name), str(desc))
        label = self.labels.get(key)
        if label is None:
            label = pg_label(*key)
            if label not in self.labels.values() and len(set(self.labels.values())) >= self.max_pgs:
                label = OTHER
            self.labels[key] = label
        return label

    def global_rank(self, name: str, group_rank: int) -> int:
        ranks = self.ranks.get(name)
        return ranks[group_rank] if ranks is not None and 0 <= group_rank < len(ranks) else -1


@dataclass(slots=True, frozen=True)
class _Decoded:
    """An FR entry's name and shapes decoded (``Ledger._decode``)."""

    pname: str
    op: str
    backend: str
    nbytes: int
    data_bytes: int
    numel: int
    sizes: str
    dtypes: str


def _texts(sizes: Any, dtypes: Any) -> tuple[str, str]:
    """An entry's sizes and dtypes as the text the detectors compare (``"[[64]]"``, ``"Float"``)."""
    sizes_text = sizes if isinstance(sizes, str) else str(sizes)
    return sizes_text, dtypes if isinstance(dtypes, str) else ",".join(map(str, dtypes or ()))


@dataclass(slots=True)
class Update:
    """What one full read of one recorder yields (plain data)."""

    rec: str
    status: dict[str, Any] = field(default_factory=dict)  # the dump's pg_status
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    nbytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    unobserved: Counter[str] = field(default_factory=Counter)
    reduced: dict[int, Counter[str]] = field(default_factory=dict)  # step -> pg -> elements reduced
    #: (created ns, pg, elements) of reductions after the last boundary the ledger knew: the collector places them
    unplaced: list[tuple[int, str, int]] = field(default_factory=list)
    kept: list[dict[str, Any]] = field(default_factory=list)  # new entries for the detectors, oldest first
    timed: list[tuple[Op, float]] = field(default_factory=list)  # (op, seconds)
    opened: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # (pg, seq, created ns) not done at the dump
    pg_ids: dict[str, str] = field(default_factory=dict)  # the recorder's pg_id -> pg label
    backends: dict[str, str] = field(default_factory=dict)  # pg label -> recorder
    labels: dict[tuple[str, str], str] = field(default_factory=dict)  # labels the ledger assigned
    pg_timeout_s: float | None = None
    p2p: bool = False  # the recorder's entries include p2p ops (pg_status does not count them)
    new_ids: int = 0  # record ids past the previous cursor (the entries overwritten included)
    cursor: int | None = None
    pending: int = 0  # the recorder's entries awaiting their duration
    pending_min_ns: int | None = None  # the oldest of them (the span watermark)
    #: (op, peer, pg, seconds open at this read) of the p2p ops the dump shows not completed: the ops a
    #: rank waits in on a backend whose recorder holds p2p (NCCL), a hang's p2p edges
    p2p_open: list[tuple[str, int, str, float]] = field(default_factory=list)


class Ledger:
    """The flight-recorder half of the collectives collector: entries in, one ``Update`` per read."""

    def __init__(
        self, *, attach_ns: int, recent: int = 2048, max_pending: int = 4096, groups: Groups | None = None
    ) -> None:
        self.attach_ns = attach_ns
        self.recent = recent
        self.max_pending = max_pending
        self.groups = groups if groups is not None else Groups()
        self._cursor: dict[str, int] = {}  # recorder -> next record_id to read
        # recorders whose ring was empty at attach (cursor 0): every group and id came after, so what
        # the ring overwrote before the first read was unobserved, not before attach
        self._fresh: set[str] = set()
        self._seq: dict[tuple[str, str, bool], int] = {}  # (recorder, pg, is_p2p) -> last seq
        self._decoded: dict[tuple[str, ...], _Decoded] = {}  # an entry's shape text -> what it means
        self._pending: dict[tuple[str, int], Op] = {}  # NCCL entries awaiting completion
        self._batches: dict[tuple[str, int], list[Op]] = {}  # coalesced entry -> the p2p ops it completes
        self._open_batch: dict[tuple[str, str], list[tuple[str, int]]] = {}  # p2p since the last coalesced
        self._bound_t: list[int] = []
        self._bound_s: list[int] = []

    def start_at(self, cursors: dict[str, int]) -> None:
        """Read these recorders from these record ids on (0: a ring empty at attach, see ``_fresh``)."""
        for rec, cursor in cursors.items():
            self._cursor[rec] = cursor
            if cursor == 0:
                self._fresh.add(rec)

    def add_boundaries(self, bounds: list[tuple[int, int]]) -> None:
        """(epoch ns, step) of step boundaries since the last call, oldest first."""
        for t_ns, step in bounds:
            self._bound_t.append(t_ns)
            self._bound_s.append(step)
        del self._bound_t[:-MAX_BOUNDARIES], self._bound_s[:-MAX_BOUNDARIES]

    def process(self, rec: str, data: dict[str, Any], *, nccl_timing: bool, now_ns: int) -> Update:
        """One full dump of ``rec``: its entries past the cursor, and the pending ones it completes."""
        upd = Update(rec, status=data.get("pg_status") or {})
        entries = data.get("entries") or []
        if any(a["record_id"] > b["record_id"] for a, b in itertools.pairwise(entries)):  # FR: oldest first
            entries = sorted(entries, key=lambda e: e.get("record_id", 0))
        if self._pending:
            self._complete_pending(rec, entries, nccl_timing, now_ns, upd)
        if entries:
            self._read_entries(rec, entries, nccl_timing, upd)
        mine = [o.start_ns for k, o in self._pending.items() if k[0] == rec]
        upd.pending, upd.pending_min_ns = len(mine), min(mine, default=None)
        if mine and entries:
            upd.p2p_open = self._open_p2p(rec, entries, now_ns)
        upd.cursor = self._cursor.get(rec)
        return upd

    def _read_entries(self, rec: str, entries: list[dict[str, Any]], nccl_timing: bool, upd: Update) -> None:
        first_read = rec not in self._cursor
        start = nxt = self._cursor.get(rec, entries[0]["record_id"])
        gap = 0
        seq_gaps: Counter[str] = Counter()
        done = {str(k): int(v.get("last_completed_collective", -1)) for k, v in upd.status.items()}
        labels_before = len(self.groups.labels)
        kept: deque[dict[str, Any]] = deque(maxlen=self.recent)
        first_new = bisect.bisect_left(
            entries, nxt, key=lambda e: e["record_id"]
        )  # the ring's older half was read
        for i, e in enumerate(itertools.islice(entries, first_new, None)):
            if i & 255 == 255:
                gil.pause_point()  # ~1 ms of entries: the training thread gets the GIL back
            rid = int(e["record_id"])
            gap += rid - nxt
            nxt = rid + 1
            name, desc = entry_group(e)
            is_p2p = bool(e.get("is_p2p", False))
            pg = PP_PG if is_p2p and (name, desc) in self.groups.pp else self.groups.label(name, desc)
            seq = entry_seq(e, is_p2p)
            created = int(e.get("time_created_ns") or 0)
            if is_p2p:
                upd.p2p = True
            else:
                pg_id = str(e.get("pg_id", ""))
                upd.pg_ids[pg_id] = pg
                upd.backends.setdefault(pg, rec)
                if seq > done.get(pg_id, -1):  # in-flight age counts ops from before attach too
                    upd.opened.append((pg, seq, created))
            last = self._seq.get((rec, pg, is_p2p), 0 if rec in self._fresh else None)  # fresh: seqs from 1
            if last is not None and seq > last + 1:
                seq_gaps[pg] += seq - last - 1
            self._seq[(rec, pg, is_p2p)] = max(seq, last if last is not None else seq)
            if e.get("timeout_ms"):  # the Hang detector must fire before the watchdog aborts
                t = float(e["timeout_ms"]) / 1e3
                upd.pg_timeout_s = t if upd.pg_timeout_s is None else min(upd.pg_timeout_s, t)
            if first_read and is_epoch_ns(created) and created < self.attach_ns:
                continue  # before attach: baseline only (epoch clocks only; a monotonic stamp can't tell)
            self._observe(rec, e, pg, name, seq, is_p2p, created, nccl_timing, upd, kept)
        upd.kept = list(kept)
        self._cursor[rec] = nxt
        upd.new_ids = nxt - start
        if len(self.groups.labels) != labels_before:
            upd.labels = dict(self.groups.labels)
        if gap:  # attribute to groups by their seq gaps, the rest to "unknown"
            for pg, n in seq_gaps.items():
                take = min(n, gap)
                upd.unobserved[pg] += take
                gap -= take
            if gap:
                upd.unobserved[UNKNOWN_PG] += gap

    def _decode(self, rec: str, e: dict[str, Any]) -> _Decoded:
        """What an entry's name and shapes mean, computed once per distinct (name, sizes, dtypes) text:
        a training loop repeats the same few collectives, so a read of ~1,000 entries decodes a handful."""
        pname = str(e.get("profiling_name", ""))
        sizes, dtypes = e.get("input_sizes"), e.get("input_dtypes")
        # Text, not the dump's nested lists: a dict of atomic values is not tracked by the garbage
        # collector, while 2,048 kept entries of 7 lists each, renewed every read, push the
        # interpreter into a full collection (hundreds of ms in a large heap) every ~30 s of a CPU run.
        sizes_text, dtypes_text = _texts(sizes, dtypes)
        key = (rec, pname, sizes_text, dtypes_text, str(e.get("output_sizes")), str(e.get("output_dtypes")))
        dec = self._decoded.get(key)
        if dec is None:
            if len(self._decoded) >= MAX_DECODED:
                self._decoded.clear()
            nbytes = entry_bytes(sizes, dtypes)
            out_bytes = entry_bytes(e.get("output_sizes"), e.get("output_dtypes"))
            op = op_label(pname)
            if op == "scatter":  # only the root records an input: compare what every member receives
                sizes_text, dtypes_text = _texts(e.get("output_sizes"), e.get("output_dtypes"))
            dec = self._decoded[key] = _Decoded(
                pname,
                op,
                entry_backend(pname, rec),
                nbytes,
                max(nbytes, out_bytes),
                entry_numel(sizes),
                sys.intern(sizes_text),
                sys.intern(dtypes_text),
            )
        return dec

    def _step_of(self, t_ns: int) -> int | None:
        """The step whose window (previous boundary, boundary] holds ``t_ns``; None past the last boundary."""
        i = bisect.bisect_left(self._bound_t, t_ns)
        return self._bound_s[i] if i < len(self._bound_s) else None

    def _observe(
        self,
        rec: str,
        e: dict[str, Any],
        pg: str,
        name: str,
        seq: int,
        is_p2p: bool,
        created: int,
        nccl_timing: bool,
        upd: Update,
        kept: deque[dict[str, Any]],
    ) -> None:
        dec = self._decode(rec, e)
        op, nbytes = dec.op, dec.nbytes
        batch_key = (rec, str(name))
        batch = self._open_batch.pop(batch_key, None) if op == "coalesced" else None
        if not batch:  # a coalesced entry that closes a p2p batch is its ops' completion, not an op
            upd.counts[(pg, op)] += 1
            upd.nbytes[(pg, op)] += nbytes
        if op in REDUCE_OPS and not is_p2p:
            step = self._step_of(created)
            if step is None:
                upd.unplaced.append((created, pg, dec.numel))
            else:
                by_pg = upd.reduced.get(step)
                if by_pg is None:
                    by_pg = upd.reduced[step] = Counter()
                by_pg[pg] += dec.numel
        kept.append(
            {
                "pg": pg,
                "seq": seq,
                "is_p2p": is_p2p,
                "op": op,
                "input_sizes": dec.sizes,
                "input_dtypes": dec.dtypes,
                "time": created / 1e9,
                "record_id": e.get("record_id"),
            }
        )
        peer = -1
        if is_p2p and (p := p2p_peer(dec.pname)) is not None:
            peer = self.groups.global_rank(name, p)
        item = Op(
            pg,
            op,
            seq,
            nbytes,
            dec.data_bytes,
            created,
            comm_stream_label(pg, dec.backend),
            self.groups.sizes.get(name),
            peer,
        )
        key = (rec, int(e["record_id"]))
        if batch:  # the p2p ops of a batch_isend_irecv: timed by the coalesced entry that ends it
            ops = [self._pending.pop(k) for k in batch if k in self._pending]
            if (dur := duration_s(e)) is not None:
                upd.timed.extend((o, dur) for o in ops)
            elif rec == "nccl" and len(self._pending) < self.max_pending:
                self._batches[key] = ops
                self._pending[key] = item
            return
        if (dur := duration_s(e)) is not None:
            upd.timed.append((item, dur))
        elif (
            rec == "nccl"
            and (e.get("state") != "completed" or nccl_timing)
            and len(self._pending) < self.max_pending
        ):  # the watchdog can mark an entry completed a poll before it retires it with its duration
            self._pending[key] = item
            if is_p2p:  # inside a coalesced batch NCCL records p2p ops without events of their own
                batch_ops = self._open_batch.setdefault(batch_key, [])
                batch_ops.append(key)
                del batch_ops[: -self.max_pending]  # plain isend/irecv never close a batch: bounded

    def _open_p2p(
        self, rec: str, entries: list[dict[str, Any]], now_ns: int
    ) -> list[tuple[str, int, str, float]]:
        """The pending p2p ops of ``rec`` (a coalesced batch's through its entry) whose entry this dump
        (``entries``, by record id) shows not completed, each open for at least now - enqueue. An op
        completed since is no longer pending, or shows completed at the next read: the age it gets is
        what this read saw, never more."""
        out: list[tuple[str, int, str, float]] = []
        for key, item in self._pending.items():
            if key[0] != rec:
                continue
            ops = self._batches.get(key) or ([item] if item.peer >= 0 else [])
            if not ops:
                continue
            i = bisect.bisect_left(entries, key[1], key=lambda e: e["record_id"])
            if (
                i < len(entries)
                and entries[i]["record_id"] == key[1]
                and entries[i].get("state") != "completed"
            ):
                out += [
                    (o.op, o.peer, o.pg, max(0.0, (now_ns - o.start_ns) / 1e9)) for o in ops if o.peer >= 0
                ]
        return out

    def _complete_pending(
        self, rec: str, entries: list[dict[str, Any]], nccl_timing: bool, now_ns: int, upd: Update
    ) -> None:
        live = {int(e["record_id"]): e for e in entries}
        for key in [k for k in self._pending if k[0] == rec]:
            e = live.get(key[1])
            if e is None:  # overwritten before it completed: stays counted, untimed
                del self._pending[key]
                self._batches.pop(key, None)
            elif (dur := duration_s(e)) is not None:
                item = self._pending.pop(key)
                upd.timed.extend((o, dur) for o in self._batches.pop(key, None) or [item])
            elif now_ns - self._pending[key].start_ns > PENDING_TIMEOUT_NS and (
                e.get("is_p2p") or e.get("state") == "completed"
            ):  # completed untimed (timing off), or a p2p entry no coalesced entry ever closed
                del self._pending[key]
                self._batches.pop(key, None)
            elif e.get("state") == "completed" and not nccl_timing:
                del self._pending[key]  # completed without timing (TORCH_NCCL_ENABLE_TIMING off)
                self._batches.pop(key, None)
