"""Where the time went, on real processes (``tests/zerocode_scripts/goodput_causes.py``): a slow DataLoader,
one slow rank of 4 under torchrun (gloo, DDP), a function recompiled every step, and
torch.distributed.checkpoint every 4 steps. Each run's planted cause is its largest loss after startup
(the imports of a few-second program), the slow rank is named, and every rank's causes add up to its
wall time, which spans the whole program. And a job under ``torchrun --max-restarts 1`` whose first
attempt crashes (``goodput_restart.py``): its accounting spans both attempts, with the restart between
them and the steps done again. A plain pipeline program (``faulty_gpipe.py``) that evaluates through its
schedule between steps: the evaluation is host time on every stage. The six runs start together and
share one fixture."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpar_agent.tools.goodput_view import closing_line
from hpar_agent.tools.report import render
from hpar_agent.tools.run_files import load_run
from testkit.zerocode import clean_env, run_cmd, summaries

pytestmark = pytest.mark.distributed

SCRIPTS = Path(__file__).resolve().parents[1] / "zerocode_scripts"
SCRIPT = SCRIPTS / "goodput_causes.py"
#: cause -> (ranks, steps)
RUNS = {"slow-data": (1, 8), "recompile": (1, 6), "checkpoint": (1, 8), "slow-rank": (4, 60)}
RESTART_STEPS = 16  # the crash comes before step 10; the second attempt resumes at 8
SLOW = 2  # the script's slow rank
PP_EVAL = "30 --eval-at 10 --eval-batches 80"  # faulty_gpipe.py: ~2 s of evaluation before step 10


class Run:
    def __init__(self, base: Path) -> None:
        self.run_dir, self.out = base / "run", base / "out"
        self.out.mkdir(parents=True)
        self.text = ""  # what the program printed

    def ledgers(self) -> dict[int, dict[str, Any]]:
        return {r: s["components"]["goodput"] for r, s in summaries(self.run_dir).items()}

    def results(self) -> dict[int, dict[str, Any]]:
        return {
            int(p.stem.split("rank")[-1]): json.loads(p.read_text())
            for p in self.out.glob("result.rank*.json")
        }


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("goodput")
    out, procs = {}, {}
    for cause, (world, steps) in RUNS.items():
        run = out[cause] = Run(base / cause)
        head = [sys.executable]
        if world > 1:
            head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        env = clean_env(run.run_dir, HPAR_METRICS_PORT="-1", HPAR_TRACES="none", HPAR_FR_INTERVAL="1")
        procs[cause] = subprocess.Popen(
            [*head, str(SCRIPT), cause, str(steps), str(run.out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    run = out["restart"] = Run(base / "restart")
    procs["restart"] = subprocess.Popen(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
            *["--max-restarts", "1", str(SCRIPTS / "goodput_restart.py"), str(RESTART_STEPS), str(run.out)],
        ],
        env=clean_env(run.run_dir, HPAR_METRICS_PORT="-1", HPAR_TRACES="none"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = out["pp-eval"] = Run(base / "pp-eval")
    procs["pp-eval"] = subprocess.Popen(
        run_cmd([*[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
                 str(SCRIPTS / "faulty_gpipe.py"), *PP_EVAL.split()]),
        env=clean_env(run.run_dir, HPAR_METRICS_PORT="-1", HPAR_TRACES="none"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    for cause, proc in procs.items():
        text, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, (cause, text[-3000:])
        out[cause].text = text
    return out


def _lost(led: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in led["lost_seconds"].items() if k != "startup"}


@pytest.mark.parametrize("cause", list(RUNS))
def test_causes_add_up_to_the_wall_time_of_the_whole_program(runs: dict[str, Run], cause: str) -> None:
    run = runs[cause]
    ledgers, results = run.ledgers(), run.results()
    assert sorted(ledgers) == sorted(results) == list(range(RUNS[cause][0]))
    for rank, led in ledgers.items():
        total = led["productive_seconds"] + sum(led["lost_seconds"].values())
        assert abs(total - led["wall_seconds"]) <= 0.01 * led["wall_seconds"], (rank, led)
        assert led["undecided_seconds"] == 0 and led["steps_pending"] == 0, led
        res = results[rank]
        # from before the program's first line to its detach: nothing of the program left out
        assert led["start"] <= res["t0"] and res["t_detach"] <= led["end"] <= res["t_end"], (led, res)
        assert led["steps"] == RUNS[cause][1], led
        # the program's set-up after attach, to its loop, is startup, whether or not the model was known
        # before its first step (found at the first optimizer step when there is no DDP wrapper)
        assert led["lost_seconds"]["startup"] >= res["t_loop"] - res["t0"] - 0.02, (led, res)


def test_a_slow_loader_is_data_wait(runs: dict[str, Run]) -> None:
    led = runs["slow-data"].ledgers()[0]
    lost = _lost(led)
    assert max(lost, key=lost.__getitem__) == "data_wait", led
    # every item sleeps 0.25 s in the loader, the first one too (before the model is known: the agent
    # finds it at the first optimizer step); on 2 loaded cores one item's wait sometimes goes uncounted
    # (1.79 s and 1.82 s, in the clean-clone CI and once in 4 runs beside 2 busy loops): 7 of 8 asked
    assert lost["data_wait"] >= 7 * 0.25, led


def test_the_ranks_waiting_for_a_slow_rank_name_it(runs: dict[str, Run]) -> None:
    ledgers = runs["slow-rank"].ledgers()
    for rank, led in ledgers.items():
        lost = _lost(led)
        if rank == SLOW:
            assert "wait" not in lost and led["wait_by_culprit"] == {}, led
            continue
        assert max(lost, key=lost.__getitem__) == "wait", (rank, led)
        assert set(led["wait_by_culprit"]) == {str(SLOW)}, (rank, led)
        assert led["wait_by_culprit"][str(SLOW)] > led["productive_seconds"], (rank, led)
    line = closing_line(summaries(runs["slow-rank"].run_dir).values())
    assert line is not None and f"waiting for rank {SLOW} " in line, line
    page = render(load_run(runs["slow-rank"].run_dir), runs["slow-rank"].out)
    assert "<h2>Where the time went</h2>" in page and '"fig-goodput"' in page and line in page


def test_recompiles_are_compile_time(runs: dict[str, Run]) -> None:
    run = runs["recompile"]
    led = run.ledgers()[0]
    lost = _lost(led)
    assert max(lost, key=lost.__getitem__) == "compile", led
    comp = summaries(run.run_dir)[0]["components"]["compile"]
    assert comp["recompiles"] and comp["recompiles"][0]["count"] >= 4, comp
    # the same compiles the compile collector timed (its total sums them; the ledger takes their union)
    assert lost["compile"] == pytest.approx(comp["compile_seconds_total"], rel=0.1), (led, comp)


def test_checkpoints_are_found_without_user_code(runs: dict[str, Run]) -> None:
    run = runs["checkpoint"]
    led, res = run.ledgers()[0], run.results()[0]
    assert res["ckpt_seconds"] > 0
    # two saves and two loads, timed inside the program and by the agent's wrappers
    assert led["lost_seconds"]["checkpoint"] == pytest.approx(res["ckpt_seconds"], rel=0.2, abs=0.02), (
        led,
        res,
    )


def test_a_restarted_job_keeps_the_first_attempts_time(runs: dict[str, Run]) -> None:
    run = runs["restart"]
    ledgers, results = run.ledgers(), run.results()
    assert sorted(ledgers) == sorted(results) == [0, 1]
    for rank, led in ledgers.items():
        assert results[rank] == {"attempt": 1, "start": 8}  # the second attempt resumed at step 8
        assert led["attempts"] == 2, led
        # 10 steps before the crash, 8 after resuming: both attempts' steps, and their time
        assert led["steps"] == 18, led
        lost = led["lost_seconds"]
        assert lost["restart"] > 0 and lost["recomputed"] > 0, led
        total = led["productive_seconds"] + sum(lost.values())
        assert abs(total - led["wall_seconds"]) <= 0.01 * led["wall_seconds"], led
        assert led["wall_seconds"] == pytest.approx(led["end"] - led["start"], rel=0.01), led


def test_an_evaluation_through_the_pipeline_schedule_is_host_time_on_every_stage(
    runs: dict[str, Run],
) -> None:
    """``schedule.eval()`` runs the stages' forward chunks: they are no training step's compute (they
    were productive time, and the last stage's bubble), and the evaluation is host time on each stage."""
    run = runs["pp-eval"]
    evaluated = {int(r): float(s) for r, s in re.findall(r"rank (\d+): evaluated for ([\d.]+) s", run.text)}
    ledgers = run.ledgers()
    assert sorted(evaluated) == sorted(ledgers) == [0, 1], run.text[-3000:]
    for rank, led in ledgers.items():
        assert led["steps"] == 30, led
        # the evaluation (~1.6 s): at least 90 % of it, whatever a loaded machine does at its edges (the
        # last stage's host time ends at its last evaluation chunk, before the program's own clock read)
        assert led["lost_seconds"].get("host", 0.0) >= 0.9 * evaluated[rank], (rank, evaluated, led)
