"""GPT-style decoder built so pipeline stages can drop the parts they do not own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BlockHook = Callable[["Block", torch.Tensor], torch.Tensor]


@dataclass(kw_only=True)
class ModelArgs:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq_len: int


class Attention(nn.Module):
    """Causal self-attention; q/k/v/out are separate Linears so TP plans address them by name.

    The head count is derived from the local width of q at run time, so the same code runs the
    full model and a TP shard holding heads/tp heads.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        # Per-head-dim q/k norms: replicated over tp but fed by sharded heads, so their grads need a tp
        # all-reduce (see parallelize.sync_tp_replicated_grads); the tp-grad-skip injection drops it.
        self.q_norm = nn.RMSNorm(self.head_dim)
        self.k_norm = nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        # Contiguous (b, h, t, d) into SDPA: aot_eager traces the backward with SDPA's meta strides, and
        # for fp32 on CUDA (the memory-efficient kernel) those of transposed inputs differed from the
        # real gradients', so a view in the traced backward failed ("view size is not compatible").
        q, k, v = self.q_norm(q).contiguous(), self.k_norm(k).contiguous(), v.contiguous()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, 4 * dim, bias=False)
        self.w_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class Block(nn.Module):
    """Pre-norm transformer block; the unit of compilation."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        # Failure injections run here so that they execute inside the compiled region.
        self.inject_hook: BlockHook | None = None
        self.inject_tag = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inject_hook is not None:
            h = self.inject_hook(self, h)
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class GPT(nn.Module):
    """Embeddings, ``layers`` keyed "0".."L-1" and head; a stage sets parts it does not own to None."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_emb: nn.Embedding | None = nn.Embedding(args.vocab, args.dim)
        self.pos_emb: nn.Embedding | None = nn.Embedding(args.seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim, args.heads) for i in range(args.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(args.dim)
        self.head: nn.Linear | None = nn.Linear(args.dim, args.vocab, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits on a full model; hidden states in and/or out on pipeline stages."""
        h = x
        if self.tok_emb is not None and self.pos_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok_emb(x) + self.pos_emb(pos)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


def build_model(args: ModelArgs, seed: int) -> GPT:
    """Same seed -> same weights on every rank and layout (stages are carved from this full model)."""
    torch.manual_seed(seed)
    return GPT(args)
