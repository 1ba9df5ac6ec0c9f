"""The bottleneck verdict of a program with one planted cause (``tests/zerocode_scripts/anatomy_causes.py``),
attached with ``attach(model)`` in the script and under ``hpar-agent run``: each cause is named, and both
ways of attaching give the same verdict. Every cause is a 0.2 s sleep against a few ms of compute, so no
verdict moves with the machine's load. The detectors are off: with them a slow peer may be named
slow-rank on one run and not the other, as the Straggler detector confirms it or not in ten steps.
Without its verdict the slow peer's victim cannot tell its waits from its own communication: unknown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testkit.zerocode import clean_env, run_cmd, summaries

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "zerocode_scripts" / "anatomy_causes.py"
#: cause -> ranks, and the verdict each rank must give
CAUSES: dict[str, tuple[int, dict[int, str]]] = {
    "clean": (1, {0: "compute-bound"}),
    "slow-data": (1, {0: "input-bound"}),
    "host": (1, {0: "host-bound"}),
    "slow-peer": (2, {0: "unknown", 1: "compute-bound"}),
}
ARMS = ("attach", "hpar-agent run")


class Runs:
    """``runs(cause, arm)``: rank -> its anatomy summary of that run, run on first use and shared."""

    def __init__(self, base: Path) -> None:
        self.base, self.done = base, {}
        self.goodput: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}  # the same runs' ledgers

    def __call__(self, cause: str, arm: str) -> dict[int, dict[str, Any]]:
        if (cause, arm) not in self.done:
            world, _ = CAUSES[cause]
            run_dir = self.base / f"{cause}-{arm.replace(' ', '-')}"
            head = (
                [sys.executable, str(SCRIPT)]
                if world == 1
                else [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={world}",
                    str(SCRIPT),
                ]
            )
            cmd = [*head, cause, "attach"] if arm == "attach" else run_cmd([*head, cause])
            env = clean_env(
                run_dir, HPAR_METRICS_PORT="-1", HPAR_DETECTORS="0", HPAR_TRACES="none", HPAR_DETAIL_RATE="0"
            )  # every step's phases, however fast the machine
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
            assert proc.returncode == 0, proc.stderr[-3000:]
            self.done[(cause, arm)] = {r: s["components"]["anatomy"] for r, s in summaries(run_dir).items()}
            self.goodput[(cause, arm)] = {
                r: s["components"]["goodput"] for r, s in summaries(run_dir).items()
            }
        return self.done[(cause, arm)]


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("verdicts"))


@pytest.mark.parametrize("cause", list(CAUSES))
def test_the_planted_cause_is_named_the_same_both_ways(runs: Runs, cause: str) -> None:
    world, expected = CAUSES[cause]
    verdicts = {}
    for arm in ARMS:
        got = runs(cause, arm)
        assert sorted(got) == list(range(world)), (arm, got)
        for rank, a in got.items():
            found_by = "attach(model)" if arm == "attach" else "wrapper" if world > 1 else "optimizer step"
            assert a["model"]["found_by"] == found_by, (arm, rank, a)
            assert a["verdict"] == expected[rank], (arm, rank, a)
            if a["verdict"] == "unknown":  # exposed communication past its threshold, no Straggler verdict
                reason = a["evidence"]["reason"]
                assert reason.startswith("comm_exposed is ") and "Straggler detector" in reason, a
            assert a["evidence"]["steps"] >= 6, (
                arm,
                rank,
                a,
            )  # ten steps, two of warm-up, judged after the model is known
        verdicts[arm] = {r: a["verdict"] for r, a in got.items()}
    assert verdicts["attach"] == verdicts["hpar-agent run"]


def test_the_planted_seconds_are_in_the_named_phase(runs: Runs) -> None:
    """The 0.2 s sleeps land in their phase (a lower bound: a sleep never returns early), and the host
    work is no data wait: the data wait never exceeds the time spent in the loader."""
    for arm in ARMS:
        slow, host = runs("slow-data", arm)[0], runs("host", arm)[0]
        assert slow["phase_seconds_p50"]["data_wait"] >= 0.2 and host["phase_seconds_p50"]["host"] >= 0.2, (
            slow,
            host,
        )
        for a in (slow, host):
            ev = a["evidence"]
            waited = ev["shares"]["data_wait"] * ev["step_seconds_mean"]  # the share is rounded to 1e-4
            assert waited <= ev["loader_seconds_mean"] + 1e-4 * ev["step_seconds_mean"], a
        assert (
            runs("slow-peer", arm)[0]["phase_seconds_p50"]["comm_exposed"] >= 0.1
        )  # rank 0 waits for rank 1


def test_a_slow_peer_s_victim_keeps_its_waits_undecided_without_a_straggler_verdict(runs: Runs) -> None:
    """With the detectors off nobody judges whether rank 0's exposed communication is its own or a wait
    for rank 1: none of it is productive, none a wait for a culprit; it stays undecided (its 0.2 s a
    step, less what the shared cores blur)."""
    for arm in ARMS:
        runs("slow-peer", arm)
        led = runs.goodput[("slow-peer", arm)][0]
        assert led["wait_by_culprit"] == {} and "wait" not in led["lost_seconds"], (arm, led)
        assert led["undecided_seconds"] >= 6 * 0.2 * 0.8, (arm, led)
