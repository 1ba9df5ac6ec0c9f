"""The reference trainer on one GPU with the agent attached (inductor, bf16): it trains (the loss goes
down), the agent counts every step, sees the compiles, traces the steps, records no error and raises no
alert in a clean run."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu.conftest import TRAINER
from tests.gpu.helpers import spans


def test_the_trainer_trains_on_a_gpu_and_the_agent_sees_every_step(trainer_runs: dict[str, Path]) -> None:
    run = trainer_runs["clean"]
    record = json.loads((run / "trainer.json").read_text())
    steps = int(TRAINER[TRAINER.index("--steps") + 1])
    losses = [v for v in record["losses"] if v is not None]
    assert len(record["step_times"]) == steps
    assert losses[-1] < losses[0] - 0.2, (losses[0], losses[-1])
    summary = json.loads((run / "summary.rank0.json").read_text())
    assert summary["errors"] == {}, summary["errors"]
    assert summary["topology"]["device"] == "cuda:0"
    comps = summary["components"]
    assert comps["steps"]["steps"] == steps
    assert "inductor" in comps["compile"]["backends"] and comps["compile"]["graphs_compiled"] > 0, comps[
        "compile"
    ]
    assert len(spans(run, "train.step")) >= 0.9 * steps  # every step traced (HPAR_TRACE_EVERY=1)
    events = [json.loads(line) for line in (run / "events.rank0.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("kind") == "alert" and e.get("state") == "firing"]
