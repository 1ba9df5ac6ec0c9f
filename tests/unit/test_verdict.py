"""The step anatomy's conclusions: the bottleneck verdict from phase shares, the slow rank across ranks."""

from __future__ import annotations

import pytest

from hpar_agent.catalogue import VERDICTS
from hpar_agent.collectors.verdict import DEFAULTS, bottleneck, slow_rank_across


@pytest.mark.parametrize(
    ("shares", "straggler", "verdict"),
    [
        ({"data_wait": 0.3, "forward": 0.3, "backward": 0.3}, False, "input-bound"),
        ({"data_wait": 0.3, "forward": 0.3}, True, "input-bound"),  # the loader is the cause to name
        ({"data_wait": 0.0, "host": 0.8, "forward": 0.1}, False, "host-bound"),
        ({"data_wait": 0.0, "host": 0.8, "forward": 0.1}, True, "host-bound"),  # the host work is the cause
        ({"data_wait": 0.05, "forward": 0.6}, True, "slow-rank"),
        ({"data_wait": 0.05, "comm_exposed": 0.4, "forward": 0.3}, False, "communication-bound"),
        ({"data_wait": 0.19, "host": 0.19, "comm_exposed": 0.29, "forward": 0.3}, False, "compute-bound"),
        ({"data_wait": 0.1, "forward": 0.4, "backward": 0.1}, False, "compute-bound"),  # 60% explained
        ({"data_wait": 0.1, "forward": 0.4, "backward": 0.09}, False, "unknown"),  # 59% explained
        ({"optimizer": 0.01}, False, "unknown"),  # the zero-code DDP program's 99% "other"
        ({}, False, "unknown"),
    ],
)
def test_verdict_on_synthetic_shares(shares, straggler, verdict) -> None:
    assert bottleneck(shares, straggler=straggler).name == verdict


def test_exposed_communication_is_not_named_before_the_straggler_detector_judged() -> None:
    """Until then a victim of a slow rank and a rank slowed by its own communication look the same."""
    shares = {"data_wait": 0.05, "comm_exposed": 0.8, "forward": 0.1}
    v = bottleneck(shares, straggler_known=False)
    assert v.name == "unknown" and v.reason.startswith("comm_exposed is 80% of the step")
    assert "not known before the Straggler detector has judged" in v.reason
    assert bottleneck(shares).name == "communication-bound"
    assert bottleneck({"forward": 0.7, "comm_exposed": 0.1}, straggler_known=False).name == "compute-bound"


def test_each_verdict_says_why_and_the_thresholds_are_the_declared_ones() -> None:
    v = bottleneck({"data_wait": 0.05, "forward": 0.3, "backward": 0.2})
    assert v == ("unknown", "the phases explain 55% of the step (anatomy.min_explained 60%)")
    assert (
        bottleneck(
            {"data_wait": 0.05, "forward": 0.3, "backward": 0.2}, thresholds={"min_explained": 0.5}
        ).name
        == "compute-bound"
    )
    assert (
        bottleneck({"host": 0.25, "forward": 0.7}).reason
        == "host is 25% of the step (anatomy.host_share 20%)"
    )
    assert bottleneck({"host": 0.25, "forward": 0.7}, thresholds={"host_share": 0.3}).name == "compute-bound"
    assert bottleneck({"forward": 0.5, "backward": 0.4}).reason.startswith(
        "forward, backward and optimizer are 90%"
    )
    assert set(DEFAULTS) == {
        "anatomy.input_share",
        "anatomy.pipeline_share",
        "anatomy.host_share",
        "anatomy.comm_share",
        "anatomy.min_explained",
    }
    assert {
        bottleneck(s, straggler=bool(st), pipeline_wait=pw, slow_peer=None if st is True else st).name
        for s, st, pw in [
            ({"data_wait": 1}, False, 0.0),
            ({"host": 1}, False, 0.0),
            ({}, False, 0.5),
            ({}, True, 0.0),
            ({"comm_exposed": 1}, False, 0.0),
            ({"comm_exposed": 1}, 3, 0.0),
            ({}, False, 0.0),
            ({"forward": 1}, False, 0.0),
        ]
    } == set(VERDICTS)


def test_slow_rank_across_the_run_directorys_summaries() -> None:
    def digest(fwd: float, comm: float, verdict: str = "compute-bound", **ev: object) -> dict:
        return {
            "verdict": verdict,
            "step_seconds_p50": 2.6,
            "evidence": ev,
            "phase_seconds_p50": {"forward": fwd, "backward": 0.3, "optimizer": 0.01, "comm_exposed": comm},
        }

    # rank 2 computes 2 s longer per step; ranks 0, 1, 3 wait for it in their exposed communication
    ranks = [
        (0, 0, digest(0.2, 2.0)),
        (1, 0, digest(0.2, 2.05)),
        (2, 0, digest(2.2, 0.01)),
        (3, 0, digest(0.21, 1.9)),
    ]
    slow = slow_rank_across(ranks)
    assert (
        slow is not None
        and slow["rank"] == 2
        and slow["source"] == "phases"
        and slow["compute_excess_s"] > 1.9
    )
    assert slow_rank_across([(r, 0, digest(0.2, 0.01)) for r in range(4)]) is None  # a clean run
    # longer compute but nobody waits for it (its own stage in a pipeline, or overlap): not named
    assert slow_rank_across([(0, 0, digest(0.2, 0.0)), (1, 0, digest(2.2, 0.0))]) is None
    assert slow_rank_across([(0, 0, digest(2.2, 0.0)), (1, 1, digest(0.2, 2.0))]) is None  # other stages
    # the live verdicts name it, the slow rank's own and its victim's: taken as they are
    named = [
        (0, 0, digest(0.2, 0.1, "waits-for-slow-rank", slow_rank=1)),
        (1, 0, digest(0.2, 0.1, "slow-rank", slow_rank=1)),
    ]
    assert slow_rank_across(named) == {"rank": 1, "source": "straggler", "ranks_naming_it": 2, "ranks": 2}


def test_a_rank_that_waits_for_the_slow_rank_is_its_victim_not_slow() -> None:
    """The job's slow rank is another (the Straggler exchange names rank 3): this rank waits for it in a
    collective (its dp replica in the gradient all-reduce, its tp peer in the tp all-reduces), so its
    verdict says it waits and whom for, never slow-rank; the slow rank's own verdict is slow-rank."""
    shares = {"forward": 0.6, "comm_exposed": 0.1}
    victim = bottleneck(shares, straggler=True, slow_peer=3)
    assert victim == ("waits-for-slow-rank", "waits for rank 3, which the Straggler detector names slow")
    assert bottleneck(shares, straggler=True).name == "slow-rank"
    assert bottleneck(shares, straggler=True, slow_peer=3, pipeline_wait=0.5).name == "pipeline-bound"


def test_a_stage_that_waits_for_its_pipeline_neighbours_is_pipeline_bound() -> None:
    """A stage whose first forward waits for activations shows it as host time, and a peer's slow
    stage makes the job slow-rank: waiting in p2p for 20 % of the step or more says what it is."""
    shares = {"host": 0.27, "forward": 0.01, "backward": 0.01}
    v = bottleneck(shares, straggler=True, pipeline_wait=0.9)
    assert v.name == "pipeline-bound" and "90%" in v.reason
    assert bottleneck(shares, straggler=True, pipeline_wait=0.1).name == "host-bound"
    assert bottleneck({"data_wait": 0.5}, pipeline_wait=0.9).name == "input-bound"
