"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hpar_agent


@pytest.fixture
def store() -> Any:
    """A real TCPStore on a free port, for the cross-rank exchange between fake ranks of one process."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def train_linear(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A few optimizer steps of a ``Linear(4, 4)``: what the agent's global optimizer hook sees."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    return model, opt


@pytest.fixture
def attach(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``hpar_agent.attach`` on a free local port, no traces, the run directory in ``tmp_path``;
    detached and stopped after the test."""
    agents = []

    def _attach(model: Any = None, **kw: Any) -> Any:
        kw.setdefault("metrics_port", 0)
        kw.setdefault("metrics_addr", "127.0.0.1")
        kw.setdefault("traces", "none")
        kw.setdefault("run_dir", str(tmp_path))
        agent = hpar_agent.attach(model, **kw)
        agents.append(agent)
        return agent

    yield _attach
    hpar_agent.detach()
    for a in agents:
        a.stop()
