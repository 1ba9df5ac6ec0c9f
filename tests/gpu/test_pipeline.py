"""The pipeline collector on CUDA streams: a one-stage pipeline traced every step, run on the current
stream and then on a side stream, gives ``pp.forward`` spans that name each stream and carry its
``cudaStream_t`` (``cuda.stream.handle``) equal to the stream's own ``cuda_stream``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import hpar_agent
from hpar_agent import catalogue as cat
from tests.gpu.helpers import attribute, spans


def test_chunk_spans_carry_the_stream_they_ran_on(
    nccl_group: torch.device, attached: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPAR_DETAIL_RATE", "0")  # every step's chunks, however fast the steps
    device = nccl_group
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).to(
        device
    )
    sched = ScheduleGPipe(
        PipelineStage(model, 0, 1, device), n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean()
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    agent = attached(model, optimizer=opt, metrics_port=-1, traces="file", trace_every=1, interval=0.2)
    agent.watch_pipeline(schedule=sched)
    x = torch.randn(8, 256, device=device)
    side = torch.cuda.Stream(device)
    for i in range(12):  # six steps on the current stream, six on a side stream
        with torch.cuda.stream(side) if i >= 6 else contextlib.nullcontext():
            sched.step(x, target=x)
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize(device)
    expected = {int(torch.cuda.current_stream(device).cuda_stream), int(side.cuda_stream)}
    run_dir = agent.run_dir
    hpar_agent.detach()  # flushes the traces
    forward = spans(run_dir, cat.SPAN_PP_FORWARD)
    assert forward, "no pp.forward span"
    assert {attribute(s, cat.ATTR_STREAM_HANDLE) for s in forward} == expected
    assert len({attribute(s, cat.ATTR_STREAM) for s in forward}) == 2
