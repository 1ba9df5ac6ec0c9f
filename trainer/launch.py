"""Launch the trainer under torchrun on this machine (tests, demos, tools)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from hpar_agent.tools.launch import torchrun_cmd


def run_torchrun(
    nproc: int,
    trainer_args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    capture: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``torch.distributed.run --standalone -m hpar_trainer`` with ``nproc`` ranks.

    ``--standalone`` rendezvouses on a free local port and OMP_NUM_THREADS=1 is set so concurrent launches neither collide nor
    oversubscribe the cores; raises subprocess.TimeoutExpired past ``timeout``.
    """
    cmd = torchrun_cmd(nproc, "hpar_trainer", trainer_args)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, env=full_env, timeout=timeout, capture_output=capture, text=True, check=False)
