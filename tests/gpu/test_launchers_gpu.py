"""On one GPU, under ``hpar-agent run`` with no change to the programs: the HF ``Trainer`` with
``torch_compile=True`` (inductor) under ``torchrun --nproc-per-node 1`` (NCCL), and a nanoGPT-style loop
(bf16 autocast, GradScaler, gradient accumulation, a periodic eval with a checkpoint save), clean and
with a tensor of device memory kept every step. Asserted as tests/compat asserts its CPU jobs: the rank
observed once with its topology, steps equal to the optimizer steps taken, compile counts equal to
dynamo's own with the inductor backend, no alert on the clean runs, MemoryLeak (from device memory) on
the leaky one, nothing of the agent's in the output, private files.

Skipped without CUDA (and the HF test without transformers). With ``$OUT`` set, what each run
showed goes to ``$OUT/gpu-launchers.json`` (for docs/launchers.md). docs/launchers.md says how to run it.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpar_agent.collectors.zerocode import NO_STEPS
from testkit.zerocode import OWN_LINES, Launches, Run, Spec, events

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROGRAMS = Path(__file__).resolve().parents[1] / "compat" / "programs"
REPO = Path(__file__).resolve().parents[2]
NANOGPT = [sys.executable, str(PROGRAMS / "nanogpt.py"), *"--device cuda --steps 200 --eval-every 50".split()]
SPECS = {
    "hf_trainer_inductor": Spec(
        [
            sys.executable,
            *"-m torch.distributed.run --standalone --nproc-per-node=1".split(),
            str(PROGRAMS / "hf_trainer.py"),
            *"--device cuda --steps 20 --compile inductor".split(),
        ],
        world=1,
        needs="transformers",
        compile_backend="inductor",
    ),
    "nanogpt_clean": Spec(NANOGPT, world=1),
    "nanogpt_leak": Spec([*NANOGPT, "--leak-mib", "16"], world=1, faults={0: "MemoryLeak"}),
}
#: Memory sources on the device (a held CUDA tensor leaves the host RSS alone).
DEVICE_SOURCES = {"allocator", "reserved", "nvml"}

GpuRun = Callable[[str], Run]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRun]:
    runs = Launches(tmp_path_factory.mktemp("gpu"), SPECS, timeout=240)
    yield runs
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-launchers.json").write_text(json.dumps(_record(runs.done), indent=1, default=str))


def _record(done: dict[str, Run | BaseException]) -> dict[str, Any]:
    """What each run showed, with the machine (the docs' table)."""
    rec: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "runs": {},
    }
    for name, run in done.items():
        if isinstance(run, BaseException):
            rec["runs"][name] = {"error": f"{type(run).__name__}: {run}"[:2000]}
            continue
        s = run.summaries().get(0, {})
        comp = s.get("components", {})
        rec["runs"][name] = {
            "seconds": round(run.seconds, 1),
            "topology": s.get("topology"),
            "attached_at": comp.get("zerocode", {}).get("attached_at"),
            "steps": comp.get("steps", {}).get("steps"),
            "result": run.results().get(0),
            "compile": {
                k: comp.get("compile", {}).get(k)
                for k in ("graphs", "graphs_compiled", "backends", "compiles")
            },
            "alerts": sorted(run.alerts().get(0, set())),
            "errors": s.get("errors"),
        }
    return rec


@pytest.mark.parametrize("name", list(SPECS))
def test_the_rank_is_observed_once_on_its_gpu(gpu_run: GpuRun, name: str) -> None:
    run = gpu_run(name)
    (s,) = run.summaries().values()
    res = run.results()[0]
    topo = s["topology"]
    backend = res.get("backend", "none")  # a group the program (the HF Trainer) made, or none
    assert (s["rank"], topo["world_size"], topo["backend"], topo["dp"]) == (0, "1", backend, "1"), topo
    assert topo["device"].startswith("cuda"), topo
    if backend != "none":
        assert backend == "nccl" and s["components"]["zerocode"]["attached_at"] == "init_process_group"
    assert s["errors"] == {}, s["errors"]
    assert [e["kind"] for e in events(run.run_dir, 0)].count("attach") == 1
    assert sorted(p.name for p in run.run_dir.glob("events.rank*.jsonl")) == ["events.rank0.jsonl"]
    assert "ranks observed: 1 of 1" in run.proc.stderr


@pytest.mark.parametrize("name", list(SPECS))
def test_steps_are_the_optimizer_steps_taken(gpu_run: GpuRun, name: str) -> None:
    """The HF Trainer's global steps; the nanoGPT loop's optimizer steps the GradScaler let through
    (a micro-batch is no step)."""
    run = gpu_run(name)
    (s,) = run.summaries().values()
    assert s["components"]["steps"]["steps"] == run.results()[0]["steps"] > 0


def test_inductor_compile_counts_equal_dynamos_own(gpu_run: GpuRun) -> None:
    run = gpu_run("hf_trainer_inductor")
    (s,) = run.summaries().values()
    comp, dynamo = s["components"]["compile"], run.results()[0]["dynamo"]
    assert comp["graphs_compiled"] == dynamo["unique_graphs"] > 0, (comp, dynamo)
    assert 0 < comp["graphs"] <= comp["graphs_compiled"]
    assert sum(b["count"] for b in comp["graph_breaks"]) == dynamo["graph_breaks"], (comp, dynamo)
    assert sum(x["count"] for x in comp["recompiles"]) == dynamo["recompiles"], (comp, dynamo)
    assert comp["backends"] == ["inductor"], comp


@pytest.mark.parametrize("name", list(SPECS))
def test_no_alert_but_the_planted_leak(gpu_run: GpuRun, name: str) -> None:
    run = gpu_run(name)
    alerts = run.alerts().get(0, set())
    if 0 not in run.spec.faults:
        assert alerts == set(), alerts
        return
    assert run.spec.faults[0] in alerts, alerts
    from hpar_agent.tools.diagnose import read_alerts

    sources = {
        a.get("details", {}).get("source") for a in read_alerts(run.run_dir) if a["alert"] == "MemoryLeak"
    }
    assert sources & DEVICE_SOURCES, sources


@pytest.mark.parametrize("name", list(SPECS))
def test_nothing_of_the_agent_in_the_output_and_private_files(gpu_run: GpuRun, name: str) -> None:
    run = gpu_run(name)
    assert NO_STEPS not in run.output and "[c10d]" not in run.output
    for line in run.output.splitlines():
        text = line.replace(str(REPO), "<repo>").replace(str(run.run_dir.parents[1]), "<tmp>")
        if "hpar" in text.lower():
            assert text.startswith(OWN_LINES), line
    for p in [run.run_dir, *run.run_dir.rglob("*")]:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"
