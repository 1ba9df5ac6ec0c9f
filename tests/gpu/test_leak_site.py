"""MemoryLeak names the leaking site from the CUDA allocator's history, in a program nobody wrote for
the agent: the nanoGPT-style loop (``tests/compat/programs/nanogpt.py``) under ``hpar-agent run``,
keeping 32 MiB of device memory every optimizer step while its batches, activations and gradients are
allocated and freed every step. The site is the line that keeps the tensor (the py-spy stack at firing
time is whatever the loop was doing then: kept apart, never called the site), its live bytes a whole
number of kept tensors, one a step recorded. With ``$OUT`` set, what the alert said goes to
``$OUT/gpu-leak-site.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from testkit.zerocode import hpar_run
from tests.gpu.helpers import alert_events

MiB = 1 << 20
NANOGPT = Path(__file__).resolve().parents[1] / "compat" / "programs" / "nanogpt.py"
LEAK_MIB = 32  # whole 2 MiB large-pool blocks, each in a segment of its own (>= 10 MiB)


def test_memory_leak_names_the_line_that_keeps_the_tensor(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = hpar_run(
        run,
        [
            sys.executable,
            str(NANOGPT),
            *f"--device cuda --steps 200 --eval-every 50 --leak-mib {LEAK_MIB}".split(),
        ],
        timeout=300,
        HPAR_METRICS_PORT="-1",
        HPAR_TRACES="none",
        HPAR_INTERVAL="0.2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    firing = alert_events(run, "MemoryLeak")
    assert firing, "MemoryLeak did not fire"
    d = firing[0]["details"]
    line = next(i for i, t in enumerate(NANOGPT.read_text().splitlines(), 1) if "kept.append(" in t)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-leak-site.json").write_text(
            json.dumps(
                {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "event": firing[0]},
                indent=1,
                default=str,
            )
        )
    assert d["source"] in {"allocator", "reserved", "nvml"}, d
    assert d["site"] == f"nanogpt.py:{line} in main", d
    kept = d["site_live_bytes"] / (LEAK_MIB * MiB)
    assert kept == int(kept) and abs(kept - d["site_steps"]) <= 1, d  # one kept tensor a step recorded
    # live over steps: a step more or fewer than recorded, so the tolerance is just over one step's share
    assert d["site_growth_bytes_per_step"] == pytest.approx(LEAK_MIB * MiB, rel=1.001 / d["site_steps"])
    assert "stack" not in d  # the py-spy stack is what the loop did at firing, not the site
