"""A new user's fast training loop: a tiny nanoGPT-style model, AdamW, its own loop, its own step timer.

The workload of ``overhead.py --config short-cpu`` / ``short-gpu``, which runs it as ``python
tiny_gpt.py`` and as ``hpar-agent run -- python tiny_gpt.py``. It imports nothing of the agent or of
the benchmarks: what the agent costs it is what a user who wraps their script in ``hpar-agent run``
pays. Each iteration is timed by the script (``time.perf_counter`` around batch, forward, backward,
optimizer step and ``loss.item()``, which waits for the GPU as a loop that logs its loss does).

    python benchmarks/tiny_gpt.py --preset cpu --steps 300 --out steps.json
    hpar-agent run -- python benchmarks/tiny_gpt.py --preset gpu --steps 500 --out steps.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Sizes for about 10-12 ms a step: ``cpu`` on one thread of a current x86 core, ``gpu`` on an H100.
PRESETS: dict[str, dict[str, int | str]] = {
    "cpu": {
        "device": "cpu",
        "layers": 2,
        "dim": 128,
        "heads": 4,
        "seq_len": 64,
        "batch": 4,
        "vocab": 512,
        "threads": 1,
    },
    "gpu": {
        "device": "cuda",
        "layers": 6,
        "dim": 512,
        "heads": 8,
        "seq_len": 512,
        "batch": 16,
        "vocab": 8192,
        "threads": 0,
    },
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for key in ("layers", "dim", "heads", "seq_len", "batch", "vocab", "threads"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="over the preset")
    ap.add_argument("--device", default=None, help="over the preset (cpu, cuda)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--out", default=None, help="write the step times here (JSON)")
    a = ap.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def build(a: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], float]]:
    """The model, its optimizer and one training iteration (batch, forward, backward, step, and
    ``loss.item()``, which waits for the GPU as a loop that logs its loss does)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)
    model = TinyGPT(a.vocab, a.seq_len, a.dim, a.heads, a.layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    # a fixed pool of batches: the loop times the model, not the data
    data = torch.randint(0, a.vocab, (16, a.batch, a.seq_len + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(it: int) -> float:
        batch = data[it % len(data)]
        x, y = batch[:, :-1], batch[:, 1:]
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    return model, opt, step


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model, _, step = build(a)
    device = next(model.parameters()).device
    times: list[float] = []
    starts: list[float] = []
    losses: list[float] = []
    for it in range(a.steps):
        starts.append(time.time())
        t0 = time.perf_counter()
        losses.append(step(it))
        times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    print(
        f"tiny_gpt: {a.steps} steps on {device}, median {med * 1e3:.2f} ms, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    if a.out:
        params = sum(p.numel() for p in model.parameters())
        with open(a.out, "w") as f:
            json.dump(
                {
                    "step_times": times,
                    "step_starts": starts,
                    "losses": losses,
                    "device": str(device),
                    "params": params,
                    "torch": torch.__version__,
                    "args": vars(a),
                },
                f,
            )
    return 0 if all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
