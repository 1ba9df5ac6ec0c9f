"""The model's FLOPs per step, counted once by torch's flop counter on a steady step, against the count
for a GPT-style model (6N a token: N the matmul weights). On CPU torch's counter has no formula for the
CPU attention kernel, so the attention term (12 L H Q T a token) is checked on a GPU
(``tests/gpu/test_mfu.py``); here neither a peak nor an MFU exists (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hpar_agent
from hpar_agent.collectors.mfu import COUNT_STEP, dtype_name, peak_flops
from hpar_trainer.model import GPT, ModelArgs


def _train(tmp_path: Path, compiled: bool) -> dict:
    torch.manual_seed(0)
    args = ModelArgs(vocab=256, dim=64, heads=4, layers=2, seq_len=32)
    model = GPT(args)
    opt = torch.optim.AdamW(model.parameters())
    run = tmp_path / ("compiled" if compiled else "eager")
    hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=str(run), detectors=False)
    fwd = torch.compile(model, backend="eager") if compiled else model
    try:
        for _ in range(COUNT_STEP + 3):
            x = torch.randint(0, args.vocab, (4, args.seq_len))
            F.cross_entropy(fwd(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        hpar_agent.detach()
    mfu = json.loads((run / "summary.rank0.json").read_text())["components"]["mfu"]
    n = args.layers * 12 * args.dim**2 + args.dim * args.vocab  # q, k, v, o, mlp in/out, head
    return {"mfu": mfu, "expected": 4 * args.seq_len * 6 * n}


def test_flops_per_step_are_counted_once_on_a_steady_step(tmp_path: Path) -> None:
    got = _train(tmp_path, compiled=False)
    flops = got["mfu"]["flops_per_step"]
    assert flops == pytest.approx(got["expected"], rel=0.01), got
    assert got["mfu"]["mfu"] is None and got["mfu"]["peak_flops"] is None  # no GPU: no peak


def test_a_compiled_model_is_not_counted_and_says_why(tmp_path: Path) -> None:
    got = _train(tmp_path, compiled=True)
    assert got["mfu"]["flops_per_step"] is None
    assert "torch.compile" in got["mfu"]["reason"], got


def test_peak_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "tf32") == 494.7e12
    assert peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert dtype_name(torch.float32, tf32=True) == "tf32" and dtype_name(torch.bfloat16, tf32=False) == "bf16"
