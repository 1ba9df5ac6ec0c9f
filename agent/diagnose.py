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
    # gloo's flight recorder has no durations: a rank late to the dp all-reduce is seen by arrival skew.
    "slow-collective": "Straggler",
    "hang": "Hang",
}
#: what the matrix says under the table for modes whose CPU result needs a word.
NOTES: dict[str, str] = {
    "slow-collective": "dp4 x tp1 with DDP. gloo's flight recorder has no collective durations, so "
    "CollectiveLatencyHigh cannot judge the dp all-reduce on CPU; the rank that arrives late is named by "
    "arrival skew (Straggler). CollectiveLatencyHigh judges timed ops: NCCL with TORCH_NCCL_ENABLE_TIMING=1 "
    "(there the waiting peers' all-reduces are the slow ones; not part of this CPU matrix) and pipelining p2p.",
    "dtype-mismatch": "dp4 x tp1 with DDP (DDP cannot wrap TP's DTensor parameters): the inject rank reduces "
    "in bf16 padded to the fp32 byte size, so gloo completes and the gradients are silently corrupted "
    "(loss NaN); the flight recorder shows its BFloat16 entry against its peers' Float.",
    "hang": "every rank is stuck, so Hang fires on all four at 80% of the 20 s pg timeout, before gloo "
    "aborts; rank 3's details and stacks show it in a default_pg barrier, its peers in dp/tp all-reduces.",
    "ddp-nesting": "all ranks train the detached block unsynchronised: every dp pair drifts (a 1-1 split "
    "names both ranks).",
    "tp-grad-skip": "all ranks skip the sync: every tp pair drifts (a 1-1 split names both ranks).",
    "compile-leak": "the leaked callables are compiled graphs its peers never compile, so CompileDivergence "
    "may name the inject rank too.",
}

#: 4 CPU ranks, every dimension a failure needs: dp peers, tp peers, compiled blocks.
LAYOUT = ["--dp", "2", "--tp", "2", "--pp", "1", "--compile", "aot_eager", "--log-every", "10"]
#: modes that act through a DDP comm hook need DDP rather than the default composable replicate, and
#: DDP cannot wrap TP's DTensor parameters: 4 dp ranks (a 3-1 majority names the odd rank).
NEEDS_DDP = {"dtype-mismatch", "slow-collective"}
LAYOUT_DDP = ["--dp", "4", "--tp", "1", "--pp", "1", "--dp-mode", "ddp", "--compile", "aot_eager", "--log-every", "10"]
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

    @property
    def detected(self) -> list[dict[str, Any]]:
        return [f for f in self.fired if f["alert"] == self.expected]

    def row(self) -> list[str]:
        hits = self.detected
        if not hits:
            return [self.injection, self.expected, "not fired", "-", "-", "-", self.others()]
        first = min(hits, key=lambda f: f.get("step", 0))
        ranks = sorted({f["rank"] for f in hits})
        stages = sorted({f.get("pp_stage", 0) for f in hits})
        steps = max(0, int(first.get("step", 0)) - self.inject_step)
        evidence = sorted({evidence_kind(e) for f in hits for e in f.get("evidence", [])})
        return [
            self.injection,
            self.expected,
            ",".join(map(str, ranks)),
            ",".join(map(str, stages)),
            str(steps),
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


def diagnose(
    injection: str,
    run_dir: Path,
    *,
    steps: int = 0,
    timeout: float = 600,
    extra: list[str] | None = None,
    nproc: int = 4,
) -> Finding:
    """One injected run; ``extra`` trainer flags override the CPU layout (e.g. a GPU layout)."""
    if injection not in EXPECTED:
        raise ValueError(f"unknown injection {injection!r}; one of: {', '.join(EXPECTED)}")
    run_dir.mkdir(parents=True, exist_ok=True)
    inject_step = 3
    args = [
        *(LAYOUT_DDP if injection in NEEDS_DDP else LAYOUT),
        "--steps", str(steps or STEPS.get(injection, DEFAULT_STEPS)),
        "--inject", injection, "--inject-step", str(inject_step),
        "--out", str(run_dir / "trainer.json"),
        *(extra or []),
    ]  # fmt: skip
    env = {"HPAR_RUN_DIR": str(run_dir), "HPAR_JOB_ID": run_dir.name, "HPAR_METRICS_PORT": "0"}
    t0 = time.time()
    proc = run_trainer(nproc, args, env=env, timeout=timeout, capture=True)
    active_from = 0 if injection in FROM_START else inject_step
    finding = Finding(injection, EXPECTED[injection], read_alerts(run_dir), proc.returncode, time.time() - t0, active_from)
    (run_dir / "diagnose.log").write_text((proc.stdout or "") + (proc.stderr or ""))
    return finding


HEADERS = ["injection", "expected alert", "fired on rank", "stage", "steps to detect", "evidence", "other alerts"]


def markdown(findings: list[Finding]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(f.row()) + " |" for f in findings]
    notes = [f"- `{f.injection}`: {NOTES[f.injection]}" for f in findings if f.injection in NOTES]
    return "\n".join(lines + (["", *notes] if notes else []))
