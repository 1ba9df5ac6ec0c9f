"""The fault matrix: run the reference trainer with one injected failure and report what the agent saw.

``hpar-agent diagnose --inject NAME`` prints which alert fired, on which rank and stage, after how many
steps, and with which evidence; ``--all`` runs every mode and prints the README's matrix table.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpar_agent.launch import run_trainer

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
    "slow-collective": "CollectiveLatencyHigh",
    "hang": "Hang",
}

#: 4 CPU ranks, every dimension a failure needs: dp peers, tp peers, compiled blocks.
LAYOUT = ["--dp", "2", "--tp", "2", "--pp", "1", "--compile", "aot_eager", "--log-every", "10"]
STEPS = {"hang": 12, "compile-leak": 40, "tensor-leak": 40}
#: modes that act through a DDP comm hook need DDP rather than the default composable replicate.
NEEDS_DDP = {"dtype-mismatch", "slow-collective"}


@dataclass
class Finding:
    injection: str
    expected: str
    fired: list[dict[str, Any]] = field(default_factory=list)
    exit_code: int = 0
    wall_s: float = 0.0
    inject_step: int = 0

    @property
    def detected(self) -> list[dict[str, Any]]:
        return [f for f in self.fired if f["alert"] == self.expected]

    def row(self) -> list[str]:
        hits = self.detected
        if not hits:
            return [self.injection, self.expected, "not fired", "-", "-", "-"]
        first = min(hits, key=lambda f: f.get("step", 0))
        ranks = sorted({f["rank"] for f in hits})
        stages = sorted({f.get("pp_stage", 0) for f in hits})
        steps = max(0, int(first.get("step", 0)) - self.inject_step)
        evidence = sorted({Path(e).name.split(".")[0].rsplit("-", 1)[0] for f in hits for e in f.get("evidence", [])})
        return [
            self.injection,
            self.expected,
            ",".join(map(str, ranks)),
            ",".join(map(str, stages)),
            str(steps),
            ", ".join(evidence) or "-",
        ]


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


def diagnose(injection: str, run_dir: Path, *, steps: int = 0, timeout: float = 600, extra: list[str] | None = None) -> Finding:
    if injection not in EXPECTED:
        raise ValueError(f"unknown injection {injection!r}; one of: {', '.join(EXPECTED)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    inject_step = 3
    args = [
        *LAYOUT,
        "--steps", str(steps or STEPS.get(injection, 30)),
        "--inject", injection, "--inject-step", str(inject_step),
        "--out", str(run_dir / "trainer.json"),
        *(extra or []),
    ]  # fmt: skip
    if injection in NEEDS_DDP:
        args += ["--dp-mode", "ddp"]
    env = {"HPAR_RUN_DIR": str(run_dir), "HPAR_JOB_ID": run_dir.name, "HPAR_METRICS_PORT": "0"}
    t0 = time.time()
    proc = run_trainer(4, args, env=env, timeout=timeout, capture=True)
    finding = Finding(injection, EXPECTED[injection], read_alerts(run_dir), proc.returncode, time.time() - t0, inject_step)
    (run_dir / "diagnose.log").write_text((proc.stdout or "") + (proc.stderr or ""))
    return finding


HEADERS = ["injection", "expected alert", "fired on rank", "stage", "steps to detect", "evidence"]


def markdown(findings: list[Finding]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(f.row()) + " |" for f in findings]
    return "\n".join(lines)
