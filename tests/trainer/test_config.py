"""Flag validation: bad flags are one clear line and exit code 2 on every rank, never a traceback."""

from __future__ import annotations

import pytest

from hpar_trainer.config import INJECTIONS, parse_args
from hpar_trainer.launch import run_torchrun


def test_defaults_are_valid():
    cfg = parse_args([], world_size=1)
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.schedule, cfg.dp_mode) == (1, 1, 1, "1f1b", "replicate")
    assert cfg.microbatches == 2 and cfg.stages_per_rank == 1


@pytest.mark.parametrize(
    ("argv", "rep_shard"),
    [
        (["--dp-replicate", "2", "--dp-shard", "2"], (2, 2)),  # HSDP; fsdp implied, dp = 4
        (["--dp", "4", "--dp-shard", "2"], (2, 2)),
        (["--dp", "4", "--dp-mode", "fsdp"], (1, 4)),  # plain FSDP
        (["--dp", "4", "--dp-replicate", "4"], (4, 1)),  # replicate-only through fully_shard's 2-D mesh
        (["--dp-shard", "4"], (1, 4)),  # --dp follows the factors given
        (["--dp-replicate", "4"], (4, 1)),
    ],
)
def test_fsdp_degrees_resolve(argv, rep_shard):
    cfg = parse_args(argv, world_size=4)
    assert (cfg.dp_mode, cfg.dp, (cfg.dp_replicate, cfg.dp_shard)) == ("fsdp", 4, rep_shard)


def test_fsdp_mixed_precision_policy():
    import torch

    from hpar_trainer.parallelize import mp_policy

    bf16_fp32 = mp_policy(
        parse_args(["--dp-mode", "fsdp", "--mp-param-dtype", "bf16", "--mp-reduce-dtype", "fp32"], 1)
    )
    assert (bf16_fp32.param_dtype, bf16_fp32.reduce_dtype) == (torch.bfloat16, torch.float32)
    bf16 = mp_policy(parse_args(["--dp-mode", "fsdp", "--mp-param-dtype", "bf16"], 1))
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)  # reduce follows params
    plain = mp_policy(parse_args(["--dp-mode", "fsdp"], 1))
    assert (plain.param_dtype, plain.reduce_dtype) == (None, None)


def test_help_documents_every_injection(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in INJECTIONS)
    assert "torch 2.11 cannot run DDP with TP" in " ".join(text.split())


@pytest.mark.parametrize(
    ("argv", "world", "needle"),
    [
        (["--dp", "2"], 4, "WORLD_SIZE is 4"),
        (["--tp", "3"], 3, "--heads 4 is not divisible by --tp 3"),
        (["--pp", "2", "--layers", "3"], 2, "--layers 3 is not divisible"),
        (["--pp", "2", "--schedule", "interleaved-1f1b", "--layers", "2"], 2, "--layers 2 is not divisible"),
        (["--inject", "nope"], 1, "--inject 'nope'"),
        (["--dp", "2", "--global-batch", "6"], 2, "--global-batch 6 is not divisible"),
        (["--inject", "graph-break"], 1, "needs --compile"),
        (["--schedule", "zigzag"], 1, "invalid choice"),
        (["--dp-replicate", "2", "--dp-mode", "ddp"], 2, "need --dp-mode fsdp"),
        (["--dp", "4", "--dp-shard", "3"], 4, "--dp 4 is not divisible by --dp-shard 3"),
        (["--dp", "2", "--dp-replicate", "2", "--dp-shard", "2"], 4, "--dp 2 != dp_replicate*dp_shard"),
        (["--dp-mode", "fsdp", "--dp", "2", "--inject", "hsdp-replicate-skip"], 2, "--dp-replicate >= 2"),
        (["--dp-replicate", "2", "--inject", "hsdp-replicate-skip"], 2, "--dp-shard >= 2"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, argv, world, needle):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hpar-train: error: ") and needle in err, err


@pytest.mark.distributed
def test_bad_flags_under_torchrun_fail_fast_on_every_rank():
    res = run_torchrun(2, ["--tp", "2", "--heads", "3", "--dim", "63"], timeout=60)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("hpar-train: error:")]
    assert len(lines) == 2 and "--heads 3 is not divisible by --tp 2" in lines[0]
    assert "config.py" not in res.stderr  # no worker traceback (torchrun's own summary is expected)


def test_peak_tflops_and_model_flops_per_token():
    """The MFU inputs the trainer reports: its flag, validated, and 6 x the rank's local parameters."""
    import torch

    from hpar_trainer.train import model_flops_per_token

    assert parse_args(["--peak-tflops", "989"], world_size=1).peak_tflops == 989.0
    with pytest.raises(SystemExit):
        parse_args(["--peak-tflops", "-1"], world_size=1)
    parts = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False)]
    assert model_flops_per_token(parts) == 6.0 * (4 * 3 + 3 + 3 * 2)


def test_model_flops_per_token_counts_fsdp_shards_whole():
    """MFU under FSDP/HSDP: parameters fully_shard splits over dp_shard (HSDP: replicated over
    dp_replicate) count whole; those TP splits count the rank's tp share. One process, a fake 8-rank
    group (FSDP2 and TP build their DTensors without communicating)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpar_trainer.train import model_flops_per_token

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        m = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)
        )
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(m, mesh=mesh["dp_replicate", "dp_shard"])
        assert all(p.to_local().numel() < p.numel() for p in m.parameters())  # every parameter is sharded
        # tp halves layer 0 (weight and bias) and layer 2's weight; layer 2's bias and the norm are whole.
        assert model_flops_per_token([m]) == 6.0 * ((16 * 8 + 16) / 2 + 8 * 16 / 2 + 8 + 2 * 8)
    finally:
        dist.destroy_process_group()
