"""Synthetic, learnable and layout-independent token data."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Protocol

import torch

BRANCHES = 2  # successors per token: the achievable loss is about ln(2)


class MarkovData:
    """Sequences from a fixed sparse first-order Markov chain.

    The global batch of step s depends only on (seed, s), and a dp rank takes a contiguous slice of
    it, so every parallel layout sees exactly the same samples and losses can be compared.
    """

    def __init__(self, *, vocab: int, seq_len: int, global_batch: int, seed: int) -> None:
        self.vocab, self.seq_len, self.global_batch, self.seed = vocab, seq_len, global_batch, seed
        g = torch.Generator().manual_seed(seed + 7919)
        self.successors = torch.randint(0, vocab, (vocab, BRANCHES), generator=g)

    def global_batch_at(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tok = torch.randint(0, self.vocab, (self.global_batch,), generator=g)
        seq = [tok]
        for _ in range(self.seq_len):
            choice = torch.randint(0, BRANCHES, (self.global_batch,), generator=g)
            tok = self.successors[tok, choice]
            seq.append(tok)
        return torch.stack(seq, dim=1)

    def batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this dp rank's shard, each (global_batch / dp, seq_len)."""
        n = self.global_batch // dp
        shard = self.global_batch_at(step)[dp_rank * n : (dp_rank + 1) * n]
        return shard[:, :-1].contiguous(), shard[:, 1:].contiguous()


class DataSource(Protocol):
    def batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class SlowData:
    """A data source that takes ``delay`` seconds longer per batch from step ``start`` on: a loader
    that cannot keep up (slow storage, heavy decoding), for ``--inject slow-data``."""

    def __init__(self, inner: DataSource, delay: float, start: int) -> None:
        self.inner, self.delay, self.start = inner, delay, start

    def batch(self, step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step >= self.start:
            time.sleep(self.delay)
        return self.inner.batch(step, dp_rank, dp)


class StepBatches(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One dp rank's batch of step ``i`` as a map-style dataset: the trainer reads its batches through a
    ``DataLoader`` (``loader``), as a real job does, so its data time is a loader wait (the step anatomy's
    ``data_wait``)."""

    def __init__(self, source: DataSource, dp_rank: int, dp: int) -> None:
        self.source, self.dp_rank, self.dp = source, dp_rank, dp

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.batch(step, self.dp_rank, self.dp)


def loader(source: DataSource, dp_rank: int, dp: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of steps 0, 1, ... in order, as many as the caller steps (a benchmark steps past
    ``--steps``), built in this process (no workers: deterministic)."""
    steps = itertools.count()
    return iter(torch.utils.data.DataLoader(StepBatches(source, dp_rank, dp), batch_size=None, sampler=steps))
