"""The step anatomy without a model given to ``attach`` (``hpar-agent run``, a bare ``attach()``): the model's
root is found from a data-parallel wrapper or at an optimizer step, its phases are measured as with
``attach(model)``, the verdict is the same, and what cannot be found is said (verdict unknown)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hpar_agent
from hpar_agent import topology_watch
from hpar_agent.collectors import model_root

STEPS = 6


class Net(torch.nn.Module):
    """A model whose forward takes ``fwd_s`` (a sleep: no load makes it shorter)."""

    def __init__(self, fwd_s: float = 0.0) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fwd_s = fwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fwd_s)
        return self.lin(x)


class Holder(torch.nn.Module):
    """Holds the model (so it holds the optimizer's parameters) but the loop never calls it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.fixture
def attach(tmp_path: Path) -> Iterator[Any]:
    def _attach(model: Any = None) -> Any:
        return hpar_agent.attach(
            model, metrics_port=-1, traces="none", run_dir=str(tmp_path), detectors=False, detail_rate=0.0
        )

    yield _attach
    hpar_agent.detach()
    if dist.is_initialized():
        dist.destroy_process_group()


def train(
    model: Any, steps: int = STEPS, host_s: float = 0.0, call: Any = None, opt: Any = None
) -> torch.optim.Optimizer:
    """A training loop that holds ``model`` in a local, as scripts do; ``call``: what it calls instead."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    forward = model if call is None else call
    for _ in range(steps):
        forward(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(host_s)
    return opt


def anatomy(agent: Any) -> dict[str, Any]:
    agent.tick()
    return dict(agent.component("anatomy").summary())


@pytest.mark.parametrize(
    ("fwd_s", "host_s", "verdict"), [(0.1, 0.0, "compute-bound"), (0.0, 0.2, "host-bound")]
)
def test_found_at_the_optimizer_step_the_verdict_is_attachs(
    attach, fwd_s: float, host_s: float, verdict: str
) -> None:
    """The same loop, attached with and without the model: the same phases from the third step on
    (warm-up is two), and the same verdict."""
    got = {}
    for arm in ("attach(model)", "optimizer step"):
        model = Net(fwd_s)
        agent = attach(model if arm == "attach(model)" else None)
        train(model, host_s=host_s)
        got[arm] = a = anatomy(agent)
        hpar_agent.detach()
        assert a["model"] == {"class": "Net", "found_by": arm}
        assert set(a["phase_seconds_p50"]) == {"data_wait", "host", "forward", "backward", "optimizer"}, a
        assert a["evidence"]["steps"] == STEPS - 2 and a["verdict"] == verdict, a
        assert a["phase_seconds_p50"]["forward"] >= fwd_s and a["phase_seconds_p50"]["host"] >= host_s
    hists = agent.component("anatomy").hists
    assert hists["forward"].count == STEPS - 1  # found at step 0's optimizer step: timed from step 1 on
    assert got["attach(model)"]["verdict"] == got["optimizer step"]["verdict"]


def test_a_model_nothing_names_is_unknown_with_the_reason(attach) -> None:
    """Raw tensors, no module: no forward is timed, and the verdict says so instead of compute-bound."""
    from prometheus_client import generate_latest

    agent = attach()
    w = torch.randn(4, 4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.01)
    for _ in range(STEPS):
        (torch.randn(2, 4) @ w).sum().backward()
        opt.step()
    a = anatomy(agent)
    assert a["verdict"] == "unknown" and a["model"] is None, a
    assert a["evidence"]["reason"].startswith("no forward timed: the model is not known"), a
    assert 'verdict="unknown"} 1.0' in generate_latest(agent.registry).decode()


def test_a_container_or_a_module_never_called_is_not_the_root(attach) -> None:
    """The loop holds a ModuleDict (no forward: never a root) and a Holder it never calls: the Holder,
    outermost, is tried first, dropped after a whole step without its forward, and the model taken."""
    model = Net()
    box = torch.nn.ModuleDict({"model": model})  # noqa: F841 - a local the search sees
    holder = Holder(model)
    agent = attach()
    train(model, steps=8)
    a = anatomy(agent)
    assert a["model"] == {"class": "Net", "found_by": "optimizer step"}, a
    assert "forward" in a["phase_seconds_p50"] and a["verdict"] != "unknown", a
    # the holder's hooks never ran: they stay, silent, until detach (removing hooks that compiled code
    # was traced with would recompile it)
    assert holder._forward_pre_hooks
    hpar_agent.detach()
    assert not holder._forward_pre_hooks and not holder._forward_hooks and not model._forward_pre_hooks


def test_another_models_wrapper_gives_way_to_the_stepped_models(attach) -> None:
    """A DDP wrapper built first (a frozen teacher) is not the model the optimizer steps: at the first
    step the search takes the one that holds the optimizer's parameters."""
    agent = attach()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    teacher = torch.nn.parallel.DistributedDataParallel(Net())
    assert agent.component("anatomy").hooks.root.module is teacher  # the wrapper, at once
    student = Net()
    train(student, call=lambda x: student(x) + teacher(x).detach())
    a = anatomy(agent)
    assert (
        a["model"] == {"class": "Net", "found_by": "optimizer step"}
        and agent.component("anatomy").hooks.root.module is student
    )
    assert not teacher._forward_pre_hooks


def test_fully_shard_moves_the_root_outwards(attach) -> None:
    """On the fake process group, FSDP2 wraps a block, then the whole model: the root moves outwards
    with it; another model's wrapper, not around the root, does not take it."""
    from torch.distributed.fsdp import fully_shard

    agent = attach()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    comp = agent.component("anatomy")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0])
    assert comp.hooks.root.module is model[0] and comp.hooks.root.found_by == "wrapper"
    fully_shard(model)
    assert (
        comp.hooks.root.module is model and comp.hooks._fwd_pre not in model[0]._forward_pre_hooks.values()
    )  # moved, not added
    torch.nn.parallel.DistributedDataParallel(Net())
    assert comp.hooks.root.module is model


def test_a_ddp_built_before_attach_is_the_root_from_step_0(attach) -> None:
    """Under ``hpar-agent run`` the shim watches for wrappers before the agent attaches: a DDP built
    then is the root at attach, every step is timed, and detach leaves no hook on it."""
    topology_watch.install("shim")  # what the zero-code shim does once torch is imported
    try:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # DDP trains on it
        ddp = torch.nn.parallel.DistributedDataParallel(Net())
        agent = attach()
        comp = agent.component("anatomy")
        assert comp.hooks.root.module is ddp
        assert len(ddp.module._forward_pre_hooks) == 1  # evaluations through ddp.module are marked
        train(ddp)
        a = anatomy(agent)
        assert a["model"] == {"class": "DistributedDataParallel", "found_by": "wrapper"}, a
        assert comp.hists["forward"].count == STEPS
        hpar_agent.detach()
        assert not ddp._forward_pre_hooks and not ddp._forward_hooks and not ddp.module._forward_pre_hooks
        assert comp.hooks._on_source not in topology_watch._state.listeners
    finally:
        topology_watch.uninstall("shim")


def test_a_compiled_model_is_timed_at_its_compiled_wrapper(attach) -> None:
    """``attach(model)`` then ``torch.compile(model)`` called: the model's own hooks run inside the
    compiled code (silent), so at the optimizer step the compiled wrapper, which holds the model, is
    taken; its hooks run outside the compiled code. Nothing compiles again: the model's hooks, which
    the compiled code was traced with, stay."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    agent = attach(model)
    compiled = torch.compile(model, backend="eager")
    opt = train(model, steps=1, call=compiled)
    graphs = counters["stats"]["unique_graphs"]
    train(model, steps=8, call=compiled, opt=opt)
    assert counters["stats"]["unique_graphs"] == graphs
    a = anatomy(agent)
    assert a["model"] == {"class": "OptimizedModule", "found_by": "optimizer step"}, a
    assert "forward" in a["phase_seconds_p50"] and a["verdict"] != "unknown", a


def test_a_compiled_wrapper_found_at_the_optimizer_step_compiles_nothing_again(attach) -> None:
    """``torch.compile`` of a wrapper (``.module`` holding every parameter, as DDP's): the root taken at
    the optimizer step is the compiled wrapper, whose ``.module`` (forwarded to the wrapper's) runs
    inside the compiled code: no hook goes on it, and nothing compiles again."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    wrapper = Holder(model)
    wrapper.module = wrapper.inner  # a second name for it, as DDP's
    compiled = torch.compile(wrapper, backend="eager")
    assert model_root.wrapped(wrapper) is model and model_root.wrapped(compiled) is None
    agent = attach()
    opt = train(model, steps=1, call=compiled)
    graphs = counters["stats"]["unique_graphs"]
    train(model, steps=8, call=compiled, opt=opt)
    assert counters["stats"]["unique_graphs"] == graphs
    assert anatomy(agent)["model"] == {"class": "OptimizedModule", "found_by": "optimizer step"}
    assert not model._forward_pre_hooks


def test_a_wrapper_found_at_the_optimizer_step_puts_no_hook_on_the_compiled_model_it_wraps(attach) -> None:
    """A wrapper the loop calls, of a model compiled in place (``model.compile()``: its hooks run inside
    the compiled code), found at the first optimizer step: a hook added to that model then would not run
    (dynamo skips hook guards by default) or would recompile it, so none is added and an evaluation
    through it goes unmarked."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = Holder(torch.nn.Linear(4, 4))  # a module of a user's file: dynamo compiles its forward
    model.compile(backend="eager")
    wrapper = Holder(model)
    wrapper.module = wrapper.inner
    assert model_root.wrapped(wrapper) is model
    agent = attach()
    opt = train(model, steps=1, call=wrapper)
    graphs = counters["stats"]["unique_graphs"]
    train(model, steps=8, call=wrapper, opt=opt)
    assert anatomy(agent)["model"] == {"class": "Holder", "found_by": "optimizer step"}
    assert not model._forward_pre_hooks
    assert counters["stats"]["unique_graphs"] == graphs > 0


def test_find_root_takes_the_outermost_holder_with_most_parameters() -> None:
    a, b = Net(), Net()
    outer = Holder(a)
    opt = torch.optim.SGD([*a.parameters(), next(b.parameters())], lr=0.1)  # all of a, one of b
    assert model_root.find_root(opt, torch.nn.Module) is outer
    assert model_root.find_root(opt, torch.nn.Module, skip=[outer]) is a
    unheld = torch.optim.SGD(
        torch.nn.Linear(4, 4).parameters(), lr=0.1
    )  # its module is gone: no frame holds it
    assert model_root.find_root(unheld, torch.nn.Module) is None


def test_find_root_reads_a_trainers_attributes_and_their_lists() -> None:
    """A trainer object that keeps its model parts in a list (as the reference trainer does): found one
    attribute down, in the list; a dict's items are not read."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(parts=[Net()], by_name={"other": Net()})
    found = model_root.find_root(torch.optim.SGD(trainer.parts[0].parameters(), lr=0.1), torch.nn.Module)
    assert found is trainer.parts[0]
    hidden = model_root.find_root(
        torch.optim.SGD(trainer.by_name["other"].parameters(), lr=0.1), torch.nn.Module
    )
    assert hidden is None


def test_the_search_does_not_look_into_python_modules(recwarn: pytest.WarningsRecorder) -> None:
    """A frame that holds ``torch.distributed`` (a script's ``import torch.distributed as dist``): its
    namespace is not searched, so its deprecated ``reduce_op`` never prints a FutureWarning into the
    user's output."""
    import sys

    net = torch.nn.Linear(2, 2)
    distributed = dist  # noqa: F841 (held by the frame the search reads)
    found = model_root.candidates(sys._getframe(), torch.nn.Module)
    assert found and found[0] is net
    assert not [w for w in recwarn if "reduce_op" in str(w.message)], [str(w.message) for w in recwarn]
