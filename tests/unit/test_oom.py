"""Out-of-memory forensics on CPU: the observer trampoline (torch's attach function stood in for, as a
CPU build has none), the record written once from an injected allocator snapshot, the uncaught error
through ``sys.excepthook``, owners from tensor metadata, and the whole path in a real process under
``hpar-agent run`` (a ``torch.OutOfMemoryError`` raised for real: CPU torch has the class)."""

from __future__ import annotations

import json
import os
import pickle
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpar_agent import memory_forensics as mf
from hpar_agent.agent import Agent
from hpar_agent.collectors.oom import OomCollector
from hpar_agent.tools.report import build_report
from hpar_agent.torch_compat import cuda_memory
from testkit.zerocode import hpar_run

MiB, GiB = 1 << 20, 1 << 30
CUDA0 = torch.device("cuda", 0)
HERE = os.path.basename(__file__)


def fake_snapshot(site_file: str = "/jobs/llm/train.py") -> dict[str, Any]:
    """Shaped as ``torch.cuda.memory._snapshot()``: two segments of device 0 (one block of each state),
    one of device 1, and device 0's trace ending with the failed request."""
    frames = [
        {
            "filename": os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py"),
            "line": 125,
            "name": "forward",
        },
        {"filename": site_file, "line": 42, "name": "step"},
    ]  # innermost first, as torch gives them
    return {
        "segments": [
            {
                "device": 0,
                "total_size": 64 * MiB,
                "allocated_size": 48 * MiB,
                "blocks": [
                    {"address": 0x1000, "size": 48 * MiB, "state": "active_allocated", "frames": frames},
                    {"address": 0x1000 + 48 * MiB, "size": 16 * MiB, "state": "inactive", "frames": []},
                ],
            },
            {
                "device": 0,
                "total_size": 20 * MiB,
                "allocated_size": 2 * MiB,
                "blocks": [
                    {"address": 0x9000_0000, "size": 2 * MiB, "state": "active_allocated", "frames": []},
                    {"address": 0x9000_0000 + 2 * MiB, "size": 18 * MiB, "state": "inactive", "frames": []},
                ],
            },
            {
                "device": 1,
                "total_size": 999 * MiB,
                "allocated_size": 999 * MiB,
                "blocks": [{"address": 0x5, "size": 999 * MiB, "state": "active_allocated", "frames": []}],
            },
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 0x1000, "size": 48 * MiB, "frames": frames},
                {"action": "oom", "device_free": 1 * MiB, "size": 2 * GiB, "frames": frames},
            ],
            [],
        ],
    }


STATS = {"allocated_bytes.all.current": 50 * MiB, "reserved_bytes.all.current": 84 * MiB}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """An agent on "cuda:0" (as attach fixes it on a GPU rank) whose oom component reads the fake
    snapshot and allocator counters; the excepthook before attach is a recorder."""
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path / "run"), interval=3600.0)
    a.start()
    a.device = a.context.device = CUDA0
    old = a.component("oom")
    assert old is not None
    old.uninstall()
    a.components.remove(old)
    a._step_hooks.remove(old)
    a.add_component(OomCollector(snapshot=lambda dev: fake_snapshot(), stats=lambda dev: STATS))
    try:
        yield a
    finally:
        a.stop()


def _oom(a: Agent) -> OomCollector:
    comp = a.component("oom")
    assert isinstance(comp, OomCollector)
    return comp


def _allocating_site(comp: OomCollector) -> None:
    """Stands for the user's code whose allocation failed (the observer runs inside it)."""
    comp.on_allocator_oom(0, 2 * GiB, 80 * GiB, 1 * MiB)


def _events(a: Agent, kind: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in Path(a.events.path or "").read_text().splitlines()
        if json.loads(line)["kind"] == kind
    ]


# ------------------------------------------------------------------------------------------ the observer
def test_the_trampoline_calls_the_current_handler_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    attached: list[Any] = []
    monkeypatch.setattr(cuda_memory, "_attached", False)
    monkeypatch.setattr(cuda_memory, "_handler", None)
    monkeypatch.setattr(cuda_memory, "_unavailable", False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    calls: list[tuple[int, ...]] = []
    assert not cuda_memory.observe_ooms(lambda *a: calls.append(a))  # attaching would initialize CUDA
    assert attached == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    def handler(*args: int) -> None:
        calls.append(args)
        raise RuntimeError("a bug in the agent")  # would replace the user's OutOfMemoryError

    assert cuda_memory.observe_ooms(handler)
    (fn,) = attached
    fn(0, 2 * GiB, 80 * GiB, MiB)  # as the allocator calls it: no exception comes out
    assert calls == [(0, 2 * GiB, 80 * GiB, MiB)]
    assert cuda_memory.observe_ooms(handler) and len(attached) == 1  # torch cannot detach: attached once
    cuda_memory.stop_observing(handler)
    fn(0, 1, 2, 3)
    assert len(calls) == 1


def test_an_allocator_without_observers_is_tried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def refuse(fn: Any) -> None:  # what an allocator backend without observers answers
        calls.append(fn)
        raise RuntimeError("cudaMallocAsync does not support attachOutOfMemoryObserver")

    monkeypatch.setattr(cuda_memory, "_attached", False)
    monkeypatch.setattr(cuda_memory, "_unavailable", False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", refuse, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not cuda_memory.observe_ooms(lambda *a: None) and not cuda_memory.observe_ooms(lambda *a: None)
    assert len(calls) == 1  # a step hook asking every step costs one flag test


def test_on_a_cpu_build_the_observer_is_unavailable() -> None:
    assert not hasattr(torch._C, "_cuda_attach_out_of_memory_observer")  # this suite runs CPU torch
    assert cuda_memory.observe_ooms(lambda *a: None) is False
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------------------------------ the record
def test_the_first_oom_writes_the_record_once_then_counts(agent: Agent) -> None:
    oom = _oom(agent)
    _allocating_site(oom)
    rec = oom.record
    assert rec is not None and rec["source"] == "allocator" and rec["fatal"] is False
    assert rec["step"] == 0 and rec["requested_bytes"] == 2 * GiB and rec["device_free_bytes"] == MiB
    assert rec["headroom_bytes"] == MiB + 34 * MiB  # free + the allocator's cache (reserved - allocated)
    assert rec["site"] == "train.py:42 in step"  # the snapshot's OOM trace entry names the request's code
    (stack,) = rec["stacks"].values()
    assert stack[-1].endswith("in _allocating_site") and HERE in stack[-1]  # the live stack, agent frames cut
    snap = rec["snapshot"]
    assert snap["segments"] == 2 and snap["reserved_bytes"] == 84 * MiB  # device 0's only
    assert snap["largest_free_block_bytes"] == 18 * MiB and snap["free_bytes"] == 34 * MiB
    assert snap["largest_blocks"][0] == {"bytes": 48 * MiB, "owner": "", "site": "train.py:42 in step"}
    assert snap["live_bytes_by_site"] == {"train.py:42 in step": 48 * MiB} and snap["history"]
    assert rec["owners"] == {
        "source": "no model known",
        "bytes_by_kind": {"other": 50 * MiB},
        "largest": [],
        "partial": False,
    }
    files = rec["evidence"]
    assert sorted(p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p in files) == [
        "allocator.pickle",
        "oom.json",
        "pyspy.json",
        "pyspy.txt",
    ]
    for p in files:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and "OutOfMemory.rank0." in p
    pick = next(p for p in files if p.endswith(".pickle"))
    assert pickle.loads(Path(pick).read_bytes()) == fake_snapshot()  # the snapshot itself, for memory_viz
    saved = json.loads(Path(next(p for p in files if p.endswith(".oom.json"))).read_text())
    assert saved["site"] == rec["site"] and saved["snapshot"] == snap
    assert "_allocating_site" in Path(next(p for p in files if p.endswith("pyspy.txt"))).read_text()
    (event,) = _events(agent, "oom")
    assert event["evidence"] == files and event["step"] == 0

    _allocating_site(oom)  # a caught OOM retried: counted, nothing more written
    _allocating_site(oom)
    assert oom.count == 3 and oom.record is rec and len(_events(agent, "oom")) == 1
    assert len(os.listdir(Path(agent.run_dir) / "evidence")) == 4
    assert agent.summary()["components"]["oom"] == {"observer": False, "count": 3, "record": rec}


def test_the_observer_keeps_no_reference_to_the_programs_locals(agent: Agent) -> None:
    """A program that catches the error goes on: reading its frames' locals before Python 3.13 would
    leave a snapshot of them on each frame, keeping the batch that did not fit alive."""
    batch = torch.ones(1000)
    model = Net()  # not given to attach: on the stack only
    before = sys.getrefcount(batch), sys.getrefcount(model)
    _allocating_site(_oom(agent))
    assert (sys.getrefcount(batch), sys.getrefcount(model)) == before
    assert _oom(agent).record["owners"]["source"] == (
        "model found on the stack" if mf.SAFE_LOCALS else "no model known"
    )


def test_a_failing_snapshot_still_leaves_a_record(agent: Agent) -> None:
    oom = _oom(agent)

    def broken(dev: Any) -> dict[str, Any]:
        raise RuntimeError("allocator is not the caching one")

    oom._snapshot = broken
    _allocating_site(oom)
    assert oom.record is not None
    assert oom.record["snapshot"] == {
        "note": "no allocator snapshot (RuntimeError: allocator is not the caching one)"
    }
    assert not any(p.endswith(".pickle") for p in oom.record["evidence"])
    assert not agent.errors


def _raise_oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


def test_an_uncaught_oom_marks_the_record_fatal_and_chains_the_previous_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    def user_hook(*args: Any) -> None:
        seen.append(args)

    monkeypatch.setattr(sys, "excepthook", user_hook)
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path / "run"), interval=3600.0)
    a.start()
    try:
        hook = sys.excepthook
        assert hook != user_hook
        try:
            _raise_oom()
        except torch.OutOfMemoryError as exc:
            hook(type(exc), exc, exc.__traceback__)
        (args,) = seen  # the user's hook still prints the traceback
        assert isinstance(args[1], torch.OutOfMemoryError)
        rec = _oom(a).record
        assert rec is not None and rec["fatal"] and rec["source"] == "exception"
        assert rec["message"] == "CUDA out of memory. Tried to allocate 2.00 GiB."
        assert rec["site"] == f"{HERE}:{_raise_oom.__code__.co_firstlineno + 1} in _raise_oom"
        assert rec["stacks"]["traceback"][-1].endswith("in _raise_oom")
        hook(ValueError, ValueError("x"), None)  # any other error: only passed on
        assert len(seen) == 2 and [e["fatal"] for e in _events(a, "oom")] == [True]
        assert a.context.exit_reason == "exception: ValueError: x"  # how the rank ended (rankstate, RankGone)
    finally:
        a.stop()
    assert sys.excepthook is user_hook  # put back at detach


# ------------------------------------------------------------------------------------------ owners
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.emb.weight  # tied: one storage, counted once

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(idx)))


def test_owners_by_kind_and_name_from_metadata() -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)).sum().backward()
    opt.step()
    emb, norm = 100 * 16 * 4, 16 * 4
    out, names = mf.owners([model], [opt], torch.device("cpu"), allocated=10 * MiB)
    by = out["bytes_by_kind"]
    assert by["parameter"] == emb + 2 * norm and by["gradient"] == emb + 2 * norm
    assert by["buffer"] == 2 * norm + 8  # running mean and var, and the int64 batch counter
    assert by["optimizer_state"] == 2 * (emb + 2 * norm) + 3 * 4  # exp_avg, exp_avg_sq, a float step each
    assert by["other"] == 10 * MiB - sum(v for k, v in by.items() if k != "other")
    top = out["largest"][0]
    assert top["bytes"] == emb and top["name"] == "emb.weight" and top["shape"] == [100, 16]
    assert "optimizer_state emb.weight.exp_avg" in names.values() and not out["partial"]
    assert mf.owners([model], [opt], CUDA0, allocated=None)[0]["bytes_by_kind"] == {}  # nothing on the GPU


def test_without_a_model_the_optimizer_names_its_parameters_by_place() -> None:
    model = Net()
    opt = torch.optim.AdamW([{"params": [model.emb.weight]}, {"params": list(model.norm.parameters())}])
    model(torch.arange(8)).sum().backward()
    opt.step()
    out, names = mf.owners([], [opt], torch.device("cpu"), allocated=None)
    assert out["bytes_by_kind"]["parameter"] == 100 * 16 * 4 + 2 * 16 * 4
    assert out["largest"][0]["name"] in ("param_groups[0][0]", "param_groups[0][0].exp_avg")
    assert {
        "parameter param_groups[1][1]",
        "gradient param_groups[0][0]",
        "optimizer_state param_groups[0][0].exp_avg_sq",
    } <= set(names.values())


def test_an_owner_scan_past_its_budget_says_partial() -> None:
    many = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(1)) for _ in range(3000))
    out, _ = mf.owners([many], [], torch.device("cpu"), allocated=None, budget_s=0.0)
    assert out["partial"] and out["bytes_by_kind"]["parameter"] == 1023 * 4


def test_the_model_and_optimizer_are_found_on_the_stack() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found: list[Any] = []

    class Probe(torch.nn.Module):  # a submodule's forward frame: its ``self`` is inside ``model``
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            found.append(mf.found_in_frames(mf.frames_up(sys._getframe())))
            return x

    model.norm = torch.nn.Sequential(Probe(), model.norm)
    model(torch.arange(4))
    ((models, optimizers),) = found
    assert models == [model] and optimizers == [opt]


def test_user_site_skips_torch_the_agent_and_the_standard_library() -> None:
    import threading

    lines = [
        f"{__file__}:10 in main",
        f"{threading.__file__}:5 in run",
        f"{torch.__file__}:3 in f",
        f"{mf.__file__}:1 in g",
    ]
    assert mf.user_site(lines) == f"{HERE}:10 in main"
    assert mf.user_site(lines[1:]) == ""


# ------------------------------------------------------------------------------------------ whole processes
SCRIPT = """
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(256, 256)

        def forward(self, x, blow):
            return self.lin(x) + (far_too_large(x) if blow else 0)

    def far_too_large(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.")

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    {attach}
    for step in range({steps} + 1):
        model(torch.randn(8, 256), blow=step == {steps}).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def _run_script(tmp_path: Path, attach: str, steps: int) -> tuple[Any, Path]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(attach=attach, steps=steps)))
    run = tmp_path / "run"
    proc = hpar_run(
        run, [sys.executable, str(script)], timeout=180, HPAR_METRICS_PORT="-1", HPAR_TRACES="none"
    )
    return proc, run


def test_zero_code_attaches_for_an_oom_in_the_first_step(tmp_path: Path) -> None:
    """A batch far too large fails in the first forward, before any optimizer step could attach the
    agent: the error attaches it, and the end of ``hpar-agent run`` says where the memory ran out."""
    proc, run = _run_script(tmp_path, attach="", steps=0)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB." in proc.stderr
    )  # as without us
    line = next(x for x in proc.stderr.splitlines() if x.startswith("  rank 0: "))
    assert line.startswith(
        "  rank 0: died of CUDA out of memory after 0 completed steps at train.py:13 in far_too_large"
    )
    summary = json.loads((run / "summary.rank0.json").read_text())
    assert summary["components"]["zerocode"]["attached_at"] == "CUDA out of memory"
    rec = summary["components"]["oom"]["record"]
    assert rec["fatal"] and rec["owners"]["source"] == "model found on the stack"
    assert rec["owners"]["bytes_by_kind"]["parameter"] == (256 * 256 + 256) * 4
    assert line.endswith(next(p for p in rec["evidence"] if p.endswith(".oom.json")))
    assert "no step boundaries seen" not in proc.stderr
    page = build_report(run).read_text()  # the report links the record and its evidence
    section = page.split("<h2>Out of memory</h2>", 1)[1].split("<h2>", 1)[0]
    assert "train.py:13 in far_too_large" in section and "Tried to allocate 20.00 GiB" in section
    for p in rec["evidence"]:
        assert f'href="evidence/{os.path.basename(p)}"' in section


def test_an_attached_agent_records_an_uncaught_oom_after_steps(tmp_path: Path) -> None:
    proc, run = _run_script(
        tmp_path, attach="import hpar_agent; hpar_agent.attach(model, optimizer=opt)", steps=3
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "  rank 0: died of CUDA out of memory after 3 completed steps at train.py:13" in proc.stderr
    rec = json.loads((run / "summary.rank0.json").read_text())["components"]["oom"]["record"]
    assert rec["owners"]["source"] == "attached model and optimizer"
    assert rec["owners"]["bytes_by_kind"]["optimizer_state"] >= 2 * (256 * 256 + 256) * 4
    assert [s for s, _ in rec["trend"]["rss"]] == [0, 1, 2]  # the memory trend before it (host RSS on CPU)
    events = [json.loads(x) for x in (run / "events.rank0.jsonl").read_text().splitlines()]
    assert [e["fatal"] for e in events if e["kind"] == "oom"] == [True]
