"""The fault matrix: run the reference trainer with one injected failure and report what the agent saw.

``hpar-agent diagnose --inject NAME`` prints which alert fired, on which rank and stage, after how many
steps, and with which evidence; ``--all`` runs every mode and prints the README's matrix table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpar_agent.launch import torchrun_cmd

#: injection -> the alert that must fire for it (the trainer's ``--inject`` names).
EXPECTED: dict[str, str] = {
    "recompile-storm": "RecompileStorm",
    "graph-break": "GraphBreaks",
    "divergent-graph": "CompileDivergence",
    "ddp-nesting": "ReplicaDivergence",
    "tp-grad-skip": "ReplicaDivergence",
    "dtype-mismatch": "CollectiveMismatch",
    "compile-leak": "MemoryLeak",
    "tensor-leak": "MemoryLeak",
    "straggler": "Straggler",
    # gloo's flight recorder has no durations: a rank late to the dp all-reduce is seen by arrival skew.
    "slow-collective": "Straggler",
    "hang": "Hang",
    "hsdp-replicate-skip": "ReplicaDivergence",
}
#: what the matrix says under the table for modes whose CPU result needs a word.
NOTES: dict[str, str] = {
    "hsdp-replicate-skip": "HSDP 2 x 2 (FSDP2): rank 3 keeps its own reduce-scatter output instead of the "
    "replicate all-reduce result (it still joins every collective); it and rank 1 (same shard, other replica) "
    "drift, and the 1-1 split names both; ranks 0 and 2 (shard 0) stay quiet. Needs 4 ranks.",
    "slow-collective": "every rank in dp with DDP. The inject rank arrives late at every dp all-reduce: "
    "arrival skew names it (Straggler). CollectiveLatencyHigh judges the transfer (a timed op's duration less "
    "the wait for the last member to arrive), so the peers' long waits do not raise it; gloo records no "
    "collective durations anyway.",
    "dtype-mismatch": "every rank in dp with DDP (DDP cannot wrap TP's DTensor parameters): the inject rank reduces "
    "in bf16 padded to the fp32 byte size, so gloo completes and the gradients are silently corrupted "
    "(loss NaN); the flight recorder shows its BFloat16 entry against its peers' Float.",
    "hang": "every rank is stuck, so Hang fires on all four at 80% of the 20 s pg timeout, before gloo "
    "aborts (by design later than 10 s: a checkpoint-like pause of 12 s must not fire it); rank 3's details "
    "and stacks show it in a default_pg barrier, its peers in dp/tp all-reduces; every rank exits after the "
    "pg timeout.",
    "ddp-nesting": "all ranks train the detached block unsynchronised: every dp pair drifts (a 1-1 split "
    "names both ranks); GradSyncIncomplete fires on every rank from the first judged step, its value the "
    "share of the gradient reduced over dp.",
    "tp-grad-skip": "all ranks skip the sync: every tp pair drifts (a 1-1 split names both ranks); "
    "GradSyncIncomplete fires on every rank with coverage.tp 0.0 (gradients sampled from step 1).",
    "compile-leak": "a new code object compiled per microbatch: CompiledGraphsGrowing names "
    "`_leaky_graph trainer/inject.py:<line>` first (2 ranks: step 10, MemoryLeak at step 30 with a py-spy "
    "record profile); the leaked graphs are graphs its peers never compile, so CompileDivergence may name "
    "the inject rank too.",
}

#: modes that act through a DDP comm hook need DDP rather than the default composable replicate, and
#: DDP cannot wrap TP's DTensor parameters: every rank in dp (4 ranks: a 3-1 majority names the odd rank).
NEEDS_DDP = {"dtype-mismatch", "slow-collective"}
#: modes that need a replicate x shard mesh (FSDP2 HSDP): 4 ranks, 2 replicas of 2 shards.
NEEDS_HSDP = {"hsdp-replicate-skip"}
#: modes that need tp peers (on 2 ranks: tp2 instead of dp2).
NEEDS_TP = {"tp-grad-skip"}
COMMON = ["--pp", "1", "--compile", "aot_eager", "--log-every", "10"]


def layout(injection: str, nproc: int) -> list[str]:
    """The default layout of a mode on ``nproc`` ranks: 4 ranks dp2 x tp2 (dp peers, tp peers, compiled
    blocks), every rank in dp under DDP for the comm-hook modes; on 2 ranks dp2, or tp2 for NEEDS_TP.
    Trainer flags after ``--`` come later on the command line and win (e.g. ``--device cuda``)."""
    if injection in NEEDS_HSDP:
        return ["--dp-replicate", "2", "--dp-shard", str(max(2, nproc // 2)), "--tp", "1", *COMMON]
    if injection in NEEDS_DDP:
        return ["--dp", str(nproc), "--tp", "1", "--dp-mode", "ddp", *COMMON]
    if nproc >= 4 and nproc % 2 == 0:
        return ["--dp", str(nproc // 2), "--tp", "2", *COMMON]
    if injection in NEEDS_TP:
        return ["--dp", "1", "--tp", str(nproc), *COMMON]
    return ["--dp", str(nproc), "--tp", "1", *COMMON]


#: 4 CPU ranks, every dimension a failure needs: dp peers, tp peers, compiled blocks.
LAYOUT = layout("", 4)
LAYOUT_DDP = layout("slow-collective", 4)
#: steps per mode (default 100): leaks need warm-up plus a 20-step trend, and the cross-rank detectors
#: compare over the store every 3 s and confirm on a second exchange: about 10 s, which fast steps outrun.
STEPS = {"hang": 12}
DEFAULT_STEPS = 100
#: modes built into the model or the step from step 0 (the others start at --inject-step).
FROM_START = {"divergent-graph", "ddp-nesting", "tp-grad-skip"}


@dataclass
class Finding:
    injection: str
    expected: str
    fired: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int = 0
    wall_s: float = 0.0
    inject_step: int = 0
    #: rank -> unix time the injection became active there (see ``injection_times``)
    started: dict[int, float] = field(default_factory=dict)
    timed_out: float = 0.0  # the time limit the run hit, 0 when it ended by itself
    token: str = ""  # the run's token (RUN_TAG): every process carrying it is killed before diagnose returns

    @property
    def detected(self) -> list[dict[str, Any]]:
        return [f for f in self.fired if f["alert"] == self.expected]

    def seconds_to_detect(self) -> float | None:
        """From the injection becoming active on the firing rank to its first firing event."""
        secs = [f["ts"] - self.started[f["rank"]] for f in self.detected if f.get("rank") in self.started and "ts" in f]
        return max(0.0, min(secs)) if secs else None

    def row(self) -> list[str]:
        hits = self.detected
        timeout = f"timed out after {self.timed_out:.0f} s" if self.timed_out else ""
        if not hits:
            fired = f"not fired ({timeout})" if timeout else "not fired"
            return [self.injection, self.expected, fired, "-", "-", "-", "-", self.others()]
        first = min(hits, key=lambda f: f.get("step", 0))
        ranks = ",".join(map(str, sorted({f["rank"] for f in hits})))
        stages = sorted({f.get("pp_stage", 0) for f in hits})
        steps = max(0, int(first.get("step", 0)) - self.inject_step)
        secs = self.seconds_to_detect()
        evidence = sorted({evidence_kind(e) for f in hits for e in f.get("evidence", [])})
        return [
            self.injection,
            self.expected,
            f"{ranks} ({timeout})" if timeout else ranks,
            ",".join(map(str, stages)),
            str(steps),
            "-" if secs is None else f"{secs:.1f}",
            ", ".join(evidence) or "-",
            self.others(),
        ]

    def others(self) -> str:
        """Alerts other than the expected one, as ``Alert@ranks``."""
        ranks: dict[str, set[int]] = {}
        for f in self.fired:
            if f["alert"] != self.expected:
                ranks.setdefault(f["alert"], set()).add(int(f["rank"]))
        return ", ".join(f"{a}@{','.join(map(str, sorted(r)))}" for a, r in sorted(ranks.items())) or "-"


def evidence_kind(path: str) -> str:
    """``Hang-1.rank3.<time>.0.pyspy.txt`` -> ``pyspy.txt``; ``...fr-gloo.json`` -> ``fr-gloo.json``."""
    return ".".join(Path(path).name.split(".")[-2:])


def read_alerts(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``alert`` event that went firing, from all ranks' event logs."""
    out = []
    for path in sorted(run_dir.glob("events.rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "alert" and rec.get("state") == "firing":
                out.append(rec)
    return out


def injection_times(run_dir: Path, step: int, from_start: bool) -> dict[int, float]:
    """rank -> unix time its injection became active, from the trainer's per-rank records
    (``trainer.rank<R>.json``, written as each step ends): the start of ``step`` (the end of the step
    before when ``step`` never ended), or for built-in modes the end of step 0 (the compiled graphs,
    the model and its first update exist from then)."""
    out = {}
    for path in run_dir.glob("trainer.rank*.json"):
        try:
            data = json.loads(path.read_text())
            steps = {s["step"]: s for s in data["steps"] if "t0" in s}
            if from_start and 0 in steps:
                out[int(data["rank"])] = steps[0]["t0"] + steps[0].get("step_s", 0.0)
            elif step in steps:
                out[int(data["rank"])] = steps[step]["t0"]
            elif step - 1 in steps:  # the injected step never ended (hang): it began as the one before ended
                out[int(data["rank"])] = steps[step - 1]["t0"] + steps[step - 1].get("step_s", 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


#: every process a diagnose run starts inherits this variable (with the run's token): torchrun starts
#: each rank in a session of its own, so killing torchrun's process group alone leaves the ranks running.
RUN_TAG = "HPAR_DIAGNOSE_RUN"


def run_group(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, bool, str]:
    """Run ``cmd`` in a session of its own, output to ``log_path``; (exit code, timed out, run token).

    Whatever happens (timeout, Ctrl-C), every process the run started is killed before this returns:
    its process group, and every process that carries the run's token in its environment (ranks that
    torchrun put in sessions of their own, and their children)."""
    token = f"{os.getpid()}-{time.time_ns()}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env={**env, RUN_TAG: token}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_run(token, proc.pid)
            proc.wait()
    return proc.returncode, timed_out, token


def tagged(token: str) -> list[int]:
    """Live processes whose environment carries ``RUN_TAG=token`` (zombies have an empty environment)."""
    needle = f"{RUN_TAG}={token}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def kill_run(token: str, pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the run's process group and every tagged process, SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in tagged(token):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not tagged(token):
                return
            time.sleep(0.1)


def diagnose(
    injection: str,
    run_dir: Path,
    *,
    steps: int = 0,
    timeout: float = 600,
    extra: list[str] | None = None,
    nproc: int = 4,
) -> Finding:
    """One injected run; ``extra`` trainer flags override the mode's layout (e.g. ``--device cuda``).

    Never raises for a failed or stuck run: a run past ``timeout`` is killed (its whole process group)
    and reported as timed out with whatever fired until then."""
    if injection not in EXPECTED:
        raise ValueError(f"unknown injection {injection!r}; one of: {', '.join(EXPECTED)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    inject_step = 3
    args = [
        *layout(injection, nproc),
        "--steps", str(steps or STEPS.get(injection, DEFAULT_STEPS)),
        "--inject", injection, "--inject-step", str(inject_step),
        "--out", str(run_dir / "trainer.json"),
        *(extra or []),
    ]  # fmt: skip
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "HPAR_RUN_DIR": str(run_dir), "HPAR_JOB_ID": run_dir.name, "HPAR_METRICS_PORT": "0",
    }  # fmt: skip
    t0 = time.time()
    code, timed_out, token = run_group(torchrun_cmd(nproc, "hpar_trainer", args), env, run_dir / "diagnose.log", timeout)
    from_start = injection in FROM_START
    return Finding(
        injection,
        EXPECTED[injection],
        read_alerts(run_dir),
        code,
        time.time() - t0,
        0 if from_start else inject_step,
        injection_times(run_dir, inject_step, from_start),
        timeout if timed_out else 0.0,
        token,
    )


HEADERS = ["injection", "expected alert", "fired on rank", "stage", "steps to detect", "seconds to detect", "evidence",
           "other alerts"]


def markdown(findings: list[Finding]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(f.row()) + " |" for f in findings]
    notes = [f"- `{f.injection}`: {NOTES[f.injection]}" for f in findings if f.injection in NOTES]
    return "\n".join(lines + (["", *notes] if notes else []))
