"""The reference trainer's runs for the agent's tools: the demo and the fault matrix, as trainer argv.

``hpar-agent demo`` and ``hpar-agent diagnose`` import this lazily and never spell a trainer flag: which
injection must raise which alert, the layout each needs and how long it runs are the trainer's
knowledge, kept next to its flags (``config.py``) so a renamed flag cannot leave the agent behind.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence

from hpar_trainer.config import NEEDS_DDP, TrainConfig, parse_args

#: injection -> the alert that must fire for it (the trainer's ``--inject`` names).
EXPECTED: dict[str, str] = {
    "recompile-storm": "RecompileStorm",
    "graph-break": "GraphBreaks",
    "divergent-graph": "CompileDivergence",
    "ddp-nesting": "ReplicaDivergence",
    "tp-grad-skip": "ReplicaDivergence",
    "dtype-mismatch": "CollectiveMismatch",
    "compile-leak": "MemoryLeak",
    "tensor-leak": "MemoryLeak",
    "straggler": "Straggler",
    # gloo's flight recorder has no durations: a rank late to the dp all-reduce is seen by arrival skew.
    "slow-collective": "Straggler",
    "hang": "Hang",
    "hsdp-replicate-skip": "ReplicaDivergence",
}
#: what the matrix says under the table for modes whose CPU result needs a word.
NOTES: dict[str, str] = {
    "hsdp-replicate-skip": "HSDP 2 x 2 (FSDP2): rank 3 keeps its own reduce-scatter output instead of the "
    "replicate all-reduce result (it still joins every collective); it and rank 1 (same shard, other replica) "
    "drift: it fires on both and, a 1-1 split, names no culprit; ranks 0 and 2 (shard 0) stay quiet. Needs 4 ranks.",
    "slow-collective": "every rank in dp with DDP. The inject rank arrives late at every dp all-reduce: "
    "arrival skew names it (Straggler). CollectiveLatencyHigh judges the transfer (a timed op's duration less "
    "the wait for the last member to arrive), so the peers' long waits do not raise it; gloo records no "
    "collective durations anyway.",
    "dtype-mismatch": "every rank in dp with DDP (DDP cannot wrap TP's DTensor parameters): the inject rank reduces "
    "in bf16 padded to the fp32 byte size, so gloo completes and the gradients are silently corrupted "
    "(loss NaN); the flight recorder shows its BFloat16 entry against its peers' Float.",
    "hang": "every rank is stuck, so Hang fires on all four at 80% of the 20 s pg timeout, before gloo "
    "aborts (by design later than 10 s: a checkpoint-like pause of 12 s must not fire it); rank 3's details "
    "and stacks show it in a default_pg barrier, its peers in dp/tp all-reduces; every rank exits after the "
    "pg timeout.",
    "ddp-nesting": "all ranks train the detached block unsynchronised: every dp pair drifts (it fires on both of a "
    "pair and, a 1-1 split, names no culprit); GradSyncIncomplete fires on every rank from the first judged step, its value the "
    "share of the gradient reduced over dp.",
    "tp-grad-skip": "all ranks skip the sync: every tp pair drifts (it fires on both of a pair, a 1-1 split names no culprit); "
    "GradSyncIncomplete fires on every rank with coverage.tp 0.0 (gradients sampled from step 1).",
    "compile-leak": "a new code object compiled per microbatch: CompiledGraphsGrowing names "
    "`_leaky_graph trainer/inject.py:<line>` first (2 ranks: step 10, MemoryLeak at step 30 with a py-spy "
    "record profile); the leaked graphs are graphs its peers never compile, so CompileDivergence may name "
    "the inject rank too.",
}

#: modes that need a replicate x shard mesh (FSDP2 HSDP): 4 ranks, 2 replicas of 2 shards. The comm-hook
#: modes (``config.NEEDS_DDP``) need DDP, which cannot wrap TP's DTensor parameters: every rank in dp
#: (4 ranks: a 3-1 majority names the odd rank).
NEEDS_HSDP = {"hsdp-replicate-skip"}
#: modes that need tp peers (on 2 ranks: tp2 instead of dp2).
NEEDS_TP = {"tp-grad-skip"}
COMMON = ["--pp", "1", "--compile", "aot_eager", "--log-every", "10"]
#: steps per mode (default 100): leaks need warm-up plus a 20-step trend, and the cross-rank detectors
#: compare over the store every 3 s and confirm on a second exchange: about 10 s, which fast steps outrun.
STEPS = {"hang": 12}
DEFAULT_STEPS = 100
#: the step injections start at in the fault matrix (the trainer's default ``--inject-step``).
INJECT_STEP = 3
#: modes built into the model or the step from step 0 (the others start at ``INJECT_STEP``).
FROM_START = {"divergent-graph", "ddp-nesting", "tp-grad-skip"}

#: the demo: 4 CPU ranks, tp2 x pp2 with compiled blocks.
DEMO_STEPS = 40
DEMO_ARGS = (
    f"--dp 1 --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --compile aot_eager --steps {DEMO_STEPS} "
    "--log-every 5"
).split()


def layout(injection: str, nproc: int) -> list[str]:
    """The default layout of a mode on ``nproc`` ranks: 4 ranks dp2 x tp2 (dp peers, tp peers, compiled
    blocks), every rank in dp under DDP for the comm-hook modes; on 2 ranks dp2, or tp2 for NEEDS_TP.
    Trainer flags given later on the command line win (e.g. ``--device cuda``)."""
    if injection in NEEDS_HSDP:
        return ["--dp-replicate", "2", "--dp-shard", str(max(2, nproc // 2)), "--tp", "1", *COMMON]
    if injection in NEEDS_DDP:
        return ["--dp", str(nproc), "--tp", "1", "--dp-mode", "ddp", *COMMON]
    if nproc >= 4 and nproc % 2 == 0:
        return ["--dp", str(nproc // 2), "--tp", "2", *COMMON]
    if injection in NEEDS_TP:
        return ["--dp", "1", "--tp", str(nproc), *COMMON]
    return ["--dp", str(nproc), "--tp", "1", *COMMON]


def diagnose_argv(
    injection: str, nproc: int, *, steps: int = 0, out: str, extra: Sequence[str] = ()
) -> list[str]:
    """Trainer argv of one fault-matrix run: the mode's layout, its steps (``steps`` or the mode's
    default), the injection from ``INJECT_STEP``, the summary at ``out``; ``extra`` flags last (they win)."""
    return [
        *layout(injection, nproc),
        "--steps",
        str(steps or STEPS.get(injection, DEFAULT_STEPS)),
        "--inject",
        injection,
        "--inject-step",
        str(INJECT_STEP),
        "--out",
        out,
        *extra,
    ]


def demo_argv(*, steps: int = 0, inject: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """Trainer argv of the demo (without the summary path: see ``with_out``); ``extra`` flags last. With
    an injection and no ``steps``, at least the fault matrix's steps for it: the demo's 40 end before a
    cross-rank detector has judged twice (a straggler was named by nobody)."""
    argv = list(DEMO_ARGS)
    if not steps and inject:
        steps = max(DEMO_STEPS, *(STEPS.get(name, DEFAULT_STEPS) for name in inject))
    if steps:
        argv += ["--steps", str(steps)]
    for name in inject:
        argv += ["--inject", name]
    return [*argv, *extra]


def with_out(argv: Sequence[str], out: str) -> list[str]:
    """``argv`` writing the run's JSON summary (rank 0) and per-rank records next to ``out``."""
    return [*argv, "--out", out]


def check(argv: Sequence[str], nproc: int) -> tuple[TrainConfig | None, str | None]:
    """The trainer's own validation of ``argv`` on ``nproc`` ranks, so a bad flag or injection name is
    refused in one line before any rank starts. ``(config, None)`` or ``(None, the error)``; ``--help``
    prints the trainer's help and exits as argparse does."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(list(argv), world_size=nproc), None
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        return None, (err.getvalue().strip().splitlines() or ["invalid trainer flags"])[-1].split(
            "error: ", 1
        )[-1]


def describe(cfg: TrainConfig) -> str:
    """One line naming a run's layout, e.g. ``dp1 x tp2 x pp2, 1f1b, aot_eager``."""
    return f"dp{cfg.dp} x tp{cfg.tp} x pp{cfg.pp}, {cfg.schedule}, {cfg.compile}"
