"""The model's FLOPs per step, counted once by torch's flop counter on a steady step, against the count
for a GPT-style model (6N a token: N the matmul weights). On CPU torch's counter has no formula for the
CPU attention kernel, so the attention term (12 L H Q T a token) is checked on a GPU
(``tests/gpu/test_mfu.py``); here neither a peak nor an MFU exists (no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hpar_agent
from hpar_agent.collectors.mfu import COUNT_STEP, dtype_name, peak_flops
from hpar_trainer.model import GPT, ModelArgs

ARGS = ModelArgs(vocab=256, dim=64, heads=4, layers=2, seq_len=32)


def _train(tmp_path: Path, compiled: str = "", attach_wrapper: bool = False, prepare: Any = None) -> dict:
    """Train the GPT a few steps with the agent; ``compiled``: "model" (torch.compile of the whole model),
    "blocks" (``Module.compile()`` per block, as hpar_trainer does) or "self" (``Module.compile()`` of the
    whole model: its hooks are traced). Returns the summary's MFU part,
    the 6N count and the compile counters once the count is in (after the counted step) and at the end."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(ARGS)
    if prepare is not None:
        prepare(model)
    opt = torch.optim.AdamW(model.parameters())
    run = tmp_path / (compiled or "eager")
    if compiled == "blocks":
        for block in model.layers.values():
            block.compile(backend="aot_eager")
    if compiled == "self":
        model.compile(backend="aot_eager")
    fwd = torch.compile(model, backend="aot_eager") if compiled == "model" else model
    agent = hpar_agent.attach(
        fwd if attach_wrapper else model,
        metrics_port=-1,
        traces="none",
        run_dir=str(run),
        detectors=False,
        detail_rate=0,  # every step detailed: the anatomy's hooks run on each, as on a slow step
    )
    seen = []
    try:
        for step in range(COUNT_STEP + 3):
            x = torch.randint(0, ARGS.vocab, (4, ARGS.seq_len))
            F.cross_entropy(fwd(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            if step in (COUNT_STEP - 1, COUNT_STEP + 2):  # warmed up; counted (the tick counts) and on
                agent.tick()
                seen.append((dict(counters["frames"]), dict(counters["stats"])))
    finally:
        hpar_agent.detach()
    summary = json.loads((run / "summary.rank0.json").read_text())["components"]
    n = ARGS.layers * 12 * ARGS.dim**2 + ARGS.dim * ARGS.vocab  # q, k, v, o, mlp in/out, head
    return {"mfu": summary["mfu"], "expected": 4 * ARGS.seq_len * 6 * n, "counters": seen, "compile": summary}


def _eager_count() -> int:
    """torch's flop counter over a real forward and backward of the same model and batch shape, uncompiled."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GPT(ARGS)
    x = torch.randint(0, ARGS.vocab, (4, ARGS.seq_len))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    return counter.get_total_flops()


def test_flops_per_step_are_counted_once_on_a_steady_step(tmp_path: Path) -> None:
    got = _train(tmp_path)
    flops = got["mfu"]["flops_per_step"]
    assert flops == pytest.approx(got["expected"], rel=0.01), got
    assert got["mfu"]["method"] == "flop counter"
    assert got["mfu"]["mfu"] is None and got["mfu"]["peak_flops"] is None  # no GPU: no peak


def test_a_gradient_penalty_trains_through_the_counted_step(tmp_path: Path) -> None:
    """``torch.autograd.grad`` over a leaf input (a gradient penalty; a zero-bubble pipeline's input
    backward) in the counted step: the flop counter's per-module tracker made it raise (pytorch#131753);
    the step trains and is counted, its penalty's double backward included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = tmp_path / "penalty"
    hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=str(run), detectors=False)
    try:
        for _ in range(COUNT_STEP + 3):
            x = torch.randn(32, 16, requires_grad=True)
            out = model(x)
            (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.mean() + grad.pow(2).sum(1).sub(1).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
    finally:
        hpar_agent.detach()
    mfu = json.loads((run / "summary.rank0.json").read_text())["components"]["mfu"]
    forward = 2 * 32 * (16 * 64 + 64)
    assert mfu["method"] == "flop counter" and mfu["flops_per_step"] > 3 * forward, mfu


@pytest.mark.parametrize(
    ("compiled", "attach_wrapper"), [("model", False), ("model", True), ("blocks", False), ("self", False)]
)
def test_a_compiled_model_is_counted_on_fake_tensors_without_recompiling(
    tmp_path: Path, compiled: str, attach_wrapper: bool
) -> None:
    """torch.compile of the model (attached unwrapped, the anatomy's root then found at the wrapper, or
    the wrapper itself), per-block compile and ``Module.compile()`` of the whole model: the same FLOPs as the eager count of the same model and
    batch, and dynamo compiles nothing more once warmed up (the count ran between the two readings)."""
    got = _train(tmp_path, compiled, attach_wrapper)
    assert got["mfu"]["flops_per_step"] == _eager_count(), got["mfu"]
    assert got["mfu"]["method"] == "flop counter on fake tensors", got["mfu"]
    assert got["mfu"]["count_seconds"] > 0
    warm, after = got["counters"]
    assert warm == after, got["counters"]
    assert not got["compile"]["compile"]["recompiles"]


def test_the_transformer_count_against_the_flop_counter() -> None:
    """6N + 12 L H Q T a token from the GPT's structure and the input shape, against torch's flop
    counter over a real forward and backward of the same batch: within 10 %; without the attention term
    (the counter has no formula for the CPU attention kernel) exactly equal."""
    from hpar_agent.collectors.mfu_count import Call, transformer_flops
    from hpar_agent.torch_compat.fake_model import spec

    calls: list[Call] = [((spec(torch.zeros(4, ARGS.seq_len, dtype=torch.long)),), {})]
    flops, figures = transformer_flops(torch.compile(GPT(ARGS), backend="eager"), calls)
    counted = _eager_count()
    assert flops == pytest.approx(counted, rel=0.1), figures
    attention = 4 * ARGS.seq_len * 12 * ARGS.layers * ARGS.dim * ARGS.seq_len
    assert flops - attention == counted, figures
    assert figures.startswith(f"N={ARGS.layers * 12 * ARGS.dim**2 + ARGS.dim * ARGS.vocab}, L=2, HQ=64, T=32")


def test_a_compiled_model_the_fake_run_cannot_take_gets_the_transformer_count(tmp_path: Path) -> None:
    """A block branching on a tensor's value (data-dependent: no fake run): the count for transformer
    blocks, and the summary says which method and why."""

    def branch(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h * 1.0 if bool(h.sum() > -1e30) else h

    def build(model: GPT) -> None:
        for block in model.layers.values():
            block.inject_hook = branch

    got = _train(tmp_path, "model", prepare=build)
    mfu = got["mfu"]
    assert mfu["method"] == "transformer blocks", mfu
    assert "could not run on fake tensors" in mfu["reason"] and "L=2" in mfu["reason"], mfu
    attention = 4 * ARGS.seq_len * 12 * ARGS.layers * ARGS.dim * ARGS.seq_len
    assert mfu["flops_per_step"] == got["expected"] + attention, mfu


REFUSE = """
import torch, torch.distributed as dist
from torch import nn
import torch.distributed._functional_collectives as funcol
from hpar_agent.torch_compat.fake_model import Refused, count_flops, spec
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
class M(nn.Module):
    def __init__(self, functional):
        super().__init__()
        self.lin, self.functional = nn.Linear(8, 8), functional
    def forward(self, x):
        y = self.lin(x)
        return funcol.all_reduce(y, "sum", dist.group.WORLD) if self.functional else (dist.all_reduce(y), y)[1]
for functional in (False, True):
    try:
        count_flops(M(functional), [((spec(torch.zeros(2, 8)),), {})])
    except Refused as exc:
        print("refused:", exc)
dist.destroy_process_group()
"""


def test_the_fake_run_refuses_a_process_group_op_in_the_forward() -> None:
    """A collective in the forward (c10d and functional) raises in the agent thread's fake run instead
    of reaching the process group (an extra collective there would desynchronise the ranks)."""
    res = subprocess.run([sys.executable, "-c", REFUSE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and "c10d.allreduce_" in lines[0] and "_c10d_functional.all_reduce" in lines[1], (
        lines
    )


FSDP1 = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
import hpar_agent
from hpar_agent.collectors.mfu import COUNT_STEP
dist.init_process_group("gloo")
model = FSDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)), device_id=torch.device("cpu"),
             use_orig_params=True)
fwd = torch.compile(model, backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
agent = hpar_agent.attach(model, metrics_port=0, traces="none", run_dir=sys.argv[1], detectors=False)
for step in range(COUNT_STEP + 4):
    fwd(torch.randn(4, int(sys.argv[2]), 16) if sys.argv[2] != "0" else torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    agent.tick()
hpar_agent.detach()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("seq", [8, 0], ids=["sequence", "no-sequence"])
def test_a_compiled_fsdp_wrapper_trains_through_the_count(tmp_path: Path, seq: int) -> None:
    """A copy of FSDP's wrapper shares its flat-parameter state: under ``hpar-agent run`` its fake forward
    on the agent thread changed it during the training's backward, which died ("Expects to only be
    called in the post-backward"). It is refused; the count takes the Linears' features (FSDP's views
    hold this rank's shard between steps: N was half), and an input of (batch, features) is no sequence
    of tokens: unknown, where it counted the features as a sequence."""
    script = tmp_path / "fsdp1.py"
    script.write_text(FSDP1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    res = subprocess.run(
        [*cmd, str(script), str(tmp_path), str(seq)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    mfu = json.loads((tmp_path / "summary.rank0.json").read_text())["components"]["mfu"]
    assert "FullyShardedDataParallel" in mfu["reason"], mfu
    if seq:
        assert mfu["method"] == "transformer blocks", mfu
        assert mfu["flops_per_step"] == 4 * seq * 6 * (16 * 64 + 64 * 16), mfu
    else:
        assert mfu["flops_per_step"] is None and mfu["reason"].startswith("unknown"), mfu


def test_the_input_hook_counts_its_failure_and_never_raises() -> None:
    from hpar_agent.collectors.mfu_count import InputCapture

    errors: list[BaseException] = []
    cap = InputCapture(errors.append)
    cap._pre(None, (torch.zeros(2, 3),), None)  # kwargs None: reading them fails inside the hook
    assert len(errors) == 1 and cap.calls == []
    cap._pre(None, (torch.zeros(2, 3),), {})
    assert len(cap.calls) == 1 and cap.calls[0][0][0][0] == (2, 3)


def test_peak_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "tf32") == 494.7e12
    assert peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert dtype_name(torch.float32, tf32=True) == "tf32" and dtype_name(torch.bfloat16, tf32=False) == "bf16"


SHARDED = """
import json, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import hpar_agent
from hpar_agent.collectors.mfu import COUNT_STEP
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
model = parallelize_module(
    nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
agent = hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=sys.argv[1], detectors=False)
for _ in range(COUNT_STEP + 3):
    model(torch.randn(4, 8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    agent.tick()
hpar_agent.detach()
dist.destroy_process_group()
"""


def test_an_eager_model_with_dtensor_parameters_is_counted_by_its_local_shards(tmp_path: Path) -> None:
    """torch's flop counter sees a DTensor's global shapes (tp times a rank's own work), so an eager
    tensor-parallel model goes the compiled models' way: its fake copy is refused and the transformer
    count takes this rank's shards (here a 1-rank mesh: 6 N a token, N the two Linears' weights)."""
    res = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    mfu = json.loads((tmp_path / "summary.rank0.json").read_text())["components"]["mfu"]
    assert mfu["method"] == "transformer blocks", mfu
    assert "DTensor" in mfu["reason"], mfu
    assert mfu["flops_per_step"] == 4 * 8 * 6 * (16 * 32 + 32 * 16), mfu
