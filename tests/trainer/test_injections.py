"""Each injection shows its real symptom with no agent attached (2 CPU ranks, rank 1 injected)."""

from __future__ import annotations

import math
import statistics

import pytest

pytestmark = pytest.mark.distributed

STEPS = ["--steps", "6", "--inject-step", "2"]
MIB = 1 << 20


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def _differing(a: dict[str, float], b: dict[str, float]) -> set[str]:
    return {k for k in a if abs(a[k] - b[k]) > 1e-6 * max(1.0, abs(a[k]))}


def test_recompile_storm(launch):
    run = launch(
        1, "--compile", "eager", "--inject", "recompile-storm", "--steps", "12", "--inject-step", "1"
    )
    assert run.returncode == 0, run.output
    dyn = run.ranks[0]["dynamo"]
    # one compile, then one recompile per step until Dynamo's recompile limit (8) stops compiling
    assert dyn["frames"]["total"] >= 8 and dyn["recompile_limit_hits"] > 0, dyn


def test_graph_break(launch):
    run = launch(1, "--compile", "eager", "--inject", "graph-break", "--steps", "3", "--inject-step", "2")
    assert run.returncode == 0, run.output
    assert run.ranks[0]["dynamo"]["graph_breaks"] > 0
    before = launch(1, "--compile", "eager", "--inject", "graph-break", "--steps", "2", "--inject-step", "2")
    assert before.returncode == 0, before.output
    assert (
        before.ranks[0]["dynamo"]["graph_breaks"] == 0
    )  # the break appears at --inject-step (after warm-up)


def test_divergent_graph(launch):
    run = launch(2, "--dp", "2", "--compile", "eager", "--inject", "divergent-graph", "--steps", "2")
    assert run.returncode == 0, run.output
    peer, injected = (r["compile"] for r in run.ranks)
    assert injected["ops"] > peer["ops"], (peer, injected)


def test_ddp_nesting_dp_replicas_drift(launch):
    run = launch(2, "--dp", "2", "--inject", "ddp-nesting", *STEPS)
    assert run.returncode == 0, run.output
    drifted = _differing(run.ranks[0]["checksums"], run.ranks[1]["checksums"])
    assert drifted and all(k.startswith("layers.0.") for k in drifted), drifted


def test_tp_grad_skip_tp_replicas_drift(launch):
    run = launch(2, "--tp", "2", "--inject", "tp-grad-skip", *STEPS)
    assert run.returncode == 0, run.output
    drifted = _differing(run.ranks[0]["checksums"], run.ranks[1]["checksums"])
    assert any("q_norm" in k for k in drifted), drifted


def test_dtype_mismatch_silently_corrupts(launch):
    run = launch(2, "--dp", "2", "--dp-mode", "ddp", "--inject", "dtype-mismatch", *STEPS)
    assert run.returncode == 0, run.output  # equal byte counts: the reduction completes, no error
    assert run.ranks[1]["last_reduce_dtype"] == "torch.bfloat16"
    assert run.ranks[0]["last_reduce_dtype"] == "torch.float32"
    assert run.summary is not None
    losses = run.summary["losses"]
    assert all(math.isfinite(x) for x in losses[:3]) and not all(math.isfinite(x) for x in losses[3:]), losses


@pytest.mark.parametrize("name", ["tensor-leak", "compile-leak"])
def test_leaks_grow_memory(launch, name):
    run = launch(2, "--dp", "2", "--inject", name, "--inject-size", str(16 * MIB), *STEPS)
    assert run.returncode == 0, run.output
    grown = [run.steps(r, "rss_mb")[-1] - run.steps(r, "rss_mb")[1] for r in (0, 1)]
    assert grown[1] > 40 and grown[1] > grown[0] + 30, grown
    assert run.ranks[1]["leaked_bytes"] == 4 * 16 * MIB
    if name == "compile-leak":  # a new compiled graph per microbatch, kept alive
        assert run.ranks[1]["leaked_graphs"] == 4 and "leaked_graphs" not in run.ranks[0]


def test_straggler_compute_time(launch):
    run = launch(2, "--dp", "2", "--inject", "straggler", "--inject-delay", "0.3", *STEPS)
    assert run.returncode == 0, run.output
    gap = _mean(run.steps(1, "fwd_s", 2)) - _mean(run.steps(0, "fwd_s", 2))
    assert 0.2 < gap < 0.6, gap


def test_slow_collective_peer_waits(launch):
    run = launch(
        2, "--dp", "2", "--dp-mode", "ddp", "--inject", "slow-collective", "--inject-delay", "0.3", *STEPS
    )
    assert run.returncode == 0, run.output
    before, after = _mean(run.steps(0, "dp_wait_s")[:2]), _mean(run.steps(0, "dp_wait_s", 2))
    assert after - before > 0.2, (before, after)
    assert abs(_mean(run.steps(1, "fwd_s", 2)) - _mean(run.steps(0, "fwd_s", 2))) < 0.1  # not a straggler


def test_hang_times_out(launch):
    run = launch(2, "--dp", "2", "--inject", "hang", "--pg-timeout", "10", *STEPS, timeout=120)
    assert run.returncode != 0
    assert run.seconds < 90, run.seconds
    assert "timed out" in run.output.lower() or "timeout" in run.output.lower(), run.output[-2000:]
