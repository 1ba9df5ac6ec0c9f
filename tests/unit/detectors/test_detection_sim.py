"""At 1,024 ranks, the real cross-rank detectors and peer selection on synthetic inputs
(``testkit.detection_sim``): each fault is named on exactly its ranks, a block of them whole."""

from __future__ import annotations

import pytest

from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence, Straggler
from hpar_agent.detectors.liveness import Hang, RankGone
from hpar_agent.detectors.sources import group_key_of
from hpar_agent.detectors.waits import GroupState
from testkit.detection_sim import job, judge, named, raised

N = 1024
LATE_NS = 120_000_000  # 120 ms more compute a 0.3 s step: others wait for it 0.4 of the time


@pytest.mark.parametrize(
    "slow", [{500}, {500, 501}, set(range(512, 520))], ids=["one", "two adjacent", "a node of 8"]
)
def test_slow_ranks_are_named_whole_and_no_other(slow: set[int]) -> None:
    grid, ranks = job([("dp", N)])
    for r in slow:
        ranks[r].late_ns = LATE_NS
    verdicts = judge(Straggler, grid, ranks)
    assert raised(verdicts) == slow
    assert named(verdicts) == slow


def test_a_slow_tp_group_is_named_whole_in_dp_x_tp() -> None:
    grid, ranks = job([("dp", N // 4), ("tp", 4)])
    slow = {400, 401, 402, 403}  # one replica's tp group: equally late in tp, late against the others in dp
    for r in slow:
        ranks[r].late_ns = LATE_NS
    verdicts = judge(Straggler, grid, ranks)
    assert raised(verdicts) == slow and named(verdicts) == slow


def test_a_slow_ranks_tp_peers_that_wait_for_it_are_not_named() -> None:
    """Rank 401 computes slowly: its tp peers wait for it at every tp all-reduce and so reach their dp
    all-reduce late too, but what they waited for is not theirs."""
    grid, ranks = job([("dp", N // 4), ("tp", 4)])
    ranks[401].late_ns = LATE_NS
    verdicts = judge(Straggler, grid, ranks)
    assert raised(verdicts) == {401} and named(verdicts) == {401}


@pytest.mark.parametrize("wrong", [{700}, set(range(100, 108))], ids=["one", "a node of 8"])
def test_diverged_replicas_are_named_whole(wrong: set[int]) -> None:
    grid, ranks = job([("dp", N)])
    for r in wrong:
        ranks[r].checksum = 2.0
    verdicts = judge(ReplicaDivergence, grid, ranks)
    assert raised(verdicts) == wrong and named(verdicts) == wrong


def test_a_node_that_compiled_differently_is_named_whole() -> None:
    grid, ranks = job([("dp", N)])
    wrong = set(range(256, 264))
    for r in wrong:
        ranks[r].fingerprint = 2
    verdicts = judge(CompileDivergence, grid, ranks)
    assert raised(verdicts) == wrong and named(verdicts) == wrong


def test_a_skipped_collective_names_the_rank_the_others_wait_for() -> None:
    """Rank 300 never entered dp all-reduce #41; every other rank waits in it. Its peers and itself
    name it; the ranks that cannot see it say the culprit is beyond their view (the rule's job)."""
    grid, ranks = job([("dp", N)])
    for r in ranks:
        uid = group_key_of("dp", r.coords)
        r.groups = {
            uid: GroupState(40, 40, "all_reduce") if r.rank == 300 else GroupState(41, 40, "all_reduce", 60.0)
        }
    verdicts = judge(Hang, grid, ranks, stalled_s=60.0, timeout_s=30)
    assert raised(verdicts) == set(range(N))  # every rank is stalled
    naming = {r for r, v in verdicts.items() if v.details["culprits"]}
    assert named(verdicts) == {300}
    assert naming == {300, *(p for p in range(N) if 300 in _peers(grid, p))}
    assert all(v.details["kind"] == "unknown" for r, v in verdicts.items() if r not in naming)


def test_a_dead_rank_is_named_by_its_peers_only() -> None:
    grid, ranks = job([("dp", N)])
    ranks[900].silent_s = 30.0
    verdicts = judge(RankGone, grid, ranks)
    assert raised(verdicts) == set(_readers(grid, 900)) and named(verdicts) == {900}


def _peers(grid: object, rank: int) -> list[int]:
    from hpar_agent.crossrank import plan

    return plan(grid, rank).peers  # type: ignore[arg-type]


def _readers(grid: object, rank: int) -> list[int]:
    return sorted(p for p in range(N) if rank in _peers(grid, p))
