"""A nanoGPT-style training loop (``python nanogpt.py``, one process): a small GPT, bf16 autocast, a
GradScaler, gradient accumulation, gradient clipping, a periodic eval and a checkpoint save. Knows
nothing of hpar_agent. ``[--device cuda] [--steps N] [--leak-mib M] [--batch B]`` (from step 3 keep M MiB
of device memory alive per optimizer step: the leak a held tensor makes; B sequences a micro-batch)."""

import argparse
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from _result import dump
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--leak-mib", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1) if args.device == "cpu" else None
    dev = torch.device(args.device)
    vocab, seq, batch = 256, 64, args.batch
    model = GPT(vocab, seq, dim=128, layers=2, heads=4).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler(args.device)
    taken = [0]
    opt.register_step_post_hook(lambda *_: taken.__setitem__(0, taken[0] + 1))  # steps the scaler let through
    data = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(0))

    def batch_of(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = (torch.arange(batch) * 37 + i * 11) % (len(data) - seq - 1)
        at = starts[:, None] + torch.arange(seq)
        return data[at].to(dev, non_blocking=True), data[at + 1].to(dev, non_blocking=True)

    kept = []
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for step in range(args.steps):
            lr = 3e-4 * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine schedule
            for group in opt.param_groups:
                group["lr"] = lr
            for micro in range(args.accum):
                x, y = batch_of(step * args.accum + micro)
                with torch.autocast(args.device, dtype=torch.bfloat16):
                    loss = model(x, y) / args.accum
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if args.leak_mib and step >= 3:
                kept.append(torch.ones(args.leak_mib << 18, device=dev))  # held for good: the leak
            if (step + 1) % args.eval_every == 0:
                model.eval()
                with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
                    val = sum(float(model(*batch_of(10_000 + i))) for i in range(4)) / 4
                model.train()
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "val": val},
                    os.path.join(ckpt_dir, "ckpt.pt"),
                )
    dump(0, 1, taken[0], dp=1, optimizer_steps_called=args.steps)


if __name__ == "__main__":
    main()
