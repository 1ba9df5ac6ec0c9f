"""Run the 4-rank trainer with the agent in the background and scrape its live endpoints."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from hpar_agent.tools.launch import torchrun_cmd
from testkit.ports import free_base_port


class LiveRun:
    """The trainer under torchrun with per-rank endpoints on ``base + local_rank``."""

    def __init__(
        self, run_dir: Path, args: Sequence[str], nproc: int = 4, env: dict[str, str] | None = None
    ) -> None:
        self.run_dir = run_dir
        self.nproc = nproc
        self.base = free_base_port(nproc)
        run_dir.mkdir(parents=True, exist_ok=True)
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "HPAR_RUN_DIR": str(run_dir),
            "HPAR_JOB_ID": run_dir.name,
            "HPAR_METRICS_PORT": str(self.base),
            "HPAR_METRICS_ADDR": "127.0.0.1",
            "HPAR_METRICS_PORT_FALLBACK": "0",
            **(env or {}),
        }
        self.log = open(run_dir / "torchrun.log", "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            torchrun_cmd(nproc, "hpar_trainer", [*args, "--out", str(run_dir / "trainer.json")]),
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def url(self, rank: int) -> str:
        return f"http://127.0.0.1:{self.base + rank}/metrics"

    def scrape(self, rank: int) -> str:
        return urllib.request.urlopen(self.url(rank), timeout=5).read().decode()

    def wait_for_steps(self, steps: int, timeout: float = 300) -> list[str]:
        """Scrape every rank until each reports ``steps`` completed steps; return the scrapes."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited early ({self.proc.returncode}): {self.tail()}")
            try:
                texts = [self.scrape(r) for r in range(self.nproc)]
            except OSError:
                time.sleep(1)
                continue
            if all(_steps(t) >= steps for t in texts):
                return texts
            time.sleep(1)
        raise TimeoutError(f"ranks did not reach {steps} steps: {self.tail()}")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()

    def tail(self) -> str:
        if not self.log.closed:  # wait() and kill() close it; the failure messages come after them
            self.log.flush()
        return (self.run_dir / "torchrun.log").read_text()[-3000:]


def _steps(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("hpar_steps_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
