"""Command-line flags and the validated training configuration."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
COMPILE_BACKENDS = ("none", "eager", "aot_eager", "inductor")

# name -> one-line description shown in --help; kept next to the flags so docs cannot drift.
INJECTIONS: dict[str, str] = {
    "recompile-storm": "from --inject-step a Python int (the step) that changes every step reaches every "
    "compiled block as a specialised module attribute: one recompile per step until Dynamo's "
    "recompile limit (all ranks; needs --compile)",
    "graph-break": "from --inject-step a .item() inside every compiled block forward breaks the graph: a new "
    "break after warm-up (all ranks; needs --compile)",
    "divergent-graph": "the inject rank adds an extra op (h + zeros_like(h)) to its compiled blocks, so its "
    "graphs differ from its stage peers (needs --compile)",
    "ddp-nesting": "the first block of every stage is detached while DP wraps the stage and re-attached "
    "afterwards, so its parameters are outside DP gradient sync and dp replicas drift (all ranks; dp >= 2)",
    "tp-grad-skip": "the tp all-reduce of the q/k-norm weight grads (replicated params fed by sharded "
    "heads) is skipped, so tp replicas drift (all ranks; tp >= 2)",
    "dtype-mismatch": "from --inject-step the inject rank's DDP comm hook all-reduces gradient buckets in "
    "bf16 (padded to the fp32 byte size) while peers use fp32: the reduction completes and silently "
    "corrupts the gradients (dp >= 2, --dp-mode ddp)",
    "compile-leak": "from --inject-step the inject rank compiles a fresh function (a new code object, eager backend) per "
    "microbatch with --inject-size bytes and keeps both alive: compiled graphs and RSS grow",
    "tensor-leak": "from --inject-step the inject rank keeps --inject-size bytes of tensors alive every step: RSS grows",
    "straggler": "from --inject-step the inject rank sleeps --inject-delay inside its first forward of every step",
    "slow-data": "from --inject-step the inject rank's data source sleeps --inject-delay per batch (a slow "
    "data loader): the rank waits for input, its peers wait for it in the next collective",
    "slow-collective": "from --inject-step the inject rank sleeps --inject-delay before every DP gradient all-reduce "
    "(dp group, DDP comm hook): peers wait inside the collective (dp >= 2, --dp-mode ddp)",
    "hsdp-replicate-skip": "from --inject-step the inject rank drops the result of FSDP's replicate-dimension "
    "gradient all-reduce (it still joins the collective, keeping its own reduce-scatter output), so its "
    "shards drift from their replicas (--dp-replicate >= 2 --dp-shard >= 2)",
    "hang": "at --inject-step the inject rank skips the step's collectives and waits in a world barrier "
    "the peers never reach: every rank fails after --pg-timeout (default 20 s in this mode)",
}
NEEDS_COMPILE = {"recompile-storm", "graph-break", "divergent-graph"}
NEEDS_DDP = {"dtype-mismatch", "slow-collective"}
DP_MODES = ("ddp", "replicate", "fsdp")
MP_DTYPES = ("fp32", "bf16")

EPILOG = (
    "injections (--inject NAME, repeatable; rank = --inject-rank, default the last rank; "
    "step = --inject-step, default 3):\n" + "\n".join(f"  {k:16} {v}" for k, v in INJECTIONS.items())
)


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs; identical on every rank."""

    dp: int = 1
    """Data-parallel degree (outermost mesh dim)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (innermost mesh dim, fastest links)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b or interleaved-1f1b."""
    microbatches: int = 0
    """Pipeline microbatches per step; 0 means 2 * pp."""
    stages_per_rank: int = 2
    """Virtual stages per pp rank for interleaved-1f1b (1 for the other schedules)."""
    dp_mode: str = ""
    """ddp, replicate (composable) or fsdp (FSDP2 fully_shard); empty: fsdp when --dp-replicate/--dp-shard
    is given, else replicate (the one that also works with TP inside a stage)."""
    dp_replicate: int = 0
    """fsdp: replicate degree of HSDP (0: dp / dp_shard, or 1)."""
    dp_shard: int = 0
    """fsdp: shard degree (0: dp / dp_replicate); dp = dp_replicate * dp_shard."""
    mp_param_dtype: str = ""
    """fsdp: MixedPrecisionPolicy param_dtype (compute/all-gather dtype), fp32 or bf16; empty: --dtype."""
    mp_reduce_dtype: str = ""
    """fsdp: MixedPrecisionPolicy reduce_dtype (reduce-scatter/all-reduce dtype); empty: the param dtype."""
    compile: str = "none"
    """torch.compile backend applied per transformer block, or none."""
    dtype: str = "fp32"
    """Parameter/compute dtype: fp32 or bf16."""
    steps: int = 10
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for init and data; same seed gives same losses in every layout."""
    global_batch: int = 16
    """Sequences per step over all dp ranks."""
    seq_len: int = 32
    """Tokens per sequence."""
    layers: int = 4
    """Transformer blocks."""
    dim: int = 64
    """Model width."""
    heads: int = 4
    """Attention heads (divisible by tp)."""
    vocab: int = 128
    """Vocabulary size."""
    lr: float = 3e-3
    """AdamW learning rate."""
    device: str = "auto"
    """auto, cpu or cuda; auto picks cuda when available."""
    log_every: int = 1
    """Log loss and step time every N steps."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s of one rank's accelerator for --dtype, reported to the agent for MFU; 0: unknown."""
    no_agent: bool = False
    """Do not attach the hpar_agent observability agent."""
    pg_timeout: float = 0.0
    """Process-group timeout in seconds; 0 means 300 (20 with --inject hang)."""
    inject: list[str] = field(default_factory=list)
    """Failure injections to reproduce."""
    inject_rank: int = -1
    """Global rank for rank-specific injections; -1 means the last rank."""
    inject_step: int = 3
    """First step an injection is active at (where it applies)."""
    inject_delay: float = 0.2
    """Seconds of delay for straggler / slow-collective."""
    inject_size: int = 4 << 20
    """Bytes leaked per step (tensor-leak) or per microbatch (compile-leak)."""
    pause_at: int = -1
    """Step before which rank 0 makes a checkpoint-like pause, the others waiting for it (-1: never)."""
    pause_seconds: float = 0.0
    """Length of that pause in seconds (every rank stages a copy of its parameters)."""
    start_delay_rank: int = -1
    """Rank that starts training --start-delay seconds after the others (-1: none)."""
    start_delay: float = 0.0
    """Seconds that rank sleeps after setup, before its first step (its peers wait in step 0's collectives)."""
    out: str | None = None
    """JSON summary path (rank 0); every rank also writes <stem>.rank<r>.json."""

    def __post_init__(self) -> None:
        self._resolve_dp()
        if self.microbatches == 0:
            self.microbatches = 2 * self.pp
        if self.schedule != "interleaved-1f1b":
            self.stages_per_rank = 1
        if self.pg_timeout == 0:
            self.pg_timeout = 20.0 if "hang" in self.inject else 300.0
        self._validate()

    def _resolve_dp(self) -> None:
        """dp = dp_replicate * dp_shard in fsdp mode; either factor may be left to the other and --dp."""
        hsdp_flags = self.dp_replicate > 0 or self.dp_shard > 0
        if not self.dp_mode:
            self.dp_mode = "fsdp" if hsdp_flags else "replicate"
        if self.dp_mode != "fsdp":
            if hsdp_flags or self.mp_param_dtype or self.mp_reduce_dtype:
                raise ValueError("--dp-replicate/--dp-shard/--mp-*-dtype need --dp-mode fsdp")
            return
        if self.dp_replicate < 0 or self.dp_shard < 0:
            raise ValueError("--dp-replicate and --dp-shard must be >= 1")
        rep, shard = self.dp_replicate, self.dp_shard
        if rep and shard:
            if self.dp not in (1, rep * shard):
                raise ValueError(f"--dp {self.dp} != dp_replicate*dp_shard = {rep}*{shard}")
            self.dp = rep * shard
        elif shard:
            if self.dp != 1 and self.dp % shard:
                raise ValueError(f"--dp {self.dp} is not divisible by --dp-shard {shard}")
            rep = max(1, self.dp // shard)
            self.dp = rep * shard
        else:
            rep = rep or 1
            if self.dp != 1 and self.dp % rep:
                raise ValueError(f"--dp {self.dp} is not divisible by --dp-replicate {rep}")
            shard = max(1, self.dp // rep)
            self.dp = rep * shard
        self.dp_replicate, self.dp_shard = rep, shard

    def _validate(self) -> None:
        for name in (
            "dp",
            "pp",
            "tp",
            "microbatches",
            "stages_per_rank",
            "steps",
            "global_batch",
            "seq_len",
            "layers",
            "dim",
            "heads",
            "vocab",
            "log_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not (0 <= self.peak_tflops < float("inf")):
            raise ValueError("--peak-tflops must be a finite number >= 0")
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("dp-mode", self.dp_mode, DP_MODES)
        for flag in ("mp_param_dtype", "mp_reduce_dtype"):
            if getattr(self, flag):
                _choice(flag.replace("_", "-"), getattr(self, flag), MP_DTYPES)
        _choice("compile", self.compile, COMPILE_BACKENDS)
        _choice("dtype", self.dtype, ("fp32", "bf16"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        if self.heads % self.tp:
            raise ValueError(f"--heads {self.heads} is not divisible by --tp {self.tp}")
        if self.dim % self.heads:
            raise ValueError(f"--dim {self.dim} is not divisible by --heads {self.heads}")
        if self.layers % self.num_stages:
            raise ValueError(
                f"--layers {self.layers} is not divisible by pp*stages-per-rank = {self.num_stages}"
            )
        if self.global_batch % (self.dp * self.microbatches):
            raise ValueError(
                f"--global-batch {self.global_batch} is not divisible by "
                f"dp*microbatches = {self.dp * self.microbatches}"
            )
        for name in self.inject:
            _choice("inject", name, tuple(INJECTIONS))
            if name in NEEDS_COMPILE and self.compile == "none":
                raise ValueError(f"--inject {name} needs --compile eager|aot_eager|inductor")
            if name in NEEDS_DDP and (self.dp < 2 or self.dp_mode != "ddp"):
                raise ValueError(f"--inject {name} needs --dp >= 2 and --dp-mode ddp")
        if "ddp-nesting" in self.inject and self.dp < 2:
            raise ValueError("--inject ddp-nesting needs --dp >= 2")
        if self.pause_seconds < 0:
            raise ValueError("--pause-seconds must be >= 0")
        if self.start_delay < 0:
            raise ValueError("--start-delay must be >= 0")
        if "tp-grad-skip" in self.inject and self.tp < 2:
            raise ValueError("--inject tp-grad-skip needs --tp >= 2")
        if "hsdp-replicate-skip" in self.inject and (
            self.dp_mode != "fsdp" or self.dp_replicate < 2 or self.dp_shard < 2
        ):
            # with one shard FSDP copies instead of calling its reduce-scatter, which the injection wraps
            raise ValueError(
                "--inject hsdp-replicate-skip needs --dp-mode fsdp, --dp-replicate >= 2 and --dp-shard >= 2"
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages over all pp ranks."""
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the mesh degrees multiply to the launched world size."""
        if self.world_size != world_size:
            raise ValueError(
                f"dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} but WORLD_SIZE is {world_size}"
            )
        if "hang" in self.inject and world_size < 2:
            raise ValueError("--inject hang needs at least 2 ranks")
        if self.start_delay_rank >= world_size:
            raise ValueError(f"--start-delay-rank {self.start_delay_rank} is outside 0..{world_size - 1}")
        if self.inject and not -world_size <= self.inject_rank < world_size:
            raise ValueError(f"--inject-rank {self.inject_rank} is outside 0..{world_size - 1}")

    def injected_rank(self, world_size: int) -> int:
        return self.inject_rank % world_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"--{flag} {value!r} is not one of {', '.join(allowed)}")


class _OneLineParser(argparse.ArgumentParser):
    """Errors are one line (no usage dump) so every rank of a bad launch prints one clear line."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig.__dataclass_fields__
    p = _OneLineParser(
        prog="hpar-train",
        description="Train a small GPT with DP x TP x PP.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = p.add_argument
    for name in ("dp", "tp", "pp"):
        add(f"--{name}", type=int, default=1, help=f"{name} degree; dp*tp*pp must equal WORLD_SIZE")
    add("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    add("--microbatches", type=int, default=0, help="pipeline microbatches (default 2*pp)")
    add("--stages-per-rank", type=int, default=2, help="virtual stages per rank for interleaved-1f1b")
    add(
        "--dp-mode",
        choices=DP_MODES,
        default="",
        help="data parallelism: ddp, replicate or fsdp (FSDP2 per block, then the root); default replicate "
        "(torch 2.11 cannot run DDP with TP inside a pipeline stage), fsdp when --dp-replicate/--dp-shard is given",
    )
    add(
        "--dp-replicate",
        type=int,
        default=0,
        metavar="M",
        help="fsdp: HSDP replicate degree (mesh dim dp_replicate)",
    )
    add(
        "--dp-shard",
        type=int,
        default=0,
        metavar="N",
        help="fsdp: shard degree (mesh dim dp_shard); dp = M*N",
    )
    add("--mp-param-dtype", choices=MP_DTYPES, default="", help="fsdp: MixedPrecisionPolicy param_dtype")
    add("--mp-reduce-dtype", choices=MP_DTYPES, default="", help="fsdp: MixedPrecisionPolicy reduce_dtype")
    add("--compile", choices=COMPILE_BACKENDS, default="none", help="torch.compile backend per block")
    add("--dtype", choices=("fp32", "bf16"), default="fp32")
    for name in ("steps", "seed", "global_batch", "seq_len", "layers", "dim", "heads", "vocab", "log_every"):
        add(
            f"--{name.replace('_', '-')}",
            type=int,
            default=d[name].default,
            help=f"(default {d[name].default})",
        )
    add("--lr", type=float, default=d["lr"].default)
    add(
        "--peak-tflops",
        type=float,
        default=0.0,
        metavar="T",
        help="peak TFLOP/s of one rank's accelerator for --dtype (datasheet dense figure), for the MFU panel; "
        "0 (default): unknown, no MFU",
    )
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda if available; cpu uses gloo and 1 thread per rank, cuda uses nccl",
    )
    add("--no-agent", action="store_true", help="do not attach the hpar_agent observability agent")
    add("--pg-timeout", type=float, default=0.0, help="process-group timeout in s (default 300; 20 for hang)")
    add("--inject", action="append", default=[], metavar="NAME", help="failure to reproduce (see below)")
    add("--inject-rank", type=int, default=-1, help="rank for rank-specific injections (default last rank)")
    add(
        "--inject-step", type=int, default=3, help="step an injection starts at, where it applies (default 3)"
    )
    add(
        "--inject-delay",
        type=float,
        default=0.2,
        help="straggler/slow-collective/slow-data delay in s (default 0.2)",
    )
    add("--inject-size", type=int, default=4 << 20, help="bytes leaked per step/microbatch (default 4 MiB)")
    add(
        "--pause-at",
        type=int,
        default=-1,
        metavar="STEP",
        help="before STEP rank 0 pauses like a checkpoint save while the others wait for it (default -1: never)",
    )
    add("--pause-seconds", type=float, default=0.0, metavar="S", help="length of the --pause-at pause")
    add(
        "--start-delay-rank",
        type=int,
        default=-1,
        metavar="RANK",
        help="this rank starts training --start-delay s after the others (default -1: none)",
    )
    add("--start-delay", type=float, default=0.0, metavar="S", help="how late --start-delay-rank starts")
    add("--out", default=None, help="JSON summary written by rank 0 (plus <stem>.rank<r>.json per rank)")
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> TrainConfig:
    """Parse and validate flags; exits 2 with one line on any error (on every rank, before any collective)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = TrainConfig(**vars(ns))
        cfg.check_world_size(world_size)
    except ValueError as e:
        parser.error(str(e))
    return cfg
