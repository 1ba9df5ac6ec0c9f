"""Run a command under ``hpar-agent run`` as a user would, and read what it left in the run directory
(the zero-code and compatibility tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: What a launcher around the test run may have set; the shim and the launchers under test read them.
LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS",
               "SLURM_PROCID", "SLURM_LOCALID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}  # fmt: skip


def clean_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any agent, torchrun or launcher setting, plus the run
    directory, loopback endpoints on free ports and one thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPAR_", "TORCHELASTIC_")) and k not in LAUNCH_VARS}  # fmt: skip
    env.update(HPAR_RUN_DIR=str(run_dir), HPAR_METRICS_ADDR="127.0.0.1", HPAR_METRICS_PORT="0",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    env.update(extra)
    return env


def run_cmd(cmd: list[str]) -> list[str]:
    """``hpar-agent run -- CMD`` with this interpreter."""
    return [sys.executable, "-m", "hpar_agent.tools.cli", "run", "--", *cmd]


def hpar_run(run_dir: Path, cmd: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(run_cmd(cmd), env=clean_env(run_dir, **env), capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def summaries(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its ``summary.rank<R>.json``."""
    return {int(p.stem.split("rank")[-1]): json.loads(p.read_text()) for p in run_dir.glob("summary.rank*.json")}


def events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / f"events.rank{rank}.jsonl").read_text().splitlines()]


def attach_event(run_dir: Path, rank: int) -> dict[str, Any]:
    for ev in events(run_dir, rank):
        if ev["kind"] == "attach":
            return ev
    raise AssertionError(f"rank {rank} logged no attach event")
