"""Run a command under ``hpar-agent run`` as a user would, and read what it left in the run directory
(the zero-code, compatibility and GPU launcher tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: What a launcher around the test run may have set; the shim and the launchers under test read them.
#: How the agent's own lines start (hpar-agent run's, and the agent's one-line messages).
OWN_LINES = (
    "hpar-agent run: ",
    "  ranks observed: ",
    "  not observed: ",
    "  rank ",
    "hpar_agent: ",
    "hpar-agent: ",
)
LAUNCH_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
}


def clean_env(run_dir: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any agent, torchrun or launcher setting, plus the run
    directory, loopback endpoints on free ports and one thread per rank."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HPAR_", "TORCHELASTIC_")) and k not in LAUNCH_VARS
    }
    env.update(
        HPAR_RUN_DIR=str(run_dir),
        HPAR_METRICS_ADDR="127.0.0.1",
        HPAR_METRICS_PORT="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_cmd(cmd: list[str]) -> list[str]:
    """``hpar-agent run -- CMD`` with this interpreter."""
    return [sys.executable, "-m", "hpar_agent.tools.cli", "run", "--", *cmd]


def hpar_run(
    run_dir: Path, cmd: list[str], timeout: float = 90, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run_cmd(cmd),
        env=clean_env(run_dir, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def summaries(run_dir: Path) -> dict[int, dict[str, Any]]:
    """rank -> its ``summary.rank<R>.json``."""
    return {
        int(p.stem.split("rank")[-1]): json.loads(p.read_text()) for p in run_dir.glob("summary.rank*.json")
    }


def events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / f"events.rank{rank}.jsonl").read_text().splitlines()]


def attach_event(run_dir: Path, rank: int) -> dict[str, Any]:
    for ev in events(run_dir, rank):
        if ev["kind"] == "attach":
            return ev
    raise AssertionError(f"rank {rank} logged no attach event")


# ------------------------------------------------------------------------------------------ whole jobs
@dataclass(frozen=True)
class Spec:
    """One job for ``launch``: its command, its ranks, the module it needs, what is planted in it."""

    cmd: list[str]
    world: int = 2
    needs: str = ""  # a module the job imports (the test is skipped without it)
    compile_backend: str = ""  # the backend the program compiles with ("": it compiles nothing)
    faults: dict[int, str] = field(default_factory=dict)  # rank -> the alert its fault must raise
    env: dict[str, str] = field(default_factory=dict)
    zero_code: bool = True  # under ``hpar-agent run``; False: as is (the program calls ``attach()``)


@dataclass
class Run:
    """A finished job under ``hpar-agent run``: its run directory and what its program wrote in
    ``out_dir`` (``result.rank<R>.json``: the steps it took, dynamo's own counters)."""

    name: str
    spec: Spec
    run_dir: Path
    out_dir: Path
    proc: subprocess.CompletedProcess[str]
    seconds: float

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def why(self) -> str:
        return f"{self.name} ({self.seconds:.0f} s): {self.output[-4000:]}"

    def summaries(self) -> dict[int, dict[str, Any]]:
        return summaries(self.run_dir)

    def results(self) -> dict[int, dict[str, Any]]:
        """rank -> what the program says it did."""
        return {
            int(p.stem.split("rank")[-1]): json.loads(p.read_text())
            for p in self.out_dir.glob("result.rank*.json")
        }

    def alerts(self) -> dict[int, set[str]]:
        """rank -> every alert that went firing there."""
        from hpar_agent.tools.diagnose import read_alerts

        out: dict[int, set[str]] = {}
        for a in read_alerts(self.run_dir):
            out.setdefault(int(a["rank"]), set()).add(str(a["alert"]))
        return out


def launch(base: Path, name: str, spec: Spec, timeout: float = 300) -> Run:
    """Run ``spec`` in ``base/name``, under ``hpar-agent run`` unless it attaches itself (Hugging Face
    offline); skips the test when ``spec.needs`` is missing, fails it when the job fails."""
    import pytest

    if spec.needs:
        pytest.importorskip(
            spec.needs, reason=f"{spec.needs} is in the compat extra: pip install -e '.[compat]'"
        )
    run_dir, out_dir = base / name / "run", base / name / "out"
    out_dir.mkdir(parents=True)
    env = clean_env(
        run_dir,
        COMPAT_OUT=str(out_dir),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(base / "hf-home"),
        TOKENIZERS_PARALLELISM="false",
        **spec.env,
    )
    t0 = time.monotonic()
    cmd = run_cmd(spec.cmd) if spec.zero_code else spec.cmd
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=base / name
    )
    run = Run(name, spec, run_dir, out_dir, proc, time.monotonic() - t0)
    assert proc.returncode == 0, run.why()
    return run


class Launches:
    """``launches(name)``: the run of ``specs[name]`` under ``base``, launched on first use and shared by
    every test that asks; a failed or skipped launch is raised again, never launched a second time."""

    def __init__(self, base: Path, specs: dict[str, Spec], timeout: float = 300) -> None:
        self.base, self.specs, self.timeout = base, specs, timeout
        self.done: dict[str, Run | BaseException] = {}

    def __call__(self, name: str) -> Run:
        if name not in self.done:
            try:
                self.done[name] = launch(self.base, name, self.specs[name], self.timeout)
            except BaseException as exc:
                self.done[name] = exc
        got = self.done[name]
        if isinstance(got, BaseException):
            raise got
        return got
