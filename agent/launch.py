"""Launch ``hpar_trainer`` under torchrun as a subprocess (the demo, diagnose and benchmarks).

A subprocess, not an import: the agent never imports the trainer, the trainer imports the agent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence


def torchrun_cmd(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", module, *args,
    ]  # fmt: skip


def run_trainer(
    nproc: int,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``hpar_trainer`` on ``nproc`` local ranks (one intra-op thread each: ranks share cores)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        torchrun_cmd(nproc, "hpar_trainer", args),
        env=full_env,
        timeout=timeout,
        capture_output=capture,
        text=True,
        check=False,
    )
