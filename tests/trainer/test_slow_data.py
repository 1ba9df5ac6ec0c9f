"""--inject slow-data: the inject rank's data source is slow from --inject-step on; nobody else's is."""

from __future__ import annotations

import time

import torch

from hpar_trainer.config import parse_args
from hpar_trainer.data import MarkovData, SlowData
from hpar_trainer.inject import Injector
from hpar_trainer.metrics import RankRecorder


def _data() -> MarkovData:
    return MarkovData(vocab=16, seq_len=4, global_batch=4, seed=0)


def _seconds(src: object, step: int) -> float:
    t0 = time.perf_counter()
    src.batch(step, 0, 1)  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def test_slow_data_sleeps_from_the_inject_step_and_keeps_the_batches() -> None:
    slow = SlowData(_data(), 0.05, start=2)
    assert _seconds(slow, 1) < 0.04
    assert _seconds(slow, 2) >= 0.05
    assert all(torch.equal(a, b) for a, b in zip(slow.batch(3, 0, 1), _data().batch(3, 0, 1), strict=True))


def test_only_the_inject_rank_gets_the_slow_source() -> None:
    cfg = parse_args(["--dp", "2", "--inject", "slow-data", "--inject-delay", "0.05"], world_size=2)
    data = _data()
    peer = Injector(cfg, 0, 2, RankRecorder(None, 0, {}))
    injected = Injector(cfg, 1, 2, RankRecorder(None, 1, {}))
    assert peer.data_source(data) is data
    slow = injected.data_source(data)
    assert isinstance(slow, SlowData) and slow.delay == 0.05 and slow.start == cfg.inject_step


def test_the_loader_yields_each_steps_batch_through_a_dataloader() -> None:
    """The trainer reads its batches through a DataLoader (the step anatomy times the wait there): step
    i's batch of this dp rank, in order, the same tensors as the source gives, for as many steps as the
    caller takes (the overhead benchmark steps past ``--steps``)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from hpar_trainer.data import loader

    batches = loader(_data(), 1, 2)
    assert isinstance(batches, _BaseDataLoaderIter)
    for step in range(40):
        x, y = next(batches)
        want = _data().batch(step, 1, 2)
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])
