"""A plain DDP program (tests/zerocode_scripts/faulty_ddp.py: gloo, CPU, AdamW, no hpar_agent) under
``hpar-agent run``, with one planted fault: the culprit is named by the events, the closing lines and,
for a hang, by torch's own flight-recorder analyser too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpar_agent import rankstate
from testkit.zerocode import clean_env, run_cmd

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parents[1] / "zerocode_scripts"
SCRIPT = SCRIPTS / "faulty_ddp.py"


def _torchrun(nproc: int, *args: str, script: Path = SCRIPT) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def _alerts(run_dir: Path, name: str, state: str = "firing") -> dict[int, dict[str, Any]]:
    """rank -> its first ``name`` event in ``state``."""
    out: dict[int, dict[str, Any]] = {}
    for path in run_dir.glob("events.rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("kind") == "alert" and e.get("alert") == name and e.get("state") == state:
                out.setdefault(int(e["rank"]), e)
    return out


def _names_only(run_dir: Path, slow: list[int]) -> None:
    """Every Straggler event names exactly ``slow``, or, while a rank's view holds fewer healthy ranks than
    slow ones (a peer not measured yet), nobody with the split ("no majority") whose slower side is slow
    ranks only; each rank's last event names ``slow``."""
    last: dict[int, list[int]] = {}
    for path in run_dir.glob("events.rank*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("alert") != "Straggler" or e.get("state") not in ("firing", "updated"):
                continue
            d = e["details"]
            if d["culprits"] != slow:
                assert d["culprits"] == [] and d["culprit_unknown"].startswith("no majority"), d
                assert set(d["split"]["slower"]) <= set(slow) and not set(d["split"]["faster"]) & set(slow), d
            last[int(e["rank"])] = d["culprits"]
    assert last and all(c == slow for c in last.values()), last


def _run(
    tmp: Path, name: str, nproc: int, *args: str, timeout: float = 240, script: Path = SCRIPT
) -> tuple[Path, str]:
    run_dir = tmp / name
    proc = subprocess.run(
        run_cmd(_torchrun(nproc, *args, script=script)),
        env=clean_env(run_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return run_dir, proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    return {}


def _once(
    runs: dict[str, tuple[Path, str]], tmp: pytest.TempPathFactory, name: str, *args: Any
) -> tuple[Path, str]:
    if name not in runs:
        runs[name] = _run(tmp.mktemp(name), name, *args)
    return runs[name]


def test_a_hang_names_the_rank_not_in_the_collective_and_what_it_is_doing(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rank 2 sleeps before its backward at step 40; ranks 0, 1, 3 wait in the DDP all-reduce. A 20 s
    process-group timeout makes Hang fire at 16 s (80 %), on every rank."""
    run_dir, out = _once(
        runs, tmp_path_factory, "hang", 4, *"200 --fault sleep --rank 2 --at 40 --timeout-s 20".split()
    )
    hangs = _alerts(run_dir, "Hang")
    assert sorted(hangs) == [0, 1, 2, 3], out[-3000:]
    for r, e in hangs.items():
        d = e["details"]
        assert d["culprits"] == [2] and d["kind"] == "missing" and d["victims"] == [0, 1, 3], (r, d)
        assert d["role"] == ("culprit" if r == 2 else "victim")
        (wait,) = d["waits"]
        assert (wait["op"], wait["waiting"], wait["missing"]) == ("all_reduce", [0, 1, 3], [2])
    assert any(
        "faulty_ddp.py" in f and "time.sleep(3600)" in f for f in hangs[2]["details"]["stack"]
    )  # its own py-spy
    line = next(x for x in out.splitlines() if x.startswith("  culprit:"))
    assert line.startswith("  culprit: rank 2 (Hang: not in default_pg all_reduce #"), out[-3000:]
    assert "time.sleep(3600)" in line


def test_the_ranks_a_hang_ends_by_timeout_are_its_victims_not_a_second_culprit(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """After Hang fired, ranks 0, 1, 3 die of gloo's timeout and rank 2 sees them go: their endings are
    the hang's consequence. One culprit line, for rank 2; RankGone names none of them."""
    run_dir, out = _once(
        runs, tmp_path_factory, "hang", 4, *"200 --fault sleep --rank 2 --at 40 --timeout-s 20".split()
    )
    named = [x for x in out.splitlines() if x.startswith("  culprit")]
    assert len(named) == 1 and named[0].startswith("  culprit: rank 2 (Hang"), out[-3000:]
    for e in _alerts(run_dir, "RankGone").values():
        assert not set(e["details"]["culprits"]) & {0, 1, 3}, e["details"]
    assert any(x.startswith("  first to end abnormally: rank ") for x in out.splitlines()), out[-3000:]


@pytest.mark.parametrize(
    ("schedule", "stages", "waits"),
    [
        ("GPipe", "{r}", {(3, "recv", 2), (0, "recv", 1)}),
        ("InterleavedZeroBubble", "{r},{r4}", {(3, "recv", 2), (1, "recv", 0), (0, "recv", 3)}),
    ],
    ids=["gpipe", "zero-bubble"],
)
def test_a_pipeline_hang_names_the_stage_the_chain_of_waits_ends_at(
    tmp_path: Path, schedule: str, stages: str, waits: set[tuple[int, str, int]]
) -> None:
    """A plain pipeline program, 4 ranks: rank 2 sleeps at step 20. GPipe (a stage a rank: stage 3 waits
    for its activations, stage 1 (in its send, then its recv) for it, stage 0 for stage 1) and a
    zero-bubble schedule (two stages a rank, looped: rank 0's stage 4 waits for rank 3, which waits for
    rank 2; its input backward is ``autograd.grad`` over the stage's input): every rank's Hang names rank
    2 with its own line from py-spy, before gloo's 12 s timeout ends the others, and the run names one
    culprit."""
    run_dir, out = _run(
        tmp_path,
        "pipeline",
        4,
        *f"60 --sleep-rank 2 --at 20 --timeout-s 12 --schedule {schedule}".split(),
        script=SCRIPTS / "faulty_gpipe.py",
    )
    hangs = _alerts(run_dir, "Hang")
    assert sorted(hangs) == [0, 1, 2, 3], out[-3000:]
    for r, e in hangs.items():
        d = e["details"]
        assert (d["kind"], d["culprits"], d["victims"]) == ("missing", [2], [0, 1, 3]), (r, d)
        assert e["threshold"] == pytest.approx(9.6) and e["value"] < 12.0  # 80 % of the pg timeout
        p2p = {(r, w["op"], w["peer"]) for w in d["waits"] for r in w["waiting"]}
        assert waits <= p2p, d["waits"]
    assert any("faulty_gpipe.py" in f and "time.sleep(3600)" in f for f in hangs[2]["details"]["stack"])
    for r in range(4):  # the program's own PipelineStage says each rank's stage (no mesh, no HPAR_PP_STAGE)
        assert hangs[r]["pp_stage"] == r, hangs[r]
        summary = json.loads((run_dir / f"summary.rank{r}.json").read_text())
        topo = summary["topology"]
        assert (summary["pp_stage"], topo["pp"], topo["pp_rank"], topo["pp_stages"], topo["dp"]) == (
            r,
            "4",
            str(r),
            stages.format(r=r, r4=r + 4),
            "1",
        ), topo
        assert summary["components"]["pipeline"]["schedule"] == f"Schedule{schedule}"
    named = [x for x in out.splitlines() if x.startswith("  culprit")]
    assert len(named) == 1 and named[0].startswith("  culprit: rank 2 (Hang: "), out[-3000:]
    assert "point to point" in named[0] and "time.sleep(3600)" in named[0]


def test_torchs_own_analyser_names_the_same_rank(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    run_dir, _ = _once(
        runs, tmp_path_factory, "hang", 4, *"200 --fault sleep --rank 2 --at 40 --timeout-s 20".split()
    )
    proc = subprocess.run(
        [sys.executable, "-m", "hpar_agent.tools.cli", "fr-trace", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "Not all ranks joining collective" in proc.stdout and "missing ranks: {2}" in proc.stdout, (
        proc.stdout
    )


def test_a_killed_rank_is_named_first_not_the_first_to_notice(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """On gloo the others crash at once (connection reset); torchrun's summary blames whichever it saw first."""
    _run_dir, out = _once(
        runs, tmp_path_factory, "kill", 4, "200", "--fault", "SIGKILL", "--rank", "2", "--at", "40"
    )
    line = next((x for x in out.splitlines() if x.startswith("  culprit:")), "")
    assert line.startswith("  culprit: rank 2, the first to end abnormally: "), out[-3000:]
    assert ("killed by signal 9 (SIGKILL)" in line or "died without exiting" in line) and "at step 40" in line


def test_a_stopped_rank_is_named_within_ten_seconds_while_the_others_wait(tmp_path: Path) -> None:
    """Rank 2 stops itself (SIGSTOP) at step 40, a few seconds in: alive, silent, its peers in the
    all-reduce. RankGone fires on them naming it; then the test kills it and the job ends."""
    run_dir = tmp_path / "stop"
    proc = subprocess.Popen(
        run_cmd(_torchrun(4, "200", "--fault", "SIGSTOP", "--rank", "2", "--at", "40", "--step-s", "0.1")),
        env=clean_env(run_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        gone: dict[int, dict[str, Any]] = {}
        while time.time() < deadline and len(gone) < 3:
            time.sleep(0.5)
            gone = _alerts(run_dir, "RankGone") if run_dir.exists() else {}
        rec = rankstate.read(str(run_dir / "state.rank2"))
        assert rec is not None and rec.steps == 40
        assert sorted(gone) == [0, 1, 3]
        for e in gone.values():
            assert e["details"]["culprits"] == [2] and e["details"]["ranks"]["2"]["process"] == "stopped"
        named_after = min(e["ts"] for e in gone.values()) - rec.last_step_ns / 1e9
        assert named_after <= 10.0, named_after
        os.kill(rec.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "culprit: rank 2 (RankGone: rank 2 at step" in err, err[-3000:]


def test_a_slow_half_of_eight_ranks_is_named_whole(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Ranks 4-7 sleep 60 ms more every step: every rank's step time is the same (the fast ones wait in
    the all-reduce), but the slow ones arrive late at every collective."""
    run_dir, out = _once(runs, tmp_path_factory, "slow", 8, "300", "--slow", "4,5,6,7", "--slow-s", "0.06")
    slow = _alerts(run_dir, "Straggler")
    assert sorted(slow) == [4, 5, 6, 7], out[-3000:]
    _names_only(run_dir, [4, 5, 6, 7])
    assert "  culprit: ranks 4, 5, 6, 7 (Straggler" in out


def test_every_other_rank_slow_under_a_dozen_buckets_a_step_names_exactly_those(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Ranks 1, 3, 5, 7 sleep 60 ms more every step, in a DDP model whose gradients go in about a dozen
    all-reduces a step: each slow rank's delay counts once a step, not once a bucket, and no fast rank,
    read by slow and fast ranks alike, is named."""
    run_dir, out = _once(
        runs, tmp_path_factory, "every-other", 8, *"120 --slow 1,3,5,7 --slow-s 0.06 --buckets 12".split()
    )
    slow = _alerts(run_dir, "Straggler")
    assert sorted(slow) == [1, 3, 5, 7], out[-3000:]
    _names_only(run_dir, [1, 3, 5, 7])
    assert "  culprit: ranks 1, 3, 5, 7 (Straggler" in out


def test_one_slow_rank_under_a_dozen_buckets_a_step_is_named_alone(
    runs: dict[str, tuple[Path, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_dir, out = _once(
        runs, tmp_path_factory, "one-slow", 4, *"100 --slow 2 --slow-s 0.06 --buckets 12".split()
    )
    slow = _alerts(run_dir, "Straggler")
    assert sorted(slow) == [2], out[-3000:]
    assert slow[2]["details"]["culprits"] == [2] and slow[2]["value"] > 0.25
    assert "culprit_gpu" not in slow[2]["details"]  # CPU ranks publish no GPU health: nothing to quote
    assert "  culprit: rank 2 (Straggler" in out


SLOW_STAGES = {  # name -> (ranks, faulty_gpipe.py's arguments), run together by ``slow_stages``
    "pp4": (4, "300 --slow-rank 2 --slow-ms 60 --slow-from 100"),  # stage 2 slower from step 100
    "dp2xpp2": (4, "250 --dp 2 --slow-rank 3 --slow-ms 60"),  # replica 1's stage 1, from the start
    "by-design": (4, "300 --heavy-last-ms 15"),  # the last stage works 15 ms more, from the start
}


@pytest.fixture(scope="session")
def slow_stages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The three GPipe runs of ``SLOW_STAGES``, started together (12 small CPU ranks)."""
    tmp = tmp_path_factory.mktemp("slow-stages")
    procs = {}
    for name, (nproc, args) in SLOW_STAGES.items():
        procs[name] = subprocess.Popen(
            run_cmd(_torchrun(nproc, *args.split(), script=SCRIPTS / "faulty_gpipe.py")),
            env=clean_env(tmp / name),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=480)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        out[name] = (tmp / name, err)
    return out


def _verdicts(run_dir: Path) -> dict[int, str]:
    return {
        r: json.loads((run_dir / f"summary.rank{r}.json").read_text())["components"]["anatomy"]["verdict"]
        for r in range(4)
    }


def test_a_pipeline_stage_that_became_slower_is_named_and_its_neighbours_are_pipeline_bound(
    slow_stages: dict[str, tuple[Path, str]],
) -> None:
    """A plain GPipe program, 4 stages: stage 2 works 60 ms more a step from step 100. Its neighbours
    wait for it in p2p (their waits, not their work); its own work grew past its baseline: Straggler
    names rank 2 alone, and the stages that wait are pipeline-bound, not host- or compute-bound."""
    run_dir, out = slow_stages["pp4"]
    slow = _alerts(run_dir, "Straggler")
    assert sorted(slow) == [2], out[-3000:]
    assert slow[2]["details"]["culprits"] == [2] and slow[2]["details"]["stage_changed"] == [2]
    named = [x for x in out.splitlines() if x.startswith("  culprit")]
    assert named == [named[0]] and named[0].startswith("  culprit: rank 2 (Straggler: their pipeline"), out
    verdicts = _verdicts(run_dir)
    assert [verdicts[r] for r in (0, 1, 3)] == ["pipeline-bound"] * 3, verdicts
    assert verdicts[2] == "slow-rank", verdicts
    for r in range(4):  # each stage's chunks timed, though the program never calls watch_pipeline()
        pipe = json.loads((run_dir / f"summary.rank{r}.json").read_text())["components"]["pipeline"]
        assert {f"{r}/forward", f"{r}/backward"} <= set(pipe["chunk_seconds_p50"]), pipe
        assert pipe["bubble_ratio_mean"] is not None, pipe


def test_a_slow_stage_of_one_replica_is_named_against_its_replica_not_its_waiting_neighbour(
    slow_stages: dict[str, tuple[Path, str]],
) -> None:
    """dp2 x pp2 (rank = replica * 2 + stage): rank 3, replica 1's stage 1, works 60 ms more a step
    from the start. Rank 2, its stage 0, waits for its gradients and so reaches its all-reduce late;
    net of that p2p wait it is on time: rank 3 is named alone, against its replica rank 1. Rank 1
    waits for it in the gradient all-reduce: its verdict says so (a victim), and only rank 3 is said
    to hold the others back."""
    from hpar_agent.tools.summary import _holding, load_rank_summaries

    run_dir, out = slow_stages["dp2xpp2"]
    slow = _alerts(run_dir, "Straggler")
    assert sorted(slow) == [3], out[-3000:]
    assert slow[3]["details"]["culprits"] == [3]
    named = [x for x in out.splitlines() if x.startswith("  culprit")]
    assert named == [named[0]] and named[0].startswith("  culprit: rank 3 (Straggler"), out[-3000:]
    verdicts = _verdicts(run_dir)
    assert (verdicts[1], verdicts[2], verdicts[3]) == ("waits-for-slow-rank", "pipeline-bound", "slow-rank")
    assert _holding(load_rank_summaries(run_dir), "anatomy") == ["3"], verdicts


def test_a_stage_slower_by_design_is_no_culprit(slow_stages: dict[str, tuple[Path, str]]) -> None:
    """The last of 4 stages works 15 ms more a step from the start: the others wait for it every step,
    as designed; its work never changed against its baseline. No Straggler, no culprit."""
    run_dir, out = slow_stages["by-design"]
    assert _alerts(run_dir, "Straggler") == {}, out[-3000:]
    assert not [x for x in out.splitlines() if x.startswith("  culprit")], out[-3000:]
