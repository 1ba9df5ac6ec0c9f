"""The cross-rank detectors where a fault is dense, scattered, interleaved or on one GPU of every node
(``testkit.detection_sim``, the real detectors on their real comparison peers): each names exactly the
faulty ranks, or no culprit and the split; never a healthy rank."""

from __future__ import annotations

import pytest

from hpar_agent.crossrank import Grid, cadence, plan, select
from hpar_agent.detectors.base import Verdict
from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence
from hpar_agent.detectors.liveness import RankGone
from hpar_agent.detectors.snapshot import PeerView, Snapshot
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from hpar_agent.topology import Topology
from testkit.detection_sim import diverge, job, judge, named, raised

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


@pytest.mark.parametrize("n", [2_048, 4_096])
def test_a_peer_one_exchange_late_is_never_gone_and_a_dead_one_is_named_at_its_second_miss(n: int) -> None:
    """At 2,048 and 4,096 ranks the exchange paces itself (4 s and 8 s, spread over 2 and 4 passes): a
    peer's payload is up to 7.5 s old at a read on time. Rank 1,000, a pass late on one exchange, is
    judged by each of its readers at every pass until the next read; dead after its publish, it is
    named by every reader at the read of the second exchange it missed. Its readers are on other
    hosts (the process unknown): the margin alone decides."""
    grid, _ = job([("dp", n)])
    cad = cadence(n, COMPONENT_DEFAULTS["exchange_s"], 1.0)
    every = cad.interval_s
    late, read_at = 1_000, 1_796_000_000.0

    def verdicts(missed: int, behind_s: float, after_s: float) -> dict[int, Verdict]:
        out = {}
        for r in plan(grid, late).peers:  # who reads rank 1,000 (symmetric: the ranks it reads)
            seen = {
                q: {
                    "t": read_at
                    - cad.publish_lag(r, q, 1.0)
                    - (missed * every + behind_s if q == late else 0),
                    "step": 40,
                    "id": [4242, "another-host", 1],
                }
                for q in plan(grid, r).peers
            }
            view = PeerView(
                seen=seen,
                read_ok_at=read_at,
                interval_s=every,
                publish_lag=lambda q, r=r: cad.publish_lag(r, q, 1.0),
            )
            snap = Snapshot(
                now=read_at + after_s, topology=Topology(rank=r, world_size=n), coords={}, exchange=view
            )
            got = RankGone().evaluate(snap)
            assert got is not None
            out[r] = got
        return out

    assert every == {2_048: 4.0, 4_096: 8.0}[n]
    for after_s in (0.0, every - 1.0):  # every pass from one read to the pass before the next
        assert (
            raised(verdicts(1, 1.0, after_s)) == set()
        )  # an exchange and a pass late: silent up to 2I + 7.5 s
    dead = verdicts(2, 0.0, 0.0)
    assert raised(dead) == set(plan(grid, late).peers) and named(dead) == {late}
