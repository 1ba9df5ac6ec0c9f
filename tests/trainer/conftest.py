"""Shared launcher for trainer tests: small CPU gloo runs through hpar_trainer.launch."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpar_trainer.launch import run_torchrun
from hpar_trainer.metrics import rank_path


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    summary: dict[str, Any] | None
    ranks: list[dict[str, Any]]

    def steps(self, rank: int, key: str, start: int = 0) -> list[float]:
        return [s[key] for s in self.ranks[rank]["steps"][start:] if s.get(key) is not None]


def train(tmp: Path, nproc: int, *args: str, timeout: float = 240) -> Run:
    out = tmp / "run.json"
    t0 = time.perf_counter()
    res = run_torchrun(nproc, ["--no-agent", "--out", str(out), *args], timeout=timeout)
    seconds = time.perf_counter() - t0
    summary = json.loads(out.read_text()) if out.exists() else None
    ranks = [
        json.loads(p.read_text()) if (p := rank_path(str(out), r)).exists() else {} for r in range(nproc)
    ]
    return Run(res.returncode, res.stdout + res.stderr, seconds, summary, ranks)


@pytest.fixture(scope="session")
def launch(tmp_path_factory: pytest.TempPathFactory):
    """launch(nproc, *trainer_args) -> Run, each in a fresh directory."""

    def _launch(nproc: int, *args: str, timeout: float = 240) -> Run:
        return train(tmp_path_factory.mktemp("run"), nproc, *args, timeout=timeout)

    return _launch
