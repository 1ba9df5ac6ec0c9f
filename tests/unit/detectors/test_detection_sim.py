"""At 1,024 ranks (Straggler up to 8,192), the real cross-rank detectors and peer selection on synthetic
inputs (``testkit.detection_sim``, ``testkit.straggler_sim``): each fault is named on exactly its ranks,
a block of them whole."""

from __future__ import annotations

from typing import Any

import pytest

from hpar_agent.detectors import liveness
from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence
from hpar_agent.detectors.liveness import Hang, RankGone
from hpar_agent.detectors.sources import group_key_of
from hpar_agent.detectors.waits import GroupState
from testkit.detection_sim import hang_in_pipeline, job, judge, named, raised
from testkit.straggler_sim import HEAVY, HEAVY_GPUS, MILD, Job, Noise, StragglerSim, cover, fired
from testkit.straggler_sim import named as named_in

N = 1024

# --------------------------------------------------------------------------------- Straggler
# (``testkit.straggler_sim``: K gradient buckets a step, dp x tp, noise, pass after pass; judged: the
# ranks whose views hold a slow rank and a clean sample, ``cover``)


def _run(
    job: Job, passes: int = 3, judged: set[int] | None = None, fill: bool = True
) -> tuple[set[int], set[int], list[dict[int, Any]]]:
    sim = StragglerSim(job, cover(job) if judged is None else judged)
    history = sim.run(passes, fill=fill)
    return fired(history), named_in(history), history


@pytest.mark.parametrize("n", [N, 1280, 2560, 8192])
@pytest.mark.parametrize(
    ("buckets", "noise"),
    [(1, MILD), (8, HEAVY), (3, HEAVY_GPUS)],
    ids=["K1-mild", "K8-heavy", "K3-heavy-gpus"],
)
def test_a_slow_rank_is_named_alone(n: int, buckets: int, noise: Noise) -> None:
    """x1.5 on one rank, under lognormal sigma 0.3 noise with 1 % 5x spikes too (and fixed per-GPU
    speeds of sigma 0.05): it and only it fires, within 3 passes (the first after a window's steps)."""
    slow = {n // 2 + 3}
    assert _run(Job(dp=n, buckets=buckets, noise=noise, slow=dict.fromkeys(slow, 1.5)))[:2] == (slow, slow)


def test_the_score_is_the_same_for_any_number_of_buckets_and_a_tenth_slower_does_not_fire() -> None:
    scores = []
    for k in range(1, 9):
        fire, name, history = _run(Job(dp=N, buckets=k, noise=MILD, slow={500: 1.5}), passes=2)
        assert fire == name == {500}, k
        scores.append(history[-1][500].value)
    assert max(scores) / min(scores) < 1.1 and min(scores) == pytest.approx(1 / 3, abs=0.03)
    for k in (1, 8):
        fire, name, history = _run(Job(dp=N, buckets=k, noise=MILD, slow={500: 1.1}), passes=2)
        assert not fire and not name and history[-1][500].value < 0.12


@pytest.mark.parametrize("slow", [{500, 501}, set(range(512, 520))], ids=["two adjacent", "a node of 8"])
def test_a_block_of_slow_ranks_is_named_whole(slow: set[int]) -> None:
    job = Job(dp=N, buckets=4, noise=MILD, slow=dict.fromkeys(slow, 1.5))
    assert _run(job)[:2] == (slow, slow)


def _splits(history: list[dict[int, Any]]) -> dict[int, dict[str, list[int]]]:
    """rank -> the split its last active verdict reported with no culprit ("no majority")."""
    out = {}
    for r, v in history[-1].items():
        if v.active and "split" in v.details:
            assert not v.details["culprits"] and v.details["culprit_unknown"].startswith("no majority")
            out[r] = v.details["split"]
    return out


@pytest.mark.parametrize("n", [N, 8192])
@pytest.mark.parametrize("layout", ["half", "every other", "scattered"])
def test_dense_faults_name_only_slow_ranks_or_report_the_split(n: int, layout: str) -> None:
    """Half the job slow (ranks 0 to n/2), every other rank slow, or 64 scattered, each 1.5x. Every
    slow rank judged raises the alert and no healthy one does; each names only slow ranks (itself
    among them), or, where its view's slower side is larger than the faster (3-2 of five), names
    none and reports the split, whose slower side is slow ranks and faster side healthy ones. Every
    other rank: each slow rank's five split 3-2 (the first peer offset odd, the second even), so all
    report the split; the scattered ones are named exactly."""
    slow = {
        "half": set(range(n // 2)),
        "every other": set(range(0, n, 2)),
        "scattered": set(range(7, n, n // 64)),
    }[layout]
    judged = {r + d for r in range(0, n, n // 48) for d in (0, 1)}  # dense: a sample, slow and healthy
    job = Job(dp=n, buckets=2, noise=MILD, slow=dict.fromkeys(slow, 1.5))
    fire, name, history = _run(job, passes=2, judged=judged if layout != "scattered" else None)
    splits = _splits(history)
    assert all(set(s["slower"]) <= slow and not set(s["faster"]) & slow for s in splits.values())
    if layout == "scattered":
        assert fire == name == slow and not splits
        return
    assert fire == slow & judged and name <= slow
    assert all(r in splits or r in history[-1][r].details["culprits"] for r in fire)
    if layout == "half":
        assert splits and name  # both: where the view's faster side is larger, named
    else:
        assert set(splits) == fire and not name


@pytest.mark.parametrize("layout", ["dp128 x tp8", "pp4 x dp256"])
def test_half_the_replicas_slow_in_dp_x_tp_and_pp_x_dp_names_only_slow_ranks_or_the_split(
    layout: str,
) -> None:
    """The first half of the replicas 1.5x slower (a tp group, or a pipeline's stages, slow whole): a
    tp group read whole is one replica against its four dp peers, a stage compared with its replicas
    at the same stage. Slow replicas raise, healthy ones do not, splits are right."""
    tp, pp = (8, 1) if "tp" in layout else (1, 4)
    dp, per = N // tp // pp, tp * pp
    slow = set(range(N // 2))
    judged = {r for rep in range(0, dp, dp // 8) for r in range(rep * per, rep * per + per)}
    stages = {3: 1.3} if pp > 1 else {}
    job = Job(dp=dp, tp=tp, pp=pp, buckets=2, noise=MILD, slow=dict.fromkeys(slow, 1.5), stage_work=stages)
    fire, name, history = _run(job, passes=2, judged=judged)
    splits = _splits(history)
    assert fire == slow & judged and name <= slow and splits
    assert all(set(s["slower"]) <= slow and not set(s["faster"]) & slow for s in splits.values())


@pytest.mark.parametrize("tp", [4, 8])
@pytest.mark.parametrize("buckets", [1, 8])
def test_dp_x_tp_names_the_slow_rank_not_its_tp_peers_and_a_slow_tp_group_whole(
    tp: int, buckets: int
) -> None:
    """A slow rank's tp peers wait for it at every tp all-reduce and reach their buckets late too: what
    they waited for is not theirs. A tp group slow across all its compute is late against the other
    replicas at every collective: named whole."""
    one = {tp * 40 + 1}
    job = Job(dp=N // tp, tp=tp, buckets=buckets, noise=MILD, slow=dict.fromkeys(one, 1.5))
    assert _run(job)[:2] == (one, one)
    group = set(range(tp * 40, tp * 41))
    job = Job(dp=N // tp, tp=tp, buckets=buckets, noise=MILD, slow=dict.fromkeys(group, 1.5))
    assert _run(job)[:2] == (group, group)


def test_the_slow_rank_each_rank_names_is_one_whose_waits_it_sees() -> None:
    """dp2 x tp2, rank 3 3x slow: rank 2, its tp peer, waits for it and reaches its all-reduce with
    rank 0 late. Rank 0 reads ranks 1 and 2, not rank 3, so it cannot see what rank 2 waited for (it
    scores rank 2 at 0.39): the slow rank it names (its step verdict's ``slow_rank``) is none, never
    rank 2. Rank 1 reads rank 3 but not its tp peer, so it cannot tell whether rank 3 waited either:
    none. Rank 3, which reads its whole tp group, names itself."""
    sim = StragglerSim(Job(dp=2, tp=2, noise=MILD, slow={3: 3.0}))
    history = sim.run(4)
    assert (fired(history), named_in(history)) == ({3}, {3})
    assert history[-1][0].details["lags"]["2"] > 0.25  # what rank 0 would have named
    assert {r: (d.slowest or (None,))[0] for r, d in sim.detectors.items()} == {
        0: None,
        1: None,
        2: None,
        3: 3,
    }


def test_many_collectives_a_step_are_judged() -> None:
    """160 collectives a step: the window widens to 3 steps (481 entries, not 256) and the steps
    measured add up over the exchanges."""
    job = Job(dp=256, buckets=160, noise=MILD, slow={100: 1.5}, steps_per_pass=2)
    fire, name, history = _run(job, passes=10)
    assert (fire, name) == ({100}, {100}) and history[-1][100].value == pytest.approx(1 / 3, abs=0.03)


def test_a_clean_run_raises_nothing_under_heavy_tails() -> None:
    job = Job(dp=N, buckets=2, noise=HEAVY_GPUS)
    fire, name, _ = _run(job, passes=12)
    assert not fire and not name


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


def _pipeline_hang(
    dims: list[tuple[str, int]], culprit: int, passes: int = 1
) -> tuple[dict[int, Any], dict[int, list[list[int]]]]:
    grid, ranks = job(dims)
    hang_in_pipeline(grid, ranks, culprit)
    fetched: dict[int, list[list[int]]] = {}
    verdicts = judge(Hang, grid, ranks, stalled_s=60.0, fetched=fetched, passes=passes, timeout_s=30)
    assert raised(verdicts) == set(grid.ranks)  # every rank is stalled
    return verdicts, fetched


@pytest.mark.parametrize("stages", [16, 64])
@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_stage_that_hangs_in_a_long_pipeline_is_named_by_every_stage(stages: int, where: str) -> None:
    """A pure pipeline of 16 or 64 stages, one stage asleep mid-step: each stage reads four others' ``s``,
    and the chain of waits from it (a stage's successor, its successor's...) goes through stages it
    does not read. Each stage reads those on demand, the peer a wait points at and seven more on at
    the same step a read, and names the stage asleep, the ones in between victims, within one pass."""
    culprit = stages // 2 if where == "middle" else stages - 1
    verdicts, fetched = _pipeline_hang([("pp", stages)], culprit)
    for r, v in verdicts.items():
        assert (v.details["kind"], v.details["culprits"]) == ("missing", [culprit]), (r, v.details)
        assert v.details["role"] == ("culprit" if r == culprit else "victim"), (r, v.details)
    assert max(len(reads) for reads in fetched.values()) <= liveness.CHAIN_READS
    assert max(len(ranks) for reads in fetched.values() for ranks in reads) <= liveness.CHAIN_RANKS


@pytest.mark.parametrize("order", ["pp x dp", "dp x pp"])
def test_a_stage_that_hangs_in_dp4_x_pp16_is_named_by_every_rank(order: str) -> None:
    """dp4 x pp16 (pp outermost as torchtitan lays it out, or pipelines of consecutive ranks): stage 8 of
    replica 2 asleep. Its pipeline's stages wait point to point; the other replicas' ranks wait in
    their stage's dp all-reduce for the stuck pipeline's rank of it, which waits for its neighbour in
    turn: every one of the 64 ranks names the rank asleep."""
    dims = [("pp", 16), ("dp", 4)] if order == "pp x dp" else [("dp", 4), ("pp", 16)]
    culprit = 8 * 4 + 2 if order == "pp x dp" else 2 * 16 + 8
    verdicts, _ = _pipeline_hang(dims, culprit)
    for r, v in verdicts.items():
        assert (v.details["kind"], v.details["culprits"]) == ("missing", [culprit]), (r, v.details)


def test_a_rank_that_waits_in_a_collective_for_ranks_it_cannot_see_is_no_culprit() -> None:
    """dp16 x pp16, stage 8 of replica 0 asleep; replica 1's rank of stage 8 waits in its dp all-reduce
    for it, and replica 1's earlier stages for that rank's gradients. A rank whose dp peers (4 of 16)
    miss replica 0 follows its chain to replica 1's stage-8 rank, which waits in a collective for
    members it cannot see: no culprit, "unknown" and why (as for the other replicas' ranks that wait in
    their dp all-reduce for replica 0 out of view); the ranks that see replica 0 name its stage 8. Never
    replica 1's."""
    grid, ranks = job([("pp", 16), ("dp", 16)])
    culprit, held = 8 * 16, 8 * 16 + 1
    hang_in_pipeline(grid, ranks, culprit, held=held)
    verdicts = judge(Hang, grid, ranks, stalled_s=60.0, timeout_s=30)
    assert named(verdicts) == {culprit}
    assert all(v.details["culprits"] == [culprit] for r, v in verdicts.items() if r % 16 == 0)  # its pipeline
    unknown = {r: v.details["note"] for r, v in verdicts.items() if v.details["kind"] == "unknown"}
    assert unknown and all("beyond" in note for note in unknown.values())  # the members out of view
    assert any(
        note == f"rank {held} waits in dp for members beyond the ranks read" for note in unknown.values()
    )


def test_a_chain_longer_than_a_pass_reads_is_unknown_then_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the store read once a pass for the chain (and not at all), a stage whose chain still leaves
    the ranks read says so and names no one; the stages kept as the chain is followed bring the rest
    in over the next passes. Never a stage in between."""
    monkeypatch.setattr(liveness, "CHAIN_READS", 0)
    verdicts, _ = _pipeline_hang([("pp", 64)], 63)
    assert named(verdicts) == set() and all(v.details["kind"] == "unknown" for v in verdicts.values())
    assert "the chain of waits leaves the ranks read at" in verdicts[0].details["note"]
    monkeypatch.setattr(liveness, "CHAIN_READS", 1)
    for passes in (1, 2, 3):
        verdicts, _ = _pipeline_hang([("pp", 64)], 63, passes=passes)
        assert named(verdicts) <= {63}
        unknown = {r for r, v in verdicts.items() if v.details["kind"] == "unknown"}
        assert all("the next goes on" in verdicts[r].details["note"] for r in unknown)
        if passes == 1:
            assert unknown  # one read of eight stages on does not reach the end from every stage
    assert not unknown and named(verdicts) == {63}


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


@pytest.mark.parametrize("factor", [2.0, 1.5])
def test_pp4_x_dp256_a_stage_slower_by_design_is_no_culprit_a_slow_rank_is_named_alone(factor: float) -> None:
    """The last stage does 30 % more work on every replica: compared with the same stage of the other
    replicas it is on time. A rank of stage 2 twice or 1.5x as slow is named alone: the neighbours that
    wait for its activations and gradients are compared with their own stage's replicas, net of those
    p2p waits (counted as their work, a 1.5x rank's neighbours dilute its reference and it goes
    unnamed)."""
    if factor == 2.0:
        job = Job(dp=256, pp=4, buckets=2, noise=MILD, stage_work={3: 1.3})
        assert _run(job)[:2] == (set(), set())
    job = Job(dp=256, pp=4, buckets=2, noise=MILD, stage_work={3: 1.3}, slow={4 * 100 + 2: factor})
    assert _run(job)[:2] == ({402}, {402})


@pytest.mark.parametrize(("stages", "factor"), [(16, 2.0), (64, 3.0)])
def test_a_pure_pipeline_of_any_size_names_a_stage_that_became_slower(stages: int, factor: float) -> None:
    """A pure pipeline (dp 1) of 16 and 64 stages, GPipe with as many microbatches as stages, the last
    stage 30 % more work by design: from step 100 one stage works 2x (3x at 64 stages, where the hops'
    transfers are a larger part of the step) as long. Each stage reads four others' own work a step
    (beyond ``WHOLE_GROUP`` ranks no stage was read: nothing was named); the slow one is named alone,
    the one slower by design never, and without a slow stage nothing is."""
    slow = stages // 2 + 1
    job = Job(dp=1, pp=stages, microbatches=stages, noise=MILD, stage_work={stages - 1: 1.3}, slow_from=100)
    if stages == 16:
        assert _run(job, passes=20, fill=False)[:2] == (set(), set())
    job = Job(**{**job.__dict__, "slow": {slow: factor}})
    fire, name, history = _run(job, passes=20, fill=False)
    assert (fire, name) == ({slow}, {slow}), history[-1].get(slow)
    assert history[-1][slow].details["stage_changed"] == [slow]
