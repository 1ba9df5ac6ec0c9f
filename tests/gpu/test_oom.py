"""CUDA out-of-memory forensics on one GPU, in nanoGPT-style loops (``tests/compat/programs/nanogpt.py``):
a batch far too large fails at the first step (under ``hpar-agent run``, and in-process with a caught
retry), and memory kept every step fails late. What the user gets is asserted: the closing line, the
``oom`` record and event, the evidence files (the allocator snapshot naming the allocating code), the
owners of the memory, the headroom metric falling and MemoryLeak saying at which step the GPU is full.

Sizes follow the card's free memory, so each test runs in well under a minute on any GPU. With ``$OUT``
set, the figures go to ``$OUT/gpu-oom.json`` (for docs/alerts.md).
"""

from __future__ import annotations

import json
import os
import pickle
import platform
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpar_agent.memory_forensics import TOP
from hpar_agent.tools.run_cmd import oom_line
from hpar_agent.torch_compat import cuda_memory
from testkit.zerocode import hpar_run
from tests.gpu.helpers import alert_events, sample_sum

MiB = 1 << 20
PROGRAMS = Path(__file__).resolve().parents[1] / "compat" / "programs"
NANOGPT = PROGRAMS / "nanogpt.py"
HERE = os.path.basename(__file__)
#: nanogpt.py's model: 256 tokens, 64 a sequence, width 128 (fp32 embeddings: 512 bytes a token)
VOCAB, SEQ, DIM = 256, 64, 128
#: Pace of the late-OOM loop (the allocator is sampled at most every 50 ms; the agent passes every 0.2 s).
STEP_S = 0.06
FIGURES: dict[str, Any] = {}


def _line(text: str) -> int:
    """nanogpt.py's line holding ``text``."""
    return next(i for i, line in enumerate(NANOGPT.read_text().splitlines(), 1) if text in line)


def _gpt() -> Any:
    sys.path.insert(0, str(PROGRAMS))
    try:
        from nanogpt import GPT
    finally:
        sys.path.remove(str(PROGRAMS))
    return GPT(VOCAB, SEQ, dim=DIM, layers=2, heads=4)


def _far_too_large() -> int:
    """A batch whose embedding output alone is twice the free memory: the first forward fails."""
    return 2 * torch.cuda.mem_get_info(0)[0] // (SEQ * DIM * 4) + 1


def _blocks_ahead_of_parameters(model: torch.nn.Module) -> int:
    """Live blocks of device 0 larger than the largest block holding a parameter of ``model`` (from an
    allocator snapshot now): other programs' or earlier tests' tensors (a failed test's locals stay
    referenced) can push the parameters out of a record's ``TOP`` largest blocks, on any card."""
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live = [
        b
        for seg in cuda_memory.snapshot()["segments"]
        if seg.get("device", 0) == 0
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    ]
    biggest = max(int(b["size"]) for b in live if int(b["address"]) in ptrs)
    return sum(int(b["size"]) > biggest for b in live)


def _private(paths: list[str]) -> None:
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


@pytest.fixture(scope="module", autouse=True)
def figures() -> Iterator[None]:
    yield
    out = os.environ.get("OUT")
    if out and FIGURES:
        FIGURES.update(
            torch=torch.__version__,
            python=platform.python_version(),
            gpu=torch.cuda.get_device_name(0),
            date=time.strftime("%Y-%m-%d"),
        )
        Path(out, "gpu-oom.json").write_text(json.dumps(FIGURES, indent=1, default=str))


def test_a_batch_far_too_large_under_hpar_agent_run(tmp_path: Path) -> None:
    """Zero-code: the first forward fails before any optimizer step could attach the agent; the error
    attaches it, and the end of the run names the rank, the step and the line."""
    batch = _far_too_large()
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = hpar_run(
        run,
        [sys.executable, str(NANOGPT), "--device", "cuda", "--steps", "3", "--batch", str(batch)],
        timeout=240,
        HPAR_METRICS_PORT="-1",
        HPAR_TRACES="none",
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "torch.OutOfMemoryError: CUDA out of memory" in proc.stderr  # the user's traceback, as without us
    line = next(x for x in proc.stderr.splitlines() if x.startswith("  rank 0: "))
    assert line.startswith(
        f"  rank 0: died of CUDA out of memory after 0 completed steps at nanogpt.py:"
        f"{_line('x = self.tok(idx)')} in forward"
    ), line
    summary = json.loads((run / "summary.rank0.json").read_text())
    assert summary["components"]["zerocode"]["attached_at"] == "CUDA out of memory"
    rec = summary["components"]["oom"]["record"]
    assert rec["fatal"] and rec["step"] == 0 and "Tried to allocate" in rec["message"]
    params = sum(p.numel() * p.element_size() for p in _gpt().parameters())
    owners = rec["owners"]
    assert owners["source"] == "model found on the stack" and owners["bytes_by_kind"]["parameter"] == params
    assert owners["bytes_by_kind"]["other"] >= 2 * batch * SEQ * 8  # the batch's x and y (int64) on the GPU
    snap = next(p for p in rec["evidence"] if p.endswith(".allocator.pickle"))
    assert any(s["device"] == 0 for s in pickle.loads(Path(snap).read_bytes())["segments"])
    assert rec["snapshot"]["allocated_bytes"] >= params + 2 * batch * SEQ * 8
    assert line.endswith(next(p for p in rec["evidence"] if p.endswith(".oom.json")))
    _private(rec["evidence"])
    FIGURES["first_step_under_run"] = {
        "batch": batch,
        "seconds": round(seconds, 1),
        "closing_line": line,
        "message": rec["message"],
        "owners": owners["bytes_by_kind"],
    }


def test_a_batch_far_too_large_is_recorded_once_with_its_owners(attached: Callable[..., Any]) -> None:
    """Attached before the loop: the allocator's observer writes the record inside the failing
    allocation; the program catches the error, retries smaller and goes on; a second failure is counted."""
    model = _gpt().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    agent = attached(model, optimizer=opt, metrics_port=-1, traces="none", interval=3600.0)
    oom = agent.component("oom")
    assert oom.observing
    free, batch = torch.cuda.mem_get_info(0)[0], _far_too_large()
    took = []
    ahead = -1
    for _ in range(2):
        idx = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
        t0 = time.monotonic()
        with pytest.raises(torch.OutOfMemoryError):
            model(idx, idx)
        took.append(time.monotonic() - t0)
        if ahead < 0:
            ahead = _blocks_ahead_of_parameters(model)
        del idx
    idx = torch.randint(0, VOCAB, (8, SEQ), device="cuda")
    model(idx, idx).backward()  # the smaller batch trains
    opt.step()
    agent.tick()
    rec = oom.record
    assert oom.count == 2 and rec["source"] == "allocator" and not rec["fatal"] and rec["step"] == 0
    assert rec["requested_bytes"] >= batch * SEQ * DIM * 4 and rec["device_free_bytes"] <= free
    assert rec["site"] == f"nanogpt.py:{_line('x = self.tok(idx)')} in forward", rec["stacks"]
    owners = rec["owners"]
    named = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    assert owners["source"] == "attached model and optimizer"
    assert owners["bytes_by_kind"]["parameter"] == sum(named.values())
    assert all(t["name"] in named and t["bytes"] == named[t["name"]] for t in owners["largest"])
    assert owners["bytes_by_kind"]["other"] >= batch * SEQ * 8  # the batch
    largest = rec["snapshot"]["largest_blocks"]
    for b in largest:  # a block named for a parameter holds it
        if b["owner"].startswith("parameter "):
            assert b["bytes"] >= named[b["owner"].split(" ", 1)[1]], b
    if ahead < TOP:  # the largest parameter's block is among the largest blocks: it must be named
        assert any(b["owner"].startswith("parameter ") for b in largest), (ahead, largest)
    assert sorted(
        p.rsplit(".", 2)[-2] for p in rec["evidence"] if not p.endswith(("pyspy.txt", "pyspy.json"))
    ) == ["allocator", "oom"]
    _private(rec["evidence"])
    assert len(os.listdir(Path(agent.run_dir) / "evidence")) == len(
        rec["evidence"]
    )  # the second wrote nothing
    headroom = sample_sum(agent, "hpar_gpu_memory_headroom_bytes")
    assert 0 < headroom <= torch.cuda.mem_get_info(0)[1]
    line = oom_line(agent.summary())
    assert line is not None and line.startswith(
        "  rank 0: ran out of CUDA memory 2 time(s) and went on; the first after 0 completed steps at nanogpt.py:"
    )
    assert not agent.errors, dict(agent.errors)
    FIGURES["first_step_in_process"] = {
        "batch": batch,
        "first_oom_s": round(took[0], 3),
        "second_oom_s": round(took[1], 4),
        "closing_line": line,
        "requested_bytes": rec["requested_bytes"],
        "owners": owners["bytes_by_kind"],
        "live_blocks_larger_than_the_largest_parameters": ahead,
    }


def _keep(kept: list[torch.Tensor], nbytes: int) -> None:
    """The leak site the out-of-memory record must name: device memory held every step."""
    kept.append(torch.ones(nbytes // 4, device="cuda"))


def test_memory_growing_every_step_ooms_late(attached: Callable[..., Any]) -> None:
    """A nanoGPT step (bf16 autocast) that keeps 1/40 of the free memory every step: the headroom falls
    step after step, MemoryLeak says at which step the GPU is full, and the out-of-memory there is
    recorded with a snapshot that names the line holding the memory."""
    model = _gpt().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    agent = attached(model, optimizer=opt, metrics_port=-1, traces="none", interval=0.2)
    leak = torch.cuda.mem_get_info(0)[0] // 40 // (2 * MiB) * (2 * MiB)  # whole large-pool blocks
    kept: list[torch.Tensor] = []
    headroom: list[float] = []
    with pytest.raises(torch.OutOfMemoryError):
        for _ in range(120):
            t0 = time.perf_counter()
            idx = torch.randint(0, VOCAB, (8, SEQ), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(idx, idx)
            loss.backward()
            _keep(kept, leak)
            opt.step()
            opt.zero_grad(set_to_none=True)
            headroom.append(sample_sum(agent, "hpar_gpu_memory_headroom_bytes"))  # what a scrape reads
            time.sleep(max(0.0, STEP_S - (time.perf_counter() - t0)))
    rec = agent.component("oom").record
    assert rec is not None and rec["source"] == "allocator" and rec["requested_bytes"] == leak
    oom_step = rec["step"]
    assert 30 <= oom_step <= 45, oom_step
    assert rec["site"] == f"{HERE}:{_keep.__code__.co_firstlineno + 2} in _keep", rec["stacks"]
    by_site = rec["snapshot"]["live_bytes_by_site"]  # stacks recorded again once the GPU was due full
    assert rec["snapshot"]["history"] and by_site.get(rec["site"], 0) >= leak, by_site
    assert rec["trend"]["growth_bytes_per_step"] == pytest.approx(leak, rel=0.05)
    seen = [h for h in headroom if h > 0]
    assert len(seen) > 20 and seen[-1] < seen[0] - 15 * leak and seen[-1] < 8 * leak  # a pass lags <= 4 steps
    firing = alert_events(agent.run_dir, "MemoryLeak")
    assert firing and firing[0]["value"] == pytest.approx(leak, rel=0.05)
    details = firing[0]["details"]
    assert abs(details["full_at_step"] - oom_step) <= 2, (details, oom_step)
    _private(rec["evidence"])
    kept.clear()  # the program goes on
    idx = torch.randint(0, VOCAB, (8, SEQ), device="cuda")
    model(idx, idx).backward()
    opt.step()
    line = oom_line(agent.summary())
    assert line is not None and f"after {oom_step} completed steps at {rec['site']}" in line
    assert not agent.errors, dict(agent.errors)
    FIGURES["late"] = {
        "leak_bytes_per_step": leak,
        "oom_after_steps": oom_step,
        "forecast": details["forecast"],
        "fired_at_step": firing[0]["step"],
        "closing_line": line,
        "headroom_first_last": [seen[0], seen[-1]],
        "site_bytes": by_site.get(rec["site"]),
    }
