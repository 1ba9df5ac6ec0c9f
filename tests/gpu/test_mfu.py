"""Per-rank MFU on a GPU: the agent's count of a GPT-style model's FLOPs per step (torch's flop counter on
a steady step) against the independent count 6N + 12 L H Q T FLOPs a token (N the matmul weights, L
layers, H heads of width Q, T the sequence length), within 10 %, and an MFU between 0 and 1 against the
card's bf16 peak, with the peak at the current SM clock beside it; and the same model under
torch.compile (inductor), counted on a fake copy. ``$OUT/gpu-mfu.json`` and ``gpu-mfu-compiled.json`` get
the figures."""

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


def test_a_compiled_gpt_is_counted_on_fake_tensors(attached: Callable[..., Any]) -> None:
    """torch.compile (inductor) of the same GPT: the agent counts it on a fake copy; its FLOPs per step
    equal the flop counter's over a real eager forward and backward of the same model and batch (within
    1 %) and 6N + 12 L H Q T a token (10 %), and dynamo compiles nothing more once warmed up (the count
    ran between the two readings). ``$OUT/gpu-mfu-compiled.json`` gets the figures and the count's cost."""
    from torch._dynamo.utils import counters
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    args = ModelArgs(vocab=8192, dim=1024, heads=8, layers=4, seq_len=512)
    batch = 8
    model = GPT(args).to("cuda", torch.bfloat16)

    def batch_ids() -> torch.Tensor:
        return torch.randint(0, args.vocab, (batch, args.seq_len), device="cuda")

    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(batch_ids()).flatten(0, 1).float(), batch_ids().flatten()).backward()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    agent = attached(compiled, traces="none", metrics_port=-1)

    def step() -> None:
        x = batch_ids()
        F.cross_entropy(compiled(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(COUNT_STEP + 20):
        step()
    torch.cuda.synchronize()
    agent.tick()  # the count
    warm = dict(counters["frames"])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    agent.tick()
    mfu = agent.component("mfu").summary()
    n = args.layers * 12 * args.dim**2 + args.dim * args.vocab
    expected = batch * args.seq_len * (6 * n + 12 * args.layers * args.dim * args.seq_len)
    eager = counter.get_total_flops()
    out = os.environ.get("OUT")
    if out:
        figures = {
            **mfu,
            "eager_flops": eager,
            "expected_flops": expected,
            "frames": [warm, counters["frames"]],
        }
        (Path(out) / "gpu-mfu-compiled.json").write_text(json.dumps(figures, indent=1, default=str))
    assert mfu["method"] == "flop counter on fake tensors", mfu
    assert abs(mfu["flops_per_step"] / eager - 1) <= 0.01, (mfu, eager)
    assert 0.9 <= mfu["flops_per_step"] / expected <= 1.1, (mfu, expected)
    assert dict(counters["frames"]) == warm
    assert mfu["dtype"] == "bf16" and 0 < mfu["mfu"] < 1, mfu
