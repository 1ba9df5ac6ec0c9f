"""The fault matrix: run the reference trainer with one injected failure and report what the agent saw.

``hpar-agent diagnose --inject NAME`` prints which alert fired, on which rank and stage, after how many
steps, and with which evidence; ``--all`` runs every mode and prints the matrix table (docs/trainer.md).
Which alert each injection must raise and the trainer argv of each run come from the trainer
(``hpar_trainer.scenarios``, imported when a run starts): the agent knows none of its flags.
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

from hpar_agent.catalogue import ENV_DIAGNOSE_RUN
from hpar_agent.safefiles import open_private, private_dir, read_regular
from hpar_agent.tools.launch import torchrun_cmd, trainer_scenarios


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
        secs = [
            f["ts"] - self.started[f["rank"]]
            for f in self.detected
            if f.get("rank") in self.started and "ts" in f
        ]
        return max(0.0, min(secs)) if secs else None

    def row(self) -> list[str]:
        hits = self.detected
        timeout = f"timed out after {self.timed_out:.0f} s" if self.timed_out else ""
        if not hits:
            fired = f"not fired ({timeout})" if timeout else "not fired"
            return [self.injection, self.expected, fired, "-", "-", "-", "-", "-", self.others()]
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
            self.culprits(),
            ", ".join(evidence) or "-",
            self.others(),
        ]

    def culprits(self) -> str:
        """The ranks the expected alert's events name as its cause; "unknown" where they name none
        (a 1-1 split), "-" for an alert that names no culprit (a single rank's own signal)."""
        named = [f["details"].get("culprits") for f in self.detected if isinstance(f.get("details"), dict)]
        named = [c for c in named if isinstance(c, list)]
        if not named:
            return "-"
        ranks = sorted({r for c in named for r in c if isinstance(r, int)})
        return ",".join(map(str, ranks)) if ranks else "unknown"

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
        try:
            text = read_regular(path, 256 << 20).decode("utf-8", "replace")
        except OSError:
            continue
        for line in text.splitlines():
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
            data = json.loads(read_regular(path, 16 << 20))
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
RUN_TAG = ENV_DIAGNOSE_RUN


def run_group(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, bool, str]:
    """Run ``cmd`` in a session of its own, output to ``log_path``; (exit code, timed out, run token).

    Whatever happens (timeout, Ctrl-C), every process the run started is killed before this returns:
    its process group, and every process that carries the run's token in its environment (ranks that
    torchrun put in sessions of their own, and their children)."""
    token = f"{os.getpid()}-{time.time_ns()}"
    with os.fdopen(open_private(str(log_path), append=False), "wb") as log:
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
    and reported as timed out with whatever fired until then. Raises ``launch.TrainerMissing`` when
    the trainer is not importable."""
    sc = trainer_scenarios()
    if injection not in sc.EXPECTED:
        raise ValueError(f"unknown injection {injection!r}; one of: {', '.join(sc.EXPECTED)}")
    private_dir(str(run_dir), chosen=True)
    args = sc.diagnose_argv(
        injection, nproc, steps=steps, out=str(run_dir / "trainer.json"), extra=extra or ()
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HPAR_RUN_DIR": str(run_dir),
        "HPAR_JOB_ID": run_dir.name,
        "HPAR_METRICS_PORT": "0",
    }
    t0 = time.time()
    code, timed_out, token = run_group(
        torchrun_cmd(nproc, "hpar_trainer", args), env, run_dir / "diagnose.log", timeout
    )
    from_start = injection in sc.FROM_START
    return Finding(
        injection,
        sc.EXPECTED[injection],
        read_alerts(run_dir),
        code,
        time.time() - t0,
        0 if from_start else sc.INJECT_STEP,
        injection_times(run_dir, sc.INJECT_STEP, from_start),
        timeout if timed_out else 0.0,
        token,
    )


HEADERS = [
    "injection",
    "expected alert",
    "fired on rank",
    "stage",
    "steps to detect",
    "seconds to detect",
    "culprits",
    "evidence",
    "other alerts",
]


def markdown(findings: list[Finding]) -> str:
    notes_of = trainer_scenarios().NOTES
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(f.row()) + " |" for f in findings]
    notes = [f"- `{f.injection}`: {notes_of[f.injection]}" for f in findings if f.injection in notes_of]
    return "\n".join(lines + (["", *notes] if notes else []))
