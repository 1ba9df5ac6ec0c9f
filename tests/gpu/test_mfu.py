"""Per-rank MFU on a GPU: the agent's count of a GPT-style model's FLOPs per step (torch's flop counter on
a steady step) against the independent count 6N + 12 L H Q T FLOPs a token (N the matmul weights, L
layers, H heads of width Q, T the sequence length), within 10 %, and an MFU between 0 and 1 against the
card's bf16 peak, with the peak at the current SM clock beside it. ``$OUT/gpu-mfu.json`` gets the
figures."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hpar_agent.collectors.mfu import COUNT_STEP
from hpar_trainer.model import GPT, ModelArgs


def test_mfu_of_a_gpt_against_the_transformer_count(attached: Callable[..., Any]) -> None:
    torch.manual_seed(0)
    args = ModelArgs(vocab=8192, dim=1024, heads=8, layers=4, seq_len=512)
    batch = 8
    model = GPT(args).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    agent = attached(model, traces="none", metrics_port=-1)
    for _ in range(COUNT_STEP + 30):
        x = torch.randint(0, args.vocab, (batch, args.seq_len), device="cuda")
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    agent.tick()
    mfu = agent.component("mfu").summary()
    n = args.layers * 12 * args.dim**2 + args.dim * args.vocab
    per_token = 6 * n + 12 * args.layers * args.dim * args.seq_len  # H * Q = dim
    expected = batch * args.seq_len * per_token
    ratio = mfu["flops_per_step"] / expected
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "gpu-mfu.json").write_text(
            json.dumps({**mfu, "expected_flops": expected, "ratio": ratio}, indent=1)
        )
    assert 0.9 <= ratio <= 1.1, (mfu, expected)
    assert mfu["dtype"] == "bf16" and mfu["peak_flops"], mfu
    assert 0 < mfu["mfu"] < 1, mfu
    assert mfu["mfu_at_clock"] is not None and mfu["mfu_at_clock"] >= mfu["mfu"] * 0.999, mfu
