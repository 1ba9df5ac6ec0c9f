"""Who a hang waits for: the culprit of a stalled job from each rank's per-group sequence numbers.

Pure functions (no torch, no agent), like ``signals``. Every rank publishes, per process group, the
sequence number of the last collective it enqueued and completed, and the op of the last enqueued one
(``GroupState``, from the flight recorder's ``pg_status``). Sequence numbers count a group's collectives
on each member, so in a program that runs the same collectives on every rank they agree, and at a hang:

- the ranks with an op in flight at seq N of group G wait for the members of G whose last enqueued seq
  is below N: those never entered it;
- following those edges (a rank that is missing from G may itself wait in another group), the ranks
  that others wait for and that wait for nobody are the culprits (``missing``): stuck outside any
  collective (a Python loop, a sleep, I/O, a dead or stopped process);
- when every rank that is waited for is itself waiting, the ranks wait in a cycle: they are in
  different collectives (``desync``: a collective called in a different order, or under a condition,
  on some ranks), and the side that runs a different op from the majority is the culprit;
- when every member entered the same collective and it does not complete, no rank is missing: the
  collective itself is stuck (``stuck``: the transport, NCCL, a link), and the culprit is unknown;
- members that this rank cannot see (beyond its comparison peers) leave the culprit unknown, and a rank
  others wait for that waits in such a collective itself is no culprit (it may wait for one of them).

Ranks also meet point to point (a pipeline's send/recv): a rank that waits in p2p ops (``P2PWait``:
the op, its peer, since when) waits for that peer, an edge like a collective's. Chains form: the last
stage waits for a stage's activations, the earlier stages for their successor's gradients, and the
rank the chain ends at, waiting for nobody (asleep in Python), is the culprit. A chain that leaves the
ranks read (a pipeline of more stages than a rank's comparison peers cover) is followed on demand
(``chain_reads``: the ranks to read next).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GroupState:
    """One rank's view of one process group: last enqueued and completed seq, the op of the last
    enqueued collective ("" unknown) and how long the oldest op in flight has been."""

    enq: int
    done: int
    op: str = ""
    age_s: float = 0.0

    @property
    def in_flight(self) -> bool:
        return self.enq > self.done

    def pack(self) -> list[Any]:
        return [self.enq, self.done, self.op, round(self.age_s, 1)]

    @classmethod
    def unpack(cls, v: Any) -> GroupState | None:
        """From ``pack``'s list; None for anything malformed (a peer's payload never breaks a verdict)."""
        try:
            return cls(int(v[0]), int(v[1]), str(v[2]), float(v[3]))
        except (TypeError, ValueError, IndexError, KeyError):
            return None


@dataclass(frozen=True)
class P2PWait:
    """One rank waiting in p2p ops with one peer: ``op`` (send, recv, or send+recv for a batch), the
    peer's global rank, the group's label, and how long the wait has lasted."""

    op: str
    peer: int
    pg: str = "pp"
    age_s: float = 0.0

    def pack(self) -> list[Any]:
        return [self.op, self.peer, self.pg, round(self.age_s, 1)]

    @classmethod
    def unpack(cls, v: Any) -> P2PWait | None:
        """From ``pack``'s list; None for anything malformed."""
        try:
            return cls(str(v[0]), int(v[1]), str(v[2]), float(v[3]))
        except (TypeError, ValueError, IndexError, KeyError):
            return None


def p2p_waits(ops: Sequence[tuple[str, int, str]], age_s: float) -> list[P2PWait]:
    """The (op, peer, pg) a rank waits in, one ``P2PWait`` per peer (a batch's send and recv joined)."""
    by: dict[tuple[int, str], set[str]] = {}
    for op, peer, pg in ops:
        if peer >= 0:
            by.setdefault((peer, pg), set()).add(op)
    return [P2PWait("+".join(sorted(o)), peer, pg, age_s) for (peer, pg), o in sorted(by.items())]


def chain_reads(
    p2p: Mapping[int, Sequence[P2PWait]],
    known: Collection[int],
    min_wait_s: float,
    world: int,
    width: int,
    limit: int,
) -> list[int]:
    """The ranks to read next to follow the chains of p2p waits that leave ``known``: each unknown peer
    a wait of ``min_wait_s`` or more points at, then up to ``width - 1`` ranks on from it at the same
    step (a pipeline's chain goes on stage after stage the same way, so one read covers ``width`` hops),
    stopping at a known rank or the world's end; the peers first, at most ``limit`` ranks in all."""
    first: list[int] = []
    more: list[int] = []
    for r, ws in sorted(p2p.items()):
        for w in ws:
            if w.age_s < min_wait_s or w.peer in known or w.peer == r or not 0 <= w.peer < world:
                continue
            first.append(w.peer)
            step = w.peer - r
            for i in range(1, width):
                q = w.peer + i * step
                if not 0 <= q < world or q in known:
                    break
                more.append(q)
    return list(dict.fromkeys([*first, *more]))[:limit]


@dataclass
class HangVerdict:
    """``kind``: missing | desync | stuck | none | unknown. ``waits``: each (group, seq) some ranks wait
    in, with the ranks waiting and the ranks not in it; ``sides``: for a desync, op -> ranks in it."""

    kind: str
    culprits: list[int] = field(default_factory=list)
    victims: list[int] = field(default_factory=list)
    waits: list[dict[str, Any]] = field(default_factory=list)
    sides: dict[str, list[int]] = field(default_factory=dict)
    note: str = ""

    def details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "culprits": self.culprits, "victims": self.victims}
        if self.waits:
            out["waits"] = self.waits[:8]
        if self.sides:
            out["sides"] = self.sides
        if self.note:
            out["note"] = self.note
        return out


def analyse(
    states: Mapping[int, Mapping[str, GroupState]],
    members: Mapping[str, Sequence[int]],
    complete: Mapping[str, bool] | None = None,
    min_wait_s: float = 1.0,
    p2p: Mapping[int, Sequence[P2PWait]] | None = None,
    seen: Collection[int] | None = None,
) -> HangVerdict:
    """The culprit(s) of a hang among the ranks in ``states`` (rank -> group id -> state).

    ``members``: group id -> the ranks in ``states`` that belong to it (a member with no state for it
    has enqueued none of its collectives); ``complete``: group id -> whether every member of the group
    is among them (else a culprit may be beyond view). Ops in flight for less than ``min_wait_s`` are
    not waits (a healthy collective completes in ms). ``p2p``: rank -> the p2p ops it waits in, each
    an edge to its peer; ``seen``: the ranks whose state is known (a peer outside it may wait itself:
    beyond view)."""
    waits_for: dict[int, set[int]] = {}
    waits: dict[tuple[Any, ...], dict[str, Any]] = {}
    beyond = False
    outside: dict[int, str] = {}  # rank -> a group it waits in for members beyond the ranks in view
    for r, ws in (p2p or {}).items():
        for pw in ws:
            if pw.age_s < min_wait_s or pw.peer == r or pw.peer < 0:
                continue
            waits_for.setdefault(r, set()).add(pw.peer)
            w = waits.setdefault(
                (pw.pg, "p2p", pw.op, pw.peer),
                {"pg": pw.pg, "op": pw.op, "peer": pw.peer, "p2p": True, "waiting": [], "missing": [pw.peer]},
            )
            w["waiting"].append(r)
    for r, groups in states.items():
        for uid, st in groups.items():
            if not st.in_flight or st.age_s < min_wait_s:
                continue
            missing = [m for m in members.get(uid, ()) if m != r and _enq(states, m, uid) < st.enq]
            waits_for.setdefault(r, set()).update(missing)
            if (
                not missing
                and not (complete or {}).get(uid, True)
                and all(_enq(states, m, uid) <= st.enq for m in members.get(uid, ()))
            ):
                outside[r] = uid  # none in view is behind, none past it: it waits for one beyond
            w = waits.setdefault(
                (uid, st.enq), {"pg": uid, "seq": st.enq, "op": st.op, "waiting": [], "missing": []}
            )
            w["waiting"].append(r)
            w["missing"] = sorted(set(w["missing"]) | set(missing))
            beyond = beyond or not (complete or {}).get(uid, True)
    if not waits_for:
        return HangVerdict(
            "none", note="no collective or p2p op has been in flight for long on the ranks compared"
        )
    waiting = set(waits_for)  # in flight: in a collective, for someone or (all of its group in) for nothing
    held = {r for r, b in waits_for.items() if b}  # waiting for a member that is behind
    blockers = set().union(*waits_for.values())
    listed = sorted(
        waits.values(), key=lambda w: (-len(w["waiting"]), bool(w.get("p2p")), w["pg"], w.get("seq", -1))
    )
    for w in listed:
        w["waiting"].sort()
    roots = sorted(blockers - held)  # what the others wait for and that waits for nobody behind it
    unseen = [r for r in roots if seen is not None and r not in seen]  # a p2p peer never heard of
    away = [r for r in roots if r in outside]  # in a collective whose missing members are out of view
    if unseen or away:
        roots = [r for r in roots if r not in unseen and r not in away]
        if not roots:
            why = [f"the chain of waits leaves the ranks read at {unseen[:8]}"] if unseen else []
            why += [
                f"rank {r} waits in {outside[r].split('@', 1)[0]} for members beyond the ranks read"
                for r in away[:4]
            ]
            return HangVerdict("unknown", [], sorted(waiting), listed, note="; ".join(why))
    if roots:
        victims = sorted(r for r in held if _reaches(r, set(roots), waits_for))
        # the waits for someone; an op every member entered (a culprit's own, its completion not yet
        # recorded) explains nothing here
        return HangVerdict("missing", roots, victims, [w for w in listed if w["missing"]])
    if blockers:  # every rank waited for waits too: a cycle of ranks in different collectives
        return _desync(states, members, sorted(blockers | held), listed, p2p=p2p)
    # every member of each group with a long wait has entered it: ops differ, or the collective is stuck
    for w in listed:
        if w.get("p2p"):
            continue
        ops = {r: states[r][w["pg"]].op for r in members.get(w["pg"], ()) if w["pg"] in states.get(r, {})}
        if len(set(ops.values())) > 1:
            return _desync(states, members, sorted(ops), listed, group=w["pg"])
    note = (
        (
            "the ranks not in it are beyond this rank's comparison peers (the HparHangCulprit rule compares "
            "every rank)"
        )
        if beyond
        else "every member entered it: the collective itself does not complete"
    )
    return HangVerdict("unknown" if beyond else "stuck", [], sorted(waiting), listed, note=note)


def _p2p_text(op: str, peer: int) -> str:
    """``recv from rank 2``, ``send to rank 3``, ``send+recv with rank 1``."""
    word = {"recv": "from", "send": "to"}.get(op, "with")
    return f"{op} {word} rank {peer}"


def p2p_text(w: Mapping[str, Any]) -> str:
    """A p2p wait of ``HangVerdict.waits`` in words (``recv from rank 2``)."""
    return _p2p_text(str(w.get("op", "")), int(w.get("peer", -1)))


def _enq(states: Mapping[int, Mapping[str, GroupState]], rank: int, uid: str) -> int:
    st = states.get(rank, {}).get(uid)
    return st.enq if st is not None else -1


def _reaches(r: int, targets: set[int], edges: Mapping[int, set[int]]) -> bool:
    """Whether ``r`` waits, directly or through others, for one of ``targets``."""
    seen, todo = {r}, [r]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt in targets:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def _desync(
    states: Mapping[int, Mapping[str, GroupState]],
    members: Mapping[str, Sequence[int]],
    ranks: list[int],
    waits: list[dict[str, Any]],
    group: str = "",
    p2p: Mapping[int, Sequence[P2PWait]] | None = None,
) -> HangVerdict:
    """Ranks in different collectives, each side named by the op it is in (``pg: op``). The culprits are
    the ranks that are a strict minority of some group by the seq they reached, or by the op they run at
    one seq (one rank in a barrier the others never reach; a tp reduce only tp rank 0 runs); unknown
    when no group has one (two ranks that disagree 1-1)."""
    side_of: dict[int, str] = {}
    for r in ranks:
        inflight = [
            (uid, st) for uid, st in states.get(r, {}).items() if st.in_flight and (not group or uid == group)
        ]
        uid, st = max(inflight, key=lambda x: x[1].age_s, default=("", GroupState(-1, -1)))
        pw = max((p2p or {}).get(r, ()), key=lambda w: w.age_s, default=None)
        side_of[r] = (
            f"{uid.split('@', 1)[0]}: {st.op or '?'}"
            if uid
            else f"{pw.pg}: {_p2p_text(pw.op, pw.peer)}"
            if pw is not None
            else "not in a collective"
        )
    sides: dict[str, list[int]] = {}
    for r, side in sorted(side_of.items()):
        sides.setdefault(side, []).append(r)
    odd: set[int] = set()
    for uid, ranks_of in members.items():
        if group and uid != group:
            continue
        by: dict[Any, list[int]] = {}
        for r in ranks_of:
            got = states.get(r, {}).get(uid)
            key = (got.enq, got.op) if group and got is not None else _enq(states, r, uid)
            by.setdefault(key, []).append(r)
        if len(by) > 1:
            counts = sorted(len(v) for v in by.values())
            if counts[-1] > counts[-2]:
                odd.update(r for v in by.values() if len(v) < counts[-1] for r in v)
    culprits = sorted(odd & set(ranks))
    note = (
        ""
        if culprits
        else "no group has a minority that entered a different collective: the culprit is unknown"
    )
    return HangVerdict("desync", culprits, sorted(set(ranks) - set(culprits)), waits, sides, note=note)
