"""The fault matrix on CPU ranks: injected failures raise the right alert on the right rank, with evidence,
and a clean run of 200 steps with a checkpoint-like pause raises none.

Six trainer runs serve every test here (module-scoped, about 4 minutes on 2 cores):
- ``combined``: 4 ranks dp2 x tp2, eager compile, with divergent-graph, tp-grad-skip, tensor-leak,
  graph-break and straggler at once (they act on different signals and do not mask each other);
- ``hang``: 4 ranks dp2 x tp2, rank 3 skips step 3's collectives; every rank is stuck until gloo's
  20 s timeout, so Hang must fire on all of them, with stacks and a flight-recorder dump, before that;
- ``pp_hang``, ``dp_pp_hang``: the same hang in 4 ranks tp2 x pp2 (the demo's layout) and dp2 x pp2,
  a tiny model, a 10 s pg timeout: the waits cross the pipeline's send/recv;
- ``ddp``: 2 ranks dp2 under DDP, rank 1's comm hook reduces in bf16 (dtype-mismatch) after sleeping
  (slow-collective): a 1-1 split that only the dtype can attribute;
- ``clean``: 4 ranks dp2 x pp2 (1F1B), a tiny model compiled with aot_eager (compile warm-up on every
  rank), 100 steps, rank 1 starting 10 s late (its peers wait in step 0) and rank 0 pausing 12 s at
  step 60 (a checkpoint-like pause) while the others wait for it in the next collective.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpar_agent import catalogue as cat
from hpar_agent.collectors.verdict import slow_rank_across
from hpar_agent.tools.diagnose import evidence_kind, read_alerts
from hpar_agent.tools.launch import run_trainer

pytestmark = pytest.mark.distributed

DP2_TP2 = ["--dp", "2", "--tp", "2", "--pp", "1", "--log-every", "10"]
#: a tiny pipeline stuck at step 3 with a 10 s pg timeout (Hang at 8 s)
PP_HANG = (
    "--schedule 1f1b --microbatches 4 --steps 8 --inject hang --pg-timeout 10 --log-every 10 "
    "--layers 2 --dim 32 --heads 2 --seq-len 16 --global-batch 8"
).split()
RUNS: dict[str, tuple[int, list[str]]] = {
    # 60 steps (~30 s): Straggler needs entries from full FR reads (once per 5 s slot) confirmed on two
    # exchanges (every 3 s) after warm-up; 40 steps left that a few seconds short on a loaded machine
    "combined": (
        4,
        [
            *DP2_TP2,
            *"--compile eager --steps 60 --inject divergent-graph --inject tp-grad-skip --inject tensor-leak --inject graph-break --inject straggler --inject-delay 0.4".split(),
        ],
    ),
    "hang": (4, [*DP2_TP2, "--steps", "8", "--inject", "hang"]),
    # the demo's layout (tp2 x pp2) and dp2 x pp2: rank 3 waits in a world barrier at step 3; its tp or
    # dp peer waits for it in a collective, the other stage's ranks in the pipeline's send/recv
    "pp_hang": (4, ["--dp", "1", "--tp", "2", "--pp", "2", *PP_HANG]),
    "dp_pp_hang": (4, ["--dp", "2", "--tp", "1", "--pp", "2", *PP_HANG]),
    "ddp": (
        2,
        (
            "--dp 2 --dp-mode ddp --steps 80 --log-every 10 --inject dtype-mismatch --inject slow-collective"
        ).split(),
    ),
    "clean": (
        4,
        (
            "--dp 2 --pp 2 --schedule 1f1b --compile aot_eager --steps 100 "
            "--log-every 50 --layers 2 --dim 32 --heads 2 --seq-len 16 --global-batch 8 "
            "--microbatches 2 --pause-at 60 --pause-seconds 12 --start-delay-rank 1 "
            "--start-delay 10"
        ).split(),
    ),
}
INJECT_STEP = 3  # the trainer's default --inject-step


@dataclass
class Run:
    run_dir: Path
    returncode: int
    output: str
    nproc: int

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert that went firing, from every rank's event log."""
        return read_alerts(self.run_dir)

    def fired(self, alert: str) -> dict[int, dict[str, Any]]:
        """rank -> its first firing event of ``alert``."""
        out: dict[int, dict[str, Any]] = {}
        for a in sorted(self.alerts(), key=lambda a: a["ts"]):
            if a["alert"] == alert:
                out.setdefault(a["rank"], a)
        return out

    def summary(self, rank: int) -> dict[str, Any]:
        return json.loads((self.run_dir / f"summary.rank{rank}.json").read_text())


def _launch(tmp_path_factory: pytest.TempPathFactory, name: str) -> Run:
    nproc, args = RUNS[name]
    run_dir = tmp_path_factory.mktemp("matrix") / name
    run_dir.mkdir()
    env = {
        "HPAR_RUN_DIR": str(run_dir),
        "HPAR_JOB_ID": name,
        "HPAR_METRICS_PORT": "-1",
        "HPAR_TRACES": "none",
    }
    proc = run_trainer(nproc, [*args, "--out", str(run_dir / "trainer.json")], env=env, timeout=400)
    return Run(run_dir, proc.returncode, (proc.stdout or "") + (proc.stderr or ""), nproc)


def _run_fixture(name: str) -> Any:
    """A module-scoped fixture that launches the ``RUNS[name]`` run once for the tests that read it."""

    @pytest.fixture(scope="module", name=name)
    def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
        return _launch(tmp_path_factory, name)

    return run


combined, hang, ddp, clean, pp_hang, dp_pp_hang = (
    _run_fixture(n) for n in ("combined", "hang", "ddp", "clean", "pp_hang", "dp_pp_hang")
)


def _private_files(paths: list[str]) -> None:
    assert paths
    for p in paths:
        assert os.path.getsize(p) > 0, p
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


# ------------------------------------------------------------------------------------------ combined
def test_combined_run_completes(combined: Run) -> None:
    assert combined.returncode == 0, combined.output[-3000:]


def test_divergent_graph_on_the_inject_rank_only(combined: Run) -> None:
    fired = combined.fired("CompileDivergence")
    assert set(fired) == {3}, fired
    # the verdict compares the peers whose fingerprints it had (one may not have published yet, or be
    # caught mid-compile): rank 3 differs from every one of them
    fps = fired[3]["details"]["fingerprints"]
    peers = {fps[r] for r in ("0", "1", "2") if r in fps}
    assert peers and fps["3"] not in peers, fps
    assert fired[3]["details"]["culprits"] == [3]
    final = {r: combined.summary(r)["components"]["compile"]["fingerprint"] for r in range(4)}
    assert len({final[r] for r in (0, 1, 2)}) == 1 and final[3] != final[0], final


def test_tp_grad_skip_on_every_tp_group(combined: Run) -> None:
    fired = combined.fired("ReplicaDivergence")
    assert set(fired) == {0, 1, 2, 3}, fired  # every tp pair drifts apart: no majority, all ranks flagged
    for rank, event in fired.items():
        assert set(event["details"]) - {"culprits", "culprit_unknown"} == {"tp"}, event[
            "details"
        ]  # dp in sync
        assert (
            event["details"]["culprits"] == [] and "no majority" in event["details"]["culprit_unknown"][0]
        )  # 1-1
        tp = event["details"]["tp"]
        assert rank in tp["ranks"] and len(tp["ranks"]) == 2
        assert all("q_norm" in p or "k_norm" in p for p in tp["params"]), tp["params"]
    for rank in range(4):  # the tp gradient-sync coverage says it at once: none of the needed tp sum happened
        gs = combined.summary(rank)["components"]["gradsync"]
        assert gs["tp_coverage"] == 0.0 and gs["tp_judged_steps"][0] == 1, gs
        assert gs["coverage_min"] >= 1.0, gs  # the dp reduction stays whole


def test_tensor_leak_on_the_inject_rank_with_stacks(combined: Run) -> None:
    fired = combined.fired("MemoryLeak")
    assert set(fired) == {3}, fired
    leak = fired[3]
    assert leak["value"] >= 1 << 20 and leak["pp_stage"] == 0
    _private_files(leak["evidence"])
    assert {evidence_kind(p) for p in leak["evidence"]} >= {"pyspy.txt", "pyspy.json"}
    assert "Trainer.run" in Path(next(p for p in leak["evidence"] if p.endswith(".txt"))).read_text()


def test_graph_break_after_warmup_on_every_rank(combined: Run) -> None:
    fired = combined.fired("GraphBreaks")
    assert set(fired) == {0, 1, 2, 3}, fired
    for event in fired.values():
        assert event["step"] >= INJECT_STEP
        assert any("inject.py" in text for text in event["details"]["reasons"].values()), event["details"]


def test_straggler_on_the_inject_rank(combined: Run) -> None:
    fired = combined.fired("Straggler")
    assert 3 in fired and fired[3]["value"] > fired[3]["threshold"], fired
    assert set(fired) == {3}, fired  # rank 2, its tp peer that waits for it, is not blamed for waiting
    assert fired[3]["details"]["culprits"] == [3]
    # the bottleneck verdict names rank 3 as the job's one slow rank (from every rank's summary)
    digests = [(r, 0, combined.summary(r)["components"]["anatomy"]) for r in range(4)]
    slow = slow_rank_across(digests)
    assert slow is not None and slow["rank"] == 3, (slow, [d["evidence"] for *_, d in digests])
    # only rank 3 is slow-rank; its tp peer and its dp replica wait for it: never called slow themselves
    assert [r for r, _s, d in digests if d["verdict"] == "slow-rank"] in ([3], []), digests
    assert all(d["evidence"].get("slow_rank", 3) == 3 for *_, d in digests), digests


# ------------------------------------------------------------------------------------------ hang
def test_hang_fires_on_every_stuck_rank_before_the_job_dies(hang: Run) -> None:
    assert hang.returncode != 0  # gloo aborts every rank after --pg-timeout (20 s)
    fired = hang.fired("Hang")
    assert set(fired) == {0, 1, 2, 3}, hang.output[-3000:]
    for event in fired.values():
        assert event["step"] == INJECT_STEP  # the stuck step
        details = event["details"]
        assert details["timeout_s"] == pytest.approx(16.0)  # 80% of the 20 s pg timeout
        assert details["timeout_s"] < event["value"] < 20.0
        _private_files(event["evidence"])
        assert {evidence_kind(p) for p in event["evidence"]} == {
            "pyspy.txt",
            "pyspy.json",
            "fr-gloo.json",
            "fr-gloo.pickle",
        }
    # the culprit is visible: rank 3 waits in a barrier of the default group, its peers in dp/tp ops
    assert fired[3]["details"]["pg"] == "default_pg"
    assert {fired[r]["details"]["pg"] for r in (0, 1, 2)} <= {"dp", "tp"}
    stacks = Path(next(p for p in fired[3]["evidence"] if p.endswith(".txt"))).read_text()
    assert "barrier" in stacks, stacks
    # and named: every rank's event calls it a desync (ranks in different collectives, each side's op) whose
    # culprit is rank 3, the minority of the default group (in a barrier the others never reach)
    for r, event in fired.items():
        details = event["details"]
        assert (details["kind"], details["culprits"]) == ("desync", [3]), (r, details)
        assert details["sides"]["default_pg: barrier"] == [3]
        assert sorted(
            x for side, ranks in details["sides"].items() if side != "default_pg: barrier" for x in ranks
        ) == [0, 1, 2]
    assert any("barrier" in frame for frame in fired[3]["details"]["stack"])


@pytest.mark.parametrize("layout", ["pp_hang", "dp_pp_hang"])
def test_a_pipeline_hang_names_the_rank_its_waits_end_at(layout: str, request: pytest.FixtureRequest) -> None:
    """tp2 x pp2 (the demo's layout) and dp2 x pp2: rank 3 sits in a world barrier. Its peer in its
    stage waits for it in a collective, the other stage's ranks wait in the pipeline's send/recv (p2p
    edges of the wait-for graph): every rank names rank 3 alone, before gloo's 10 s timeout."""
    run: Run = request.getfixturevalue(layout)
    assert run.returncode != 0
    fired = run.fired("Hang")
    assert set(fired) == {0, 1, 2, 3}, run.output[-3000:]
    for r, event in fired.items():
        d = event["details"]
        assert d["culprits"] == [3] and d["victims"] == [0, 1, 2], (r, d)
        assert event["threshold"] == pytest.approx(8.0) and event["value"] < 10.0
        assert any(w.get("p2p") for w in d["waits"]), d["waits"]  # some rank waits point to point
    assert any("barrier" in frame for frame in fired[3]["details"]["stack"])


# ------------------------------------------------------------------------------------------ ddp
def test_dtype_mismatch_attributed_to_the_bf16_rank(ddp: Run) -> None:
    assert ddp.returncode == 0, ddp.output[-3000:]  # equal byte counts: gloo reduces garbage silently
    fired = ddp.fired("CollectiveMismatch")
    assert set(fired) == {1}, fired  # a 1-1 split, broken by the reduction dtype
    event = fired[1]
    # the local dtype check needs only the flight recorder; the bound leaves room for a loaded machine,
    # where full FR reads (once per fr_interval slot) fall several fast steps apart
    assert 0 <= event["step"] - INJECT_STEP <= 40  # within one 5 s FR slot plus an exchange at fast steps
    assert event["details"]["param_bits"] == 32
    assert any(e["dtypes"] == "BFloat16" for e in event["details"]["low_precision"]), event["details"]
    _private_files(event["evidence"])
    assert [evidence_kind(p) for p in event["evidence"]] == ["fr-gloo.json", "fr-gloo.pickle"]
    dump = json.loads(Path(event["evidence"][0]).read_text())
    assert any(e["input_dtypes"] == ["BFloat16"] for e in dump["entries"])
    # the exchange also saw the peers disagree on the same (pg, seq)
    summary = ddp.summary(1)["components"]["detectors"]["CollectiveMismatch"]
    assert summary["fired"] >= 1 and summary["active"]


def test_slow_collective_shows_as_the_late_rank(ddp: Run) -> None:
    fired = ddp.fired("Straggler")
    assert set(fired) == {1}, fired  # gloo has no collective durations: arrival skew names the late rank
    assert ddp.summary(0)["components"]["detectors"]["Straggler"]["value"] < 0.01  # rank 0 only waited


# ------------------------------------------------------------------------------------------ clean
def test_clean_run_with_a_pause_and_a_late_rank_fires_nothing(clean: Run) -> None:
    assert clean.returncode == 0, clean.output[-3000:]
    assert "checkpoint-like pause" in clean.output and "rank 1: starting 10.0s late" in clean.output
    assert clean.alerts() == []
    for rank in range(clean.nproc):
        s = clean.summary(rank)
        assert s["components"]["steps"]["steps"] == 100
        assert (
            s["components"]["steps"]["step_seconds_max"] > 10
        )  # the pause (and the late start) inside a step
        detectors = s["components"]["detectors"]
        assert set(detectors) == set(cat.ALERT_NAMES)
        for name, state in detectors.items():
            assert state["fired"] == 0 and not state["active"], (rank, name, state)
            assert set(state) >= {"value", "threshold", "params"}
    # the cross-rank exchange really compared arrivals: every rank's Straggler judged the run
    judged = [
        clean.summary(rank)["components"]["detectors"]["Straggler"]["judged"] for rank in range(clean.nproc)
    ]
    assert all(n > 0 for n in judged), judged
