"""2 gloo ranks of the reference trainer (dp=2) with real injections on rank 1: tensor-leak and
straggler. The alerts must fire on rank 1's own series/events only, with evidence; rank 0 stays quiet.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hpar_agent.tools.diagnose import read_alerts
from hpar_trainer.launch import run_torchrun

pytestmark = pytest.mark.distributed


def test_leak_and_straggler_attributed_to_the_injected_rank(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {"HPAR_RUN_DIR": str(run), "HPAR_METRICS_PORT": "-1", "HPAR_TRACES": "none"}
    args = "--dp 2 --steps 45 --inject tensor-leak --inject straggler --inject-delay 0.3".split()
    res = run_torchrun(2, args, env=env, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    alerts = read_alerts(run)
    assert [a for a in alerts if a["rank"] == 0] == []
    fired = {e["alert"]: e for e in alerts if e["rank"] == 1}
    assert {"MemoryLeak", "Straggler"} <= set(fired), fired
    leak = fired["MemoryLeak"]
    assert leak["rank"] == 1 and leak["value"] >= 1 << 20
    assert leak["evidence"] and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in leak["evidence"])
    # no allocator history on CPU: no site is named, and the reason is said
    assert leak["details"]["site"] == "unknown" and leak["details"]["site_unknown"], leak["details"]
    assert fired["Straggler"]["value"] > 0.1
    summary = json.loads((run / "summary.rank1.json").read_text())["components"]["detectors"]
    assert summary["MemoryLeak"]["fired"] >= 1 and summary["Straggler"]["fired"] >= 1
