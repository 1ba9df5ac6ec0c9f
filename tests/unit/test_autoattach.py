"""Zero-code mode's triggers, each in a fresh interpreter under the shim: a process is observed once it
trains (steps an optimizer, compiles, asks for ``hpar_agent.current()``), never because it imported
torch; the first step is counted; arming costs no heavy import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from hpar_agent.tools.run_cmd import child_env
from tests.unit.test_sitecustomize import _clean_env


def _run(tmp_path: Path, code: str, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[int, Any]]:
    run_dir = tmp_path / "run"
    full = {
        **_clean_env(),
        **child_env({}, run_dir),
        "HPAR_METRICS_PORT": "-1",
        "HPAR_TRACES": "none",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = {
        int(p.stem.split("rank")[-1]): json.loads(p.read_text()) for p in run_dir.glob("summary.rank*.json")
    }
    return proc, sums


def test_first_optimizer_step_attaches_and_is_counted(tmp_path: Path) -> None:
    """No process group: the first ``opt.step()`` attaches (inside that step, after the user's own
    global pre-hook: torch iterates over those while the agent registers its own) and counts it."""
    proc, sums = _run(
        tmp_path,
        """
        import sys, torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        seen = []
        register_optimizer_step_pre_hook(lambda opt, a, k: seen.append(1))  # the user's, after the shim's
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.1)
        assert "hpar_agent.agent" not in sys.modules  # nothing attached before the step
        for _ in range(3):
            w.grad = torch.ones(4)
            opt.step()
        print(len(seen), "_optimizer_step_code" in vars(opt))
    """,
    )
    assert proc.stdout.split() == ["3", "False"]  # the user's hook ran every step; the one-off seam is gone
    (s,) = sums.values()
    assert s["components"]["zerocode"]["attached_at"] == "optimizer step"
    assert s["components"]["steps"]["steps"] == 3
    assert s["topology"]["world_size"] == "1" and s["topology"]["backend"] == "none" and s["errors"] == {}


def test_first_compile_attaches_before_its_graph_even_after_a_dynamo_reset(tmp_path: Path) -> None:
    """The compile trigger is registered once dynamo is imported, again after ``reset()`` (which drops
    every callback), and attaches before the first frame: the agent's counts equal dynamo's."""
    proc, sums = _run(
        tmp_path,
        """
        import json, torch, torch._dynamo
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        f = torch.compile(lambda x: (x * 2).sin() + 1, backend="eager")
        f(torch.ones(3)); f(torch.ones(3, 2))  # a second shape: a recompile
        print(json.dumps({"graphs": counters["stats"]["unique_graphs"]}))
    """,
    )
    dynamo = json.loads(proc.stdout.strip().splitlines()[-1])
    (s,) = sums.values()
    comp = s["components"]["compile"]
    assert s["components"]["zerocode"]["attached_at"] == "compile"
    assert comp["graphs_compiled"] == dynamo["graphs"] >= 2 and comp["backends"] == ["eager"]
    assert (
        s["components"]["steps"]["steps"] == 0 and "note" in s["components"]["zerocode"]
    )  # no step: the advice


def test_a_process_that_never_trains_is_never_observed(tmp_path: Path) -> None:
    """Importing torch, torch.distributed and dynamo, building an optimizer and a compiled function
    without running it, iterating a DataLoader with forked workers: nothing attaches, no file, no
    port, and the agent's modules are never even imported (the shim's cost stays the light ones)."""
    proc, sums = _run(
        tmp_path,
        """
        import json, sys, torch, torch.distributed, torch._dynamo
        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        fn = torch.compile(lambda x: x + 1)
        data = torch.utils.data.DataLoader(torch.arange(16.0), batch_size=4, num_workers=2)
        total = sum(float(b.sum()) for b in data)
        print(json.dumps(sorted(m for m in sys.modules if m.startswith(("hpar_agent", "prometheus_client")))))
    """,
    )
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sums == {} and not (tmp_path / "run").exists()
    assert set(loaded) <= {
        "hpar_agent",
        "hpar_agent._version",
        "hpar_agent.config",
        "hpar_agent.catalogue",
        "hpar_agent.thresholds",
        "hpar_agent.autoattach",
        "hpar_agent.topology_watch",
        "hpar_agent.torch_compat",
        "hpar_agent.torch_compat.parallel",
        "hpar_agent.torch_compat.pipelining",  # the stage hook points' names (standard library only)
        "hpar_agent.torch_compat.dynamo",
    }, loaded
    assert "hpar_agent.autoattach" in loaded  # armed all the same


def test_current_attaches_on_first_use(tmp_path: Path) -> None:
    """A loop with no optimizer and no process group marks its steps with the call the advice names."""
    _, sums = _run(
        tmp_path,
        """
        import torch, hpar_agent
        assert hpar_agent.agent._current is None
        for _ in range(4):
            (torch.randn(4, 4) @ torch.randn(4, 4)).sum()
            hpar_agent.current().step()
    """,
    )
    (s,) = sums.values()
    assert s["components"]["zerocode"]["attached_at"] == "hpar_agent.current()"
    assert s["components"]["steps"]["steps"] == 4


def test_a_disabled_agent_is_tried_once_not_at_every_step(tmp_path: Path) -> None:
    """HPAR_DISABLE set after the shim ran (the agent's own switch): the first step tries to attach and
    gets the no-op agent; later steps do not try again."""
    proc, sums = _run(
        tmp_path,
        """
        import os, torch, hpar_agent
        os.environ["HPAR_DISABLE"] = "1"
        w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.SGD([w], lr=0.1)
        w.grad = torch.ones(4)
        calls, attach = [], hpar_agent.attach
        hpar_agent.attach = lambda *a, **k: calls.append(1) or attach(*a, **k)
        for _ in range(5):
            opt.step()
        print(len(calls))
    """,
    )
    assert sums == {} and proc.stdout.split() == ["1"]


def test_fork_child_of_an_unobserved_parent_attaches_on_its_own(tmp_path: Path) -> None:
    """``multiprocessing.Process`` (fork) children inherit the armed state; one that trains attaches
    and writes its summary although such a child ends with ``os._exit`` (no atexit)."""
    _, sums = _run(
        tmp_path,
        """
        import multiprocessing, torch
        def child():
            w = torch.nn.Parameter(torch.ones(4)); opt = torch.optim.SGD([w], lr=0.1)
            for _ in range(2):
                w.grad = torch.ones(4); opt.step()
        p = multiprocessing.get_context("fork").Process(target=child); p.start(); p.join()
        assert p.exitcode == 0
    """,
    )
    (s,) = sums.values()
    assert (
        s["components"]["steps"]["steps"] == 2
        and s["components"]["zerocode"]["attached_at"] == "optimizer step"
    )


def test_a_dataloader_worker_that_compiles_is_not_observed(tmp_path: Path) -> None:
    """A worker's dataset code may compile (a compiled transform): the worker still never attaches;
    the parent that trains does."""
    _, sums = _run(
        tmp_path,
        """
        import torch
        class Data(torch.utils.data.Dataset):
            def __len__(self): return 4
            def __getitem__(self, i):
                return torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2)) + i
        w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        for b in torch.utils.data.DataLoader(Data(), batch_size=2, num_workers=2):
            w.grad = b.sum(0); opt.step()
    """,
    )
    assert list(sums) == [0]
    (s,) = sums.values()
    assert (
        s["components"]["zerocode"]["attached_at"] == "optimizer step"
        and s["components"]["steps"]["steps"] == 2
    )
    kinds = [
        json.loads(line)["kind"]
        for line in (tmp_path / "run" / "events.rank0.jsonl").read_text().splitlines()
    ]
    assert kinds.count("attach") == 1, kinds  # a worker would have attached as rank 0 too
