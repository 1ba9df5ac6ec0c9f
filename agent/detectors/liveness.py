"""Detectors of a job that stopped moving: Hang (and whom it waits for), RankGone (a rank that is no more).

Both read the last ``s`` payload of every comparison peer however old it is (``PeerView.seen``): a
stopped or dead rank's last word is where it stopped.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from statistics import median
from typing import TYPE_CHECKING, Any

from hpar_agent import endings, rankstate
from hpar_agent.context import Conclusion
from hpar_agent.crossrank import WHOLE_GROUP
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors import waits
from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot
    from hpar_agent.topology import Topology


#: Where a chain of p2p waits leaves the ranks read, Hang reads the ranks it goes through on demand: at
#: most this many reads of the store a pass, each of at most ``CHAIN_RANKS`` ranks' ``s`` (~0.4 KB
#: each), the peer a wait points at and up to ``CHAIN_WIDTH - 1`` ranks on at the same step.
CHAIN_READS = 4
CHAIN_RANKS = 64
CHAIN_WIDTH = 8


class Hang(Detector):
    """A rank stuck in or missing a collective or a p2p op: an op in flight, or no step, for too long.

    An explicit ``Hang.timeout_s`` is used as is. Value: the longer of (seconds since the last step,
    oldest in-flight age). The agent thread keeps evaluating while training is blocked in C++.

    Culprits (``waits.analyse``): every rank publishes, per process group, its last enqueued and
    completed collective and the op in flight (``q`` in ``s``). From this rank's and its comparison
    peers' (the last word of a stopped or dead one included; a peer never heard of has entered none of
    its groups' collectives), the ranks the others wait for and that
    wait for nobody are named (``details.culprits``; ``victims``: the ranks waiting); each rank's p2p
    waits (``w`` in ``s``: the pipeline's send/recv it blocks in, and the peer) are edges too, so the
    end of a pipeline's chain of waits is named (where the chain leaves the ranks read, as in a
    pipeline of more stages than a rank's comparison peers cover, the ranks it goes through are read
    on demand: ``_follow``); or ranks in
    different collectives (``kind`` desync, each side's op), or a collective every member entered
    (``stuck``: culprit unknown). Judged from half the timeout on, so the firing event carries them;
    once named, kept until the hang clears: peers ending at the process group's timeout, after it fired,
    are its consequence.
    """

    name = "Hang"
    gpu_culprits = True
    threshold_param = "timeout_s"
    evidence = ("pyspy", "fr")
    cross_rank = True

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.explicit = f"{self.name}.timeout_s" in (thresholds or {})
        self.named: waits.HangVerdict | None = (
            None  # the verdict that named culprits, kept while the hang lasts
        )
        self.chain: dict[int, Mapping[str, Any]] = {}  # ranks read on demand that wait (``_follow``)

    def timeout(self, snap: Snapshot) -> float:
        if self.explicit:
            return self.p("timeout_s")
        durations = snap.step_durations[-64:]
        pg_timeout = snap.collectives.pg_timeout_s
        return sig.hang_timeout(self.p("timeout_s"), pg_timeout, median(durations) if durations else None)

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        states, p2p = snap.collectives.groups, snap.collectives.p2p_waits
        out: dict[str, Any] = {}
        if states:
            out["q"] = {uid: st.pack() for uid, st in states.items()}
        if p2p:
            out["w"] = [w.pack() for w in p2p]
        return {"s": out} if out else {}

    def conclusion(self, active: bool, value: float) -> Conclusion | None:
        """While this rank's Hang is active (the goodput ledger counts the time as ``hang``)."""
        return Conclusion(True, None, float(value)) if active else None

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        # no step is no progress only while the training thread neither works between steps (an
        # evaluation) nor compiles: ``StepCollector.last_progress_ts``
        last = max(snap.last_step_ts, snap.last_progress_ts)
        stalled = sig.stalled_seconds(snap.now, last, snap.steps_done, int(self.p("warmup_steps")))
        behind = sig.steps_behind(snap.exchange.peers, snap.rank, snap.steps_done)
        if behind >= sig.IDLE_STEPS:  # idle, not hung: its peers step on without it (DDP's Join)
            stalled = 0.0
        inflight = snap.collectives.oldest_inflight
        pg, age = max(inflight.items(), key=lambda kv: kv[1], default=("", 0.0))
        timeout = self.timeout(snap)
        value = max(stalled, age)
        details: dict[str, Any] = {
            "no_step_s": stalled,
            **({"peers_ahead_steps": behind} if behind >= sig.IDLE_STEPS else {}),
            "oldest_inflight_s": age,
            **({"thread_cpu_share": round(share, 4)} if (share := snap.thread_cpu_share) is not None else {}),
            "pg": pg,
            "timeout_s": timeout,
        }
        if value <= timeout / 2:
            self.named = None
            self.chain = {}
        else:
            verdict = self.named or self.culprits(snap, min_wait_s=min(timeout / 4, 10.0))
            if verdict.culprits and value > timeout:
                self.named = (
                    verdict  # what held when it fired: the ranks ending after it (timeouts) change nothing
                )
            details.update(verdict.details())
            details["role"] = (
                "culprit"
                if snap.rank in verdict.culprits
                else "victim"
                if snap.rank in verdict.victims
                else ""
            )
        return Verdict(value > timeout, value, details, threshold=timeout)

    def culprits(self, snap: Snapshot, min_wait_s: float) -> waits.HangVerdict:
        """``waits.analyse`` over this rank (its state now), the last word of each comparison peer, and
        the ranks read on demand where a chain of p2p waits leaves those (``_follow``)."""
        topo, rank = snap.topology, snap.rank
        states: dict[int, dict[str, waits.GroupState]] = {}
        p2p: dict[int, list[waits.P2PWait]] = {}
        coords: dict[int, dict[str, Any]] = {}
        for r, p in snap.exchange.seen.items():
            if r != rank:
                _take(r, p, states, p2p, coords)
        states[rank] = dict(snap.collectives.groups)
        p2p[rank] = list(snap.collectives.p2p_waits)
        coords[rank] = dict(snap.coords)
        silent = {dim: [r for r in peers if r not in coords] for dim, peers in snap.exchange.groups.items()}
        unfollowed = self._follow(
            snap, min_wait_s, states, p2p, coords, {r for rs in silent.values() for r in rs}
        )
        members: dict[str, list[int]] = {}
        complete: dict[str, bool] = {}
        by_key: dict[str, dict[str, list[int]]] = {}  # label -> group id -> the ranks of those coordinates
        for uid in sorted({u for groups in states.values() for u in groups}):
            label = src.pg_label(uid)
            if src.group_key_of(label, coords[rank]) != label:  # a mesh group: members by coordinates
                if label not in by_key:
                    by_key[label] = {}
                    for r, c in coords.items():
                        by_key[label].setdefault(src.group_key_of(label, c), []).append(r)
                ms = list(by_key[label].get(uid, ()))
                if uid == src.group_key_of(label, coords[rank]):  # this rank's own: peers never heard of too
                    ms += silent.get(label, [])
            elif label == "default_pg":  # the world: every rank heard of, and every peer never heard of
                ms = [*coords, *(r for rs in silent.values() for r in rs)]
                ms += range(topo.world_size) if topo.world_size <= WHOLE_GROUP else []
            else:  # a group of the user's own: those that entered it
                ms = [r for r in coords if uid in states[r]]
            members[uid] = sorted(set(ms))
            size = _group_size(label, topo)
            complete[uid] = len(ms) >= size if size else len(coords) >= topo.world_size
        seen = set(coords) | {r for rs in silent.values() for r in rs}
        verdict = waits.analyse(states, members, complete, min_wait_s, p2p=p2p, seen=seen)
        if verdict.kind == "unknown" and unfollowed:
            verdict.note += f" (read on demand: {CHAIN_READS} reads this pass, the next goes on)"
        return verdict

    def _follow(
        self,
        snap: Snapshot,
        min_wait_s: float,
        states: dict[int, dict[str, waits.GroupState]],
        p2p: dict[int, list[waits.P2PWait]],
        coords: dict[int, dict[str, Any]],
        silent: set[int],
    ) -> bool:
        """Add the ranks a chain of p2p waits goes through beyond the ranks read (a pipeline of more
        stages than the comparison peers cover): their ``s`` read on demand, ``CHAIN_READS`` reads of
        at most ``CHAIN_RANKS`` ranks a pass (``waits.chain_reads``). A rank that waits is kept while
        the hang lasts (``chain``: it stays where it is stuck), so a longer chain is followed on over
        the next passes; the others (a culprit among them) are read again each pass. True when the
        reads ran out with ranks still to read."""
        for r, p in self.chain.items():
            if r not in coords:
                _take(r, p, states, p2p, coords)
        asked: set[int] = set()
        for _ in range(CHAIN_READS):
            known = set(coords) | silent | asked
            want = waits.chain_reads(
                p2p, known, min_wait_s, snap.topology.world_size, CHAIN_WIDTH, CHAIN_RANKS
            )
            if not want:
                return False
            asked.update(want)
            for r, p in snap.exchange.fetch("s", want).items():
                if (
                    r != snap.rank
                    and _take(r, p, states, p2p, coords)
                    and any(w.age_s >= min_wait_s for w in p2p[r])
                ):
                    self.chain[r] = p
        known = set(coords) | silent | asked
        return bool(waits.chain_reads(p2p, known, min_wait_s, snap.topology.world_size, 1, 1))


def _take(
    r: int,
    p: Mapping[str, Any],
    states: dict[int, dict[str, waits.GroupState]],
    p2p: dict[int, list[waits.P2PWait]],
    coords: dict[int, dict[str, Any]],
) -> bool:
    """Add a peer's ``s`` (its groups' states, its p2p waits, its coordinates); False for a malformed one."""
    q, c, w = p.get("q") or {}, p.get("c"), p.get("w") or []
    if not isinstance(q, dict) or not isinstance(c, dict) or not isinstance(w, list):
        return False
    states[r] = {str(uid): st for uid, v in q.items() if (st := waits.GroupState.unpack(v)) is not None}
    p2p[r] = [pw for v in w if (pw := waits.P2PWait.unpack(v)) is not None]
    coords[r] = c
    return True


def _group_size(label: str, topo: Topology) -> int | None:
    """Members of a group of this label, where the topology says (None: a group of the user's own)."""
    return {"default_pg": topo.world_size, "dp": topo.dp, "tp": topo.tp, "pp": topo.pp}.get(label.lower())


#: Seconds a live peer's publish may come after the cadence's time (a late pass: a pass starts at most
#: an agent interval late, the next tick, so the agent's interval where longer), on top of an exchange
#: it missed: a peer is named only once a read made ``2 x interval + LATE_S`` after its last payload
#: shows nothing newer (``RankGone.bound``).
LATE_S = 1.0


class RankGone(Detector):
    """A comparison peer that stopped publishing and whose process is gone, stopped, or out of sight.

    Every rank publishes its payload at each exchange (3 s; longer past 1,024 ranks) and says goodbye
    when it detaches (``bye``: a clean end, or how it ended: an uncaught exception, a signal). A peer is
    named (``details.culprits``) once a read of the store made more than ``bound`` seconds after its last
    payload (two exchange intervals and a late pass, or ``silent_s`` if longer) still shows nothing newer,
    and it never said goodbye cleanly: this rank's last read of its comparison peers where that read came
    so late, else a read of that peer's ``s`` alone, made at the first pass whose clock (``PeerView.clock``,
    after the pass's waits) is past the bound (``_silent``; once, kept until a newer payload). A live peer
    that missed one exchange and was a late pass on the next is never named: that is the floor, as a peer
    on another host that died right after a publish cannot be told from it sooner. A dead one is named
    within a pass of the bound by every rank that reads it, at once (no confirming pass: the bound is
    the margin), whatever the cadence's offsets (where a rank's read of an exchange comes up to two
    phases after a peer's publish: 15.5 s at 8,192 ranks) and on this host or another alike. Reported
    with how far it got (its last step) and what its process is where this rank can see it
    (``rankstate.proc_state``: on the same host ``gone``, ``zombie``, ``stopped``; a process that still
    runs only has a late agent thread and is not named; on another host the process is unknown). A peer
    that said goodbye ending otherwise than cleanly is named at the second pass that sees it (``ended``:
    a job that fails everywhere at once, as gloo's does, ends this rank within it). A peer whose ending
    is a consequence of the incident (its collective or p2p op timed out, its peer closed the
    connection, the launcher terminated it after another peer went: ``endings``) is a victim
    (``details.victims``), never named: RankGone fires only for a peer that went on its own. Judged only
    while this rank's own reads of the store succeed: a store that went away (its host exited first)
    says nothing of the peers. Value: peers named. Raised on the ranks
    that see it, never on the rank that is gone.
    """

    name = "RankGone"
    gpu_culprits = True
    threshold_param = "silent_s"
    cross_rank = True

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        pid = os.getpid()
        self.me = [pid, socket.gethostname(), rankstate.start_ticks(pid) or 0]
        self.heard: dict[int, dict[str, Any]] = {}  # peer -> its ``s`` re-read, newer than the last read's
        self.absent: dict[
            int, float
        ] = {}  # peer -> its last payload's time, a re-read past the bound found last
        self.ended: dict[int, float] = {}  # peer -> the time of its goodbye, seen ended at an earlier pass

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        return {"s": {"id": self.me}}

    def bound(self, snap: Snapshot) -> float:
        """Seconds of silence past which a peer is judged: a live peer's payload is at most an exchange
        interval old, two when it missed one exchange, a late pass more (``LATE_S``, or the agent's
        interval where longer) when it was late on the next."""
        ex = snap.exchange
        return max(self.p("silent_s"), 2 * ex.interval_s + max(LATE_S, ex.pass_s))

    def _silent(self, snap: Snapshot, rank: int, payload: Mapping[str, Any], bound: float) -> bool:
        """Whether a read of the store made over ``bound`` seconds after ``payload``'s publish shows nothing
        of the peer newer: the last read of the peers where it came that late, else the peer's ``s`` read
        now where the clock is past the bound (a newer one goes to ``heard``; a read that failed says
        nothing). The clock, not the pass's start: a pass waits up to half the agent's interval for its
        offsets, and judging from its start would name a dead peer up to that much later."""
        ex = snap.exchange
        t = float(payload.get("t", snap.now))
        if ex.read_ok_at - t > bound or self.absent.get(rank) == t:
            return True
        if ex.clock() - t <= bound:
            return False
        got = ex.fetch("s", [rank]).get(rank)
        if got is None:
            return False  # the store did not answer: the next pass asks again
        if float(got.get("t", 0.0)) > t:
            self.heard[rank] = got
            return False
        self.absent[rank] = t
        return True

    def _last_word(self, rank: int, seen: Mapping[str, Any]) -> Mapping[str, Any]:
        """The peer's newest payload: the last read's, or a newer one re-read (``heard``)."""
        heard = self.heard.get(rank)
        if heard is None or float(heard.get("t", 0.0)) <= float(seen.get("t", 0.0)):
            self.heard.pop(rank, None)
            return seen
        return heard

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        ex = snap.exchange
        limit = max(self.p("silent_s"), 2 * ex.interval_s)
        if not ex.seen or snap.now - ex.read_ok_at > limit / 2 or snap.stopping:
            return None  # no recent read of the store, or this rank ends too: nothing more to say
        bound = self.bound(snap)
        gone: dict[str, dict[str, Any]] = {}
        held: set[int] = set()  # ended, first seen so in this pass
        for r, seen in ex.seen.items():
            if r == snap.rank:
                continue
            p = self._last_word(r, seen)
            if self.absent.get(r, p.get("t")) != p.get("t"):
                del self.absent[r]  # a newer payload since the re-read
            bye = str(p.get("bye") or "")
            if bye == "exit" or (not bye and not self._silent(snap, r, p, bound)):
                continue
            pid, host, ticks = [*(p.get("id") or []), 0, "", 0][:3]
            proc = rankstate.proc_state(int(pid or 0), int(ticks) or None, str(host)) if not bye else ""
            if proc == "running":
                continue  # its process runs: its agent thread is late, the rank is not gone
            t = float(p.get("t", 0.0))
            if bye and self.ended.get(r) != t:
                self.ended[r] = t
                held.add(r)
            gone[str(r)] = {
                "silent_s": round(ex.clock() - float(p.get("t", snap.now)), 1),  # as judged
                "last_step": p.get("step"),
                "host": host,
                "process": proc or ("ended" if bye else "unknown (another host)"),
                "ended": bye,
            }
        culprits, victims = _causes(gone)
        culprits = [r for r in culprits if r not in held]
        details: dict[str, Any] = {"culprits": culprits, "ranks": gone}
        if victims:
            details["victims"] = victims
        return Verdict(bool(culprits), float(len(culprits)), details, threshold=0.0)  # any peer named


def _causes(gone: dict[str, dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(culprits, victims) among the gone peers: a peer whose ending is a consequence of the incident
    (a communication timeout, a connection its peer closed, an abort; the launcher's SIGTERM once
    another peer went first) is a victim, never a culprit (``endings``)."""
    comm = {r for r, g in gone.items() if endings.communication_failure(str(g.get("ended") or ""))}
    signalled = {r for r, g in gone.items() if endings.launcher_signal(str(g.get("ended") or ""))}
    if signalled and len(signalled) < len(gone):  # terminated by the launcher after another went
        comm |= signalled
    return sorted(int(r) for r in gone if r not in comm), sorted(int(r) for r in comm)
