"""Many ranks' cross-rank detectors on synthetic inputs, in one process, without a store or agents.

Each simulated rank holds what its collectors would (flight-recorder entries, per-group sequence numbers,
a graph fingerprint, parameter checksums, whether it still publishes); every rank is then judged by the
real detector classes on the payloads of its real comparison peers (``crossrank.plan``), as the
detectors component would have read them from the store, in a snapshot built by the component's own
feed from the rank's collectors. What the simulation leaves out is the store itself and the exchange's
timing (``benchmarks/store_load.py`` measures those).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpar_agent.collectors.collective_state import PgState
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.fr_ledger import Op
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.config import AgentConfig
from hpar_agent.context import AgentContext
from hpar_agent.crossrank import Grid, PeerPlan, plan
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import Detector, Verdict
from hpar_agent.detectors.feed import DetectorFeed
from hpar_agent.detectors.snapshot import Fetch, PeerView, Snapshot
from hpar_agent.detectors.waits import GroupState, P2PWait
from hpar_agent.topology import Topology

STEP_NS = 300_000_000  # 0.3 s steps
STEPS = 40  # steps in every rank's flight-recorder window
T0_NS = 1_796_000_000_000_000_000


@dataclass
class SimRank:
    """One rank's state, as its collectors would hold it."""

    rank: int
    coords: dict[str, int]
    late_ns: int = 0  # how late it arrives at every collective (its extra compute per step)
    fingerprint: int = 1
    checksum: float = 1.0  # every parameter's sample sum: replicas in sync hold the same
    skipped: int | None = None  # the dp collective seq it never entered (the others wait in it)
    silent_s: float = 0.0  # seconds since its last publish (0: publishing)
    groups: dict[str, GroupState] = field(default_factory=dict)
    p2p: list[P2PWait] = field(default_factory=list)  # the pipeline's send/recv it blocks in


def job(dims: list[tuple[str, int]]) -> tuple[Grid, list[SimRank]]:
    """The ranks of a job laid out over ``dims`` (outermost first), coordinates as a Topology gives them."""
    grid = Grid.row_major(dims)
    ranks = []
    for r in grid.ranks:
        pos, c = r, {}
        for name, size in reversed(dims):
            pos, c[name] = divmod(pos, size)
        coords = {
            "dp_replicate": c.get("dp", 0),
            "dp_shard": 0,
            "cp": 0,
            "tp": c.get("tp", 0),
            "pp": c.get("pp", 0),
        }
        ranks.append(SimRank(r, coords))
    return grid, ranks


def _timelines(ranks: list[SimRank], dims: Mapping[str, int]) -> dict[int, list[sig.FrEntry]]:
    """Every rank's last collectives on one consistent timeline: per step each tp group runs 4 tp
    all-reduces (with tp), each starting when the last member arrived at the one before (its members wait
    for each other), then every rank enters its dp all-reduce; the next step starts when the last of
    them arrived. A rank's ``late_ns`` is extra compute before its first collective of a step; a few µs
    of jitter of its own on every arrival."""
    tp = dims.get("tp", 1)
    out: dict[int, list[sig.FrEntry]] = {r.rank: [] for r in ranks}
    by_group: dict[int, list[SimRank]] = {}
    for r in ranks:
        by_group.setdefault(r.rank // tp, []).append(r)
    dp_uid = {r.rank: src.group_key_of("dp", r.coords) for r in ranks}
    tp_uid = {r.rank: src.group_key_of("tp", r.coords) for r in ranks}
    start = T0_NS
    for step in range(1, STEPS + 1):
        arrive_dp: dict[int, int] = {}
        for members in by_group.values():
            cursor = start
            for j in range(4 if tp > 1 else 0):
                at = {
                    r.rank: cursor + 2_000_000 + (r.late_ns if j == 0 else 0) + _jitter(r.rank, step, j)
                    for r in members
                }
                for r in members:
                    out[r.rank].append(
                        (tp_uid[r.rank], step * 4 + j, "all_reduce", "[[1024]]", "Float", at[r.rank])
                    )
                cursor = max(at.values())
            for r in members:
                arrive_dp[r.rank] = (
                    cursor + 2_000_000 + (r.late_ns if tp == 1 else 0) + _jitter(r.rank, step, 9)
                )
        for r in ranks:
            if r.skipped is None or step < r.skipped:
                out[r.rank].append(
                    (dp_uid[r.rank], step, "all_reduce", "[[1024]]", "Float", arrive_dp[r.rank])
                )
        start = max(arrive_dp.values()) + STEP_NS
    return out


def _jitter(rank: int, step: int, op: int) -> int:
    return (rank * 7919 + step * 104729 + op * 1299709) % 200_000


def _states(r: SimRank, entries: list[sig.FrEntry], now: float) -> dict[str, GroupState]:
    """Its per-group sequence numbers: the last entry of each group completed, but where it is a
    skipped collective's waiter (an op past the last anyone completed, in flight for a minute)."""
    if r.groups:
        return r.groups
    out: dict[str, GroupState] = {}
    for uid, seq, op, *_ in entries:
        out[uid] = GroupState(seq, seq, op, 0.0)
    return out


def snapshot(
    ctx: AgentContext,
    now: float,
    peers: dict[int, dict[str, Any]],
    seen: dict[int, dict[str, Any]],
    groups: Mapping[str, tuple[int, ...]],
    fetch: Fetch,
) -> Snapshot:
    """What ``Detector.evaluate`` reads for one simulated rank, built as the detectors component builds
    it: the feed reads the rank's collectors, then the exchange's view of a read made at ``now``."""
    feed = DetectorFeed()
    local = feed.snapshot(ctx, now)
    view = PeerView(
        peers=peers, fresh=True, seen=seen, groups=groups, read_ok_at=now, interval_s=3.0, fetch=fetch
    )
    return feed.complete(ctx, local, view)


def judge(
    detector: type[Detector],
    grid: Grid,
    ranks: list[SimRank],
    stalled_s: float = 0.0,
    fetched: dict[int, list[list[int]]] | None = None,
    passes: int = 1,
    **thresholds: float,
) -> dict[int, Verdict]:
    """rank -> the verdict of its last of ``passes`` passes of a fresh ``detector`` on the payloads of
    its comparison peers (every rank's last step ``stalled_s`` ago). ``fetched``, where given, gets each
    rank's reads on demand (``PeerView.fetch``: the ranks of each)."""
    now = time.time()
    dims = dict(zip(grid.names, grid.shape, strict=True))
    entries = _timelines(ranks, dims)
    ckeys: dict[str, str] = {}
    payloads: dict[int, dict[str, Any]] = {}
    checksums: dict[int, dict[str, Any]] = {}
    for r in ranks:
        sums = {f"w{i}": [r.checksum * (i + 1), r.checksum * (i + 1)] for i in range(4)}
        checksums[r.rank] = {"cks": {str(STEPS): sums}, "sk": ckeys}
        payloads[r.rank] = {
            "t": now - r.silent_s,
            "c": {**r.coords, "dp": r.coords["dp_replicate"], "stage": r.coords["pp"]},
            "step": STEPS,
            "fp": r.fingerprint,
            "cd": {str(STEPS): sig.checksum_digests(sums, ckeys)},
            "fr": entries[r.rank],
            "q": {uid: st.pack() for uid, st in _states(r, entries[r.rank], now).items()},
            "id": [0, "another-host", 0],
        }
        if r.p2p:
            payloads[r.rank]["w"] = [w.pack() for w in r.p2p]

    out = {}
    for r in ranks:
        reads = (fetched if fetched is not None else {}).setdefault(r.rank, [])

        def fetch(
            purpose: str, wanted: Iterable[int], reads: list[list[int]] = reads
        ) -> dict[int, dict[str, Any]]:
            got = {"ck": checksums, "s": payloads}.get(purpose, {})
            wanted = sorted(set(wanted))
            reads.append(wanted)
            return {q: got[q] for q in wanted if q in got}

        p: PeerPlan = plan(grid, r.rank)
        seen = {q: payloads[q] for q in (*p.wants().get("s", ()), r.rank)}
        fresh = {q: v for q, v in seen.items() if v["t"] >= now - 30}
        topo = Topology(
            rank=r.rank,
            world_size=len(ranks),
            job_id="sim",
            dp=dims.get("dp", 1),
            tp=dims.get("tp", 1),
            pp=dims.get("pp", 1),
            dp_rank=r.coords["dp_replicate"],
            dp_replicate=dims.get("dp", 1),
            tp_rank=r.coords["tp"],
            pp_rank=r.coords["pp"],
            pp_stage=r.coords["pp"],
        )
        collector = CollectiveCollector()  # never installed: it holds what the test gives it
        for uid, st in _states(r, entries[r.rank], now).items():
            label = src.pg_label(uid)
            collector.pgs[label] = PgState(last_enqueued=st.enq, last_completed=st.done, oldest_age=st.age_s)
            collector.recent_entries.append({"pg": label, "seq": st.enq, "op": st.op, "is_p2p": False})
        if r.p2p:
            t_enter = time.time_ns() - int(min(w.age_s for w in r.p2p) * 1e9)
            ops = [Op(w.pg, o, 0, 0, 0, t_enter, "cpu", None, w.peer) for w in r.p2p for o in w.op.split("+")]
            collector.p2p.waiting = (t_enter, ops)
        steps = StepCollector()  # as it stands after STEPS steps of STEP_NS, the last ``stalled_s`` ago
        steps.total, steps.last_step_ts, steps.durations = STEPS, now - stalled_s, [STEP_NS / 1e9] * 64
        ctx = AgentContext(config=AgentConfig(), topology=topo, components=[steps, collector])
        snap = snapshot(ctx, now, fresh, seen, p.groups, fetch)
        judging = detector({f"{detector.name}.{k}": v for k, v in thresholds.items()})
        for _ in range(passes):
            verdict = judging.evaluate(snap)
        if verdict is not None:
            out[r.rank] = verdict
    return out


def raised(verdicts: Mapping[int, Verdict]) -> set[int]:
    """The ranks whose own verdict is active (the alert would fire there)."""
    return {r for r, v in verdicts.items() if v.active}


def named(verdicts: Mapping[int, Verdict]) -> set[int]:
    """Every rank some active verdict names as a culprit."""
    return {c for v in verdicts.values() if v.active for c in v.details.get("culprits") or ()}


def diverge(detector: type, ranks: list[SimRank], wrong: set[int]) -> None:
    """Make ``wrong`` ranks disagree with the rest for ``detector``: another parameter checksum
    (ReplicaDivergence) or another compiled-graph fingerprint (CompileDivergence)."""
    from hpar_agent.detectors.cluster import ReplicaDivergence

    for r in wrong:
        if detector is ReplicaDivergence:
            ranks[r].checksum = 2.0
        else:
            ranks[r].fingerprint = 2


def silence_named(
    n: int,
    subject: int,
    publishes: Callable[[int], float | None],
    exchanges: int,
    ident: tuple[int, str, int] = (0, "another-host", 0),
    skew: float = 0.0,
) -> dict[int, list[float]]:
    """RankGone on the ranks that read ``subject`` in a dp job of ``n`` ranks, pass after pass over
    ``exchanges`` exchanges of the agent's cadence (``crossrank.cadence`` at the default exchange
    interval and a 1 s pass): every rank publishes exchange e at its offset (capture at e x interval,
    then its pass and offset into the window), ``subject`` at ``publishes(e)`` seconds after that (None:
    not at all); each reader reads its peers at its own offset ``polls`` passes after its publish, and
    a re-read of one peer's ``s`` (``PeerView.fetch``) is made, and ``PeerView.clock`` reads, at the end
    of the pass's windows. reader -> the times (seconds since the epoch of the first capture) of the
    passes whose verdict named ``subject`` and would fire (from the detector's ``confirm``-th active
    verdict in a row on), whose process is ``ident`` (pid, host, start ticks: on another host by
    default, its process unknown). ``skew``: seconds ``subject``'s host clock runs behind the readers':
    it publishes on its own clock's slots, that much later by theirs, stamped as if on time."""
    from hpar_agent.crossrank import cadence
    from hpar_agent.detectors.liveness import RankGone
    from hpar_agent.thresholds import COMPONENT_DEFAULTS

    cad = cadence(n, COMPONENT_DEFAULTS["exchange_s"], 1.0)
    every, grid = cad.interval_s, Grid.row_major([("dp", n)])
    epoch = 1_796_000_000.0

    def due(q: int, e: int) -> float:
        k, off = cad.offset(q)
        return e * every + k + off

    def last(q: int, at: float) -> dict[str, Any] | None:
        """``q``'s ``s`` in the store at ``at`` (seconds since the first capture)."""
        late = [0.0 if q != subject else publishes(e) for e in range(exchanges + 1)]
        behind = skew if q == subject else 0.0
        times = [due(q, e) + d for e, d in enumerate(late) if d is not None and due(q, e) + d + behind <= at]
        return None if not times else {"t": epoch + max(times), "step": 40, "id": list(ident)}

    out: dict[int, list[float]] = {}
    for r in plan(grid, subject).peers:  # who reads ``subject`` (symmetric: the ranks it reads)
        peers = plan(grid, r).peers
        detector = RankGone()
        k, off = cad.offset(r)
        reads = [e * every + cad.polls + k + off for e in range(exchanges + 1)]
        seen: dict[int, dict[str, Any]] = {}
        read_ok_at = 0.0
        named_at: list[float] = []
        streak = 0
        for tick in range(int(exchanges * every)):
            for at in (a for a in reads if tick <= a < tick + 1):
                seen = {q: p for q in peers if (p := last(q, at)) is not None}
                read_ok_at = epoch + at
            if not seen:
                continue
            end = tick + 2 * cad.window_s  # the pass's windows over: the detectors evaluate

            def fetch(purpose: str, wanted: Iterable[int], end: float = end) -> dict[int, dict[str, Any]]:
                return {q: p for q in wanted if (p := last(q, end)) is not None} if purpose == "s" else {}

            def clock(at: float = epoch + end) -> float:
                return at

            view = PeerView(seen=seen, read_ok_at=read_ok_at, interval_s=every, fetch=fetch, clock=clock)
            snap = Snapshot(
                now=epoch + tick, topology=Topology(rank=r, world_size=n), coords={}, exchange=view
            )
            verdict = detector.evaluate(snap)
            active = verdict is not None and verdict.active
            streak = streak + 1 if active else 0
            if verdict is not None and active:
                assert verdict.details["culprits"] == [subject], verdict.details
            if streak >= detector.confirm:
                named_at.append(end)
        out[r] = named_at
    return out


def hang_in_pipeline(
    grid: Grid, ranks: list[SimRank], culprit: int, age_s: float = 60.0, held: int | None = None
) -> None:
    """``culprit`` stops (asleep in Python) mid-step, as a GPipe step leaves its pipeline: the stages
    before it wait for their successor's gradients (the one just before in its send to it), the stages
    after it for their predecessor's activations. With dp, every other replica's ranks finish their
    backward and wait in their stage's dp all-reduce (seq 41) for the stuck pipeline's rank of that
    stage, which never entered it; but where ``held`` names another replica's rank of the culprit's
    stage, that replica's earlier stages wait for their successor's gradients instead (its all-reduce
    ends the stage's backward, before it sends them)."""
    line = grid.group(culprit, "pp")
    at = line.index(culprit)
    for i, r in enumerate(line):
        if i < at - 1:
            ranks[r].p2p = [P2PWait("recv", line[i + 1], "pp", age_s)]
        elif i == at - 1:
            ranks[r].p2p = [P2PWait("send", culprit, "pp", age_s)]
        elif i > at:
            ranks[r].p2p = [P2PWait("recv", line[i - 1], "pp", age_s)]
    if "dp" in grid.names:
        for sr in ranks:
            uid = src.group_key_of("dp", sr.coords)
            stuck = sr.rank in line
            sr.groups = {uid: GroupState(40, 40) if stuck else GroupState(41, 40, "all_reduce", age_s)}
    if held is not None:
        other = grid.group(held, "pp")
        for i, r in enumerate(other[: other.index(held)]):
            ranks[r].p2p = [P2PWait("recv", other[i + 1], "pp", age_s)]
            ranks[r].groups = {uid: GroupState(40, 40) for uid in ranks[r].groups}
