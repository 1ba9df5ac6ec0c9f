"""The trainer's scenarios (the demo and the fault matrix as trainer argv) pass the trainer's own
validation: a renamed flag or a changed constraint fails here, not in a 10-minute fault-matrix run."""

from __future__ import annotations

import pytest

from hpar_trainer import scenarios as sc
from hpar_trainer.config import INJECTIONS


def test_the_fault_table_names_only_injections_the_trainer_has():
    assert set(sc.EXPECTED) <= set(INJECTIONS)
    assert set(sc.NOTES) | sc.FROM_START | sc.NEEDS_HSDP | sc.NEEDS_TP | set(sc.STEPS) <= set(sc.EXPECTED)


@pytest.mark.parametrize("injection", sorted(sc.EXPECTED))
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_fault_matrix_run_is_a_valid_trainer_run(injection, nproc):
    if injection in sc.NEEDS_HSDP and nproc < 4:
        pytest.skip("HSDP needs 2 replicas of 2 shards")
    cfg, problem = sc.check(sc.diagnose_argv(injection, nproc, out="run/trainer.json"), nproc)
    assert problem is None and cfg is not None
    assert cfg.inject == [injection] and cfg.inject_step == sc.INJECT_STEP
    assert cfg.steps == sc.STEPS.get(injection, sc.DEFAULT_STEPS) and cfg.out == "run/trainer.json"


def test_layouts_fit_the_rank_count():
    assert sc.layout("tp-grad-skip", 2)[:4] == ["--dp", "1", "--tp", "2"]
    assert sc.layout("straggler", 2)[:4] == ["--dp", "2", "--tp", "1"]
    assert sc.layout("slow-collective", 2)[:6] == ["--dp", "2", "--tp", "1", "--dp-mode", "ddp"]
    assert sc.layout("divergent-graph", 4)[:4] == ["--dp", "2", "--tp", "2"]


def test_flags_given_later_win():
    cfg, _ = sc.check(
        sc.diagnose_argv("straggler", 2, steps=7, out="t.json", extra=["--compile", "eager"]), 2
    )
    assert cfg is not None and (cfg.steps, cfg.compile) == (7, "eager")


def test_the_demo_run():
    cfg, problem = sc.check(sc.with_out(sc.demo_argv(), "d/trainer.json"), 4)
    assert problem is None and cfg is not None
    assert sc.describe(cfg) == "dp1 x tp2 x pp2, 1f1b, aot_eager" and (cfg.steps, cfg.out) == (
        40,
        "d/trainer.json",
    )
    cfg, _ = sc.check(
        sc.demo_argv(steps=5, inject=["straggler", "tensor-leak"], extra=["--schedule", "gpipe"]), 4
    )
    assert cfg is not None and (cfg.steps, cfg.inject, cfg.schedule) == (
        5,
        ["straggler", "tensor-leak"],
        "gpipe",
    )
    # an injection runs at least the fault matrix's steps for it: 40 ended before Straggler judged twice
    steps = [
        getattr(sc.check(sc.demo_argv(inject=[name]), 4)[0], "steps", None) for name in ("straggler", "hang")
    ]
    assert steps == [100, 40]


def test_a_bad_run_is_one_line():
    assert sc.check(sc.demo_argv(inject=["bogus"]), 4) == (
        None,
        "--inject 'bogus' is not one of " + ", ".join(INJECTIONS),
    )
    _cfg, problem = sc.check(sc.demo_argv(), 2)
    assert problem is not None and "WORLD_SIZE is 2" in problem
