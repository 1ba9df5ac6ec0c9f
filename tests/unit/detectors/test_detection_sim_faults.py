"""The cross-rank detectors where a fault is dense, scattered, interleaved or on one GPU of every node
(``testkit.detection_sim``, the real detectors on their real comparison peers): each names exactly the
faulty ranks, or no culprit and the split; never a healthy rank."""

from __future__ import annotations

from itertools import pairwise

import pytest

from hpar_agent.crossrank import Grid, cadence, plan, select
from hpar_agent.detectors.base import Verdict
from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence
from hpar_agent.detectors.liveness import LATE_S
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from testkit.detection_sim import diverge, job, judge, named, raised, silence_named

N = 1024


def _splits(verdicts: dict[int, Verdict]) -> set[int]:
    """The ranks whose verdict says the culprit is unknown (a split with no majority)."""
    return {r for r, v in verdicts.items() if v.active and v.details.get("culprit_unknown")}


def test_peers_never_share_a_local_gpu_index_at_any_size() -> None:
    """Every multiple of 8 from 64 to 16,384 ranks (and a 6-rank node where LOCAL_WORLD_SIZE says so):
    a rank's four comparison peers are on four other local indices, so a fault on one GPU of every
    node is outvoted 4 to 1 and reaches a healthy rank's five once at most. The offsets n/5 and 2n/5 alone were multiples of 8 at 408 of these sizes (1,280: 256, 512)."""
    for n in range(64, 16_385, 8):
        members = range(n)  # a dp group's ranks in order, as ``crossrank.plan`` hands it to ``select``
        for rank in (0, n - 1):
            peers = select(members, rank)
            local = {p % 8 for p in peers}  # four other local indices: a one-GPU fault reaches a five once
            assert len(local) == 4 and rank % 8 not in local, (n, rank, peers)
    for n in range(72, 4_097, 24):
        peers = plan(Grid.row_major([("dp", n)]), 5, nodes=(8, 6)).peers
        assert all(p % 8 != 5 % 8 and p % 6 != 5 % 6 for p in peers), (n, peers)


@pytest.mark.parametrize(
    ("detector", "n"), [(ReplicaDivergence, 1_280), (CompileDivergence, 2_560)], ids=["replica", "compile"]
)
def test_a_fault_on_one_gpu_of_every_node_is_named_at_a_blind_size(detector: type, n: int) -> None:
    grid, ranks = job([("dp", n)])
    wrong = {r for r in range(n) if r % 8 == 3}  # local GPU 3 of every node
    diverge(detector, ranks, wrong)
    verdicts = judge(detector, grid, ranks)
    assert raised(verdicts) == wrong and named(verdicts) == wrong and not _splits(verdicts)


@pytest.mark.parametrize("detector", [ReplicaDivergence, CompileDivergence], ids=["replica", "compile"])
def test_half_the_job_diverged_names_no_healthy_rank_and_reports_the_split(detector: type) -> None:
    """Ranks 0-511 diverged alike: a rank's five (itself and four peers) split 3-2 either way, and 4-1
    the wrong way nowhere; with no clear majority the verdict names no one and says so."""
    grid, ranks = job([("dp", N)])
    wrong = set(range(N // 2))
    diverge(detector, ranks, wrong)
    verdicts = judge(detector, grid, ranks)
    assert named(verdicts) <= wrong
    split = _splits(verdicts)
    assert split and all(not verdicts[r].details["culprits"] for r in split)
    assert all("no majority" in str(verdicts[r].details["culprit_unknown"]) for r in split)


@pytest.mark.parametrize("detector", [ReplicaDivergence, CompileDivergence], ids=["replica", "compile"])
def test_every_other_rank_diverged_is_reported_as_a_split(detector: type) -> None:
    """An interleaved 50/50 split: the first offset is odd (205) and the second even (410), so every
    rank's five split 3-2 and every rank reports the split; no rank is named (with both odd, each
    healthy rank would be outvoted 4 to 1 by four diverged peers)."""
    grid, ranks = job([("dp", N)])
    wrong = set(range(0, N, 2))
    diverge(detector, ranks, wrong)
    verdicts = judge(detector, grid, ranks)
    assert named(verdicts) == set() and _splits(verdicts) == set(range(N))


@pytest.mark.parametrize("detector", [ReplicaDivergence, CompileDivergence], ids=["replica", "compile"])
def test_scattered_faults_are_named_exactly(detector: type) -> None:
    grid, ranks = job([("dp", N)])
    wrong = {(i * 389 + 17) % N for i in range(24)}  # 24 ranks spread over the job
    diverge(detector, ranks, wrong)
    verdicts = judge(detector, grid, ranks)
    assert named(verdicts) == wrong
    assert raised(verdicts) - wrong == _splits(verdicts) - wrong  # healthy: only a 3-2 split, no culprit


def test_a_node_that_compiled_differently_in_dp_x_tp_is_named_not_its_dp_peers() -> None:
    """dp128 x tp8: the node of dp index 37 (ranks 296-303) compiled differently. Each of its ranks
    compares with its 7 tp peers (all alike) and 4 dp peers (healthy, other nodes): the minority of
    all 12 would be the 4 healthy dp peers; along dp each node rank is outvoted 4 to 1."""
    grid, ranks = job([("dp", N // 8), ("tp", 8)])
    node = set(range(296, 304))
    diverge(CompileDivergence, ranks, node)
    verdicts = judge(CompileDivergence, grid, ranks)
    assert raised(verdicts) == node and named(verdicts) == node


@pytest.mark.parametrize("n", [1_024, 2_048, 8_192])
def test_a_peer_one_exchange_late_is_never_gone_and_a_dead_one_is_named_two_exchanges_after(n: int) -> None:
    """The exchange every 3 s at 1,024 ranks, 4 s at 2,048, 16 s at 8,192 (a phase over 8 passes: a rank
    reads a peer's publish 0.5-15.5 s after it). Rank 1,000, alive, skips exchange 2 and is a late pass
    (0.99 s) on exchange 3, or publishes exchange 2 one exchange and 0.99 s late: none of its readers
    (on other hosts: the margin alone decides) ever names it. Dead after its publish of exchange 2,
    every reader names it (the alert fires: no confirming pass) within a pass of 2 exchanges and 1 s
    (``RankGone.bound``, the floor the live late peer sets) after that publish, whatever its offset,
    never before, and at every pass from then on: within 10 s at 2,048 ranks."""
    cad = cadence(n, COMPONENT_DEFAULTS["exchange_s"], 1.0)
    every, late = cad.interval_s, 1_000
    readers = set(plan(Grid.row_major([("dp", n)]), late).peers)
    assert every == {1_024: 3.0, 2_048: 4.0, 8_192: 16.0}[n] and len(readers) == 4
    skipped = silence_named(n, late, lambda e: None if e == 2 else (LATE_S - 0.01 if e == 3 else 0.0), 7)
    delayed = silence_named(n, late, lambda e: every + LATE_S - 0.01 if e == 2 else 0.0, 7)
    assert set(skipped) == set(delayed) == readers
    assert all(not at for at in (*skipped.values(), *delayed.values()))
    dead = silence_named(n, late, lambda e: 0.0 if e <= 2 else None, 7)
    k, off = cad.offset(late)
    last = 2 * every + k + off  # its last publish
    bound = 2 * every + LATE_S
    assert set(dead) == readers
    after = {r: at[0] - last for r, at in dead.items()}
    assert all(bound < a <= bound + 1 for a in after.values()), after
    assert n != 2_048 or max(after.values()) <= 10.0
    assert all(len(at) >= every and all(b - a == 1 for a, b in pairwise(at)) for at in dead.values())


def test_a_live_peer_whose_host_clock_runs_behind_is_named_only_past_the_late_pass_margin() -> None:
    """Host clock skew comes out of the late-pass margin (docs/alerts.md): a live peer on another host
    whose clock runs an exchange interval behind the readers' and publishes on time, or 0.9 s behind and
    misses one exchange, is never named; 1.5 s behind with a missed exchange, it is (NTP keeps hosts
    within milliseconds)."""
    n, subject = 1_024, 1_000
    every = cadence(n, COMPONENT_DEFAULTS["exchange_s"], 1.0).interval_s
    readers = set(plan(Grid.row_major([("dp", n)]), subject).peers)
    on_time = silence_named(n, subject, lambda e: 0.0, 7, skew=every - 0.01)
    skipped = silence_named(n, subject, lambda e: None if e == 2 else 0.0, 7, skew=LATE_S - 0.1)
    assert set(on_time) == set(skipped) == readers
    assert all(not at for at in (*on_time.values(), *skipped.values()))
    past = silence_named(n, subject, lambda e: None if e == 2 else 0.0, 7, skew=LATE_S + 0.5)
    assert set(past) == readers and all(past.values())
