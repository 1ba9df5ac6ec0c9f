"""The adapters over torch's private names, on the torch installed: each finds its name on real torch
objects (a torch release that moves one fails here first), and reads as "none" where the name is
missing. The flight recorder, dynamo and allocator adapters have their own tests (test_collectives,
test_compile, test_oom)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpar_agent.torch_compat import autograd, dataloader, dynamo, optim, parallel, pipelining, probe
from hpar_agent.torch_compat import flight_recorder as fr


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo group (DDP, FSDP2, meshes and pipeline stages build on it)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_default_store_is_the_groups_and_none_without_one(group: None) -> None:
    store = parallel.default_store()
    store.set("k", "v")
    assert store.get("k") == b"v"
    dist.destroy_process_group()
    assert parallel.default_store() is None
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())  # for the fixture


def test_a_mesh_s_flattened_dims(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    assert parallel.flattened_meshes(mesh) == {}
    flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    assert parallel.flattened_meshes(mesh) == {"dp": flat}
    assert parallel.flattened_meshes(SimpleNamespace()) == {}


def test_fsdp2_s_policy_its_shards_and_their_local_tensors(group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    assert parallel.fsdp_mixed_precision(model) == policy
    assert parallel.fsdp_mixed_precision(torch.nn.Linear(2, 2)) is None
    p = next(model.parameters())
    assert isinstance(p, DTensor) and [parallel.is_shard(pl) for pl in p.placements] == [True]
    local = parallel.local_tensor(p)
    assert type(local) is torch.Tensor and local.shape == p.shape  # one rank holds the whole
    plain = torch.ones(2)
    assert parallel.local_tensor(plain) is plain
    assert parallel.is_shard(Shard(0)) and parallel.is_shard(_StridedShard(0, split_factor=2))
    assert not parallel.is_shard(Replicate())


def test_ddp_s_comm_hooks(group: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    assert parallel.ddp_comm_hooks(ddp) == []
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert parallel.ddp_comm_hooks(ddp) == [default_hooks.fp16_compress_hook]
    assert parallel.ddp_comm_hooks(torch.nn.Linear(2, 2)) == []
    assert parallel.ddp_comm_hooks(SimpleNamespace(_comm_hooks=[object()])) == []  # not (hook, state)


def test_the_replicate_module_class_once_imported() -> None:
    import torch.distributed._composable.replicate_with_fsdp as replicate

    assert parallel.REPLICATE_MODULE in sys.modules
    assert parallel.replicate_module_class() is replicate.ReplicateModule


def test_a_schedule_s_stages(group: None) -> None:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    cpu = torch.device("cpu")
    single = PipelineStage(torch.nn.Linear(4, 4), 0, 1, cpu)
    assert pipelining.schedule_stages(ScheduleGPipe(single, 2)) == [single]
    looped = [PipelineStage(torch.nn.Linear(4, 4), i, 2, cpu) for i in range(2)]
    assert pipelining.schedule_stages(ScheduleInterleaved1F1B(looped, 2)) == looped
    assert pipelining.schedule_stages(SimpleNamespace()) == []


def test_what_a_stage_says_and_where_its_hooks_are(group: None) -> None:
    """The names the topology watch patches exist (a rename would leave every rank at stage 0)."""
    import importlib

    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
    assert pipelining.stage_info(stage) == pipelining.StageInfo(0, 1, 0, 1, (0,))
    assert pipelining.stage_info(SimpleNamespace(stage_index=0)) is None
    points = [p for p in parallel.HOOK_POINTS if p.kind == "stage"]
    assert len(points) == 5
    for p in points:
        cls = getattr(importlib.import_module(p.module), p.cls)
        assert p.method in cls.__dict__, (p.cls, p.method)
        assert isinstance(stage, cls) or p.module == pipelining.SCHEDULE_MODULE


def test_queue_callback_runs_at_the_end_of_the_backward() -> None:
    queue = autograd.queue_callback()
    order: list[str] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: (order.append("hook"), queue(lambda: order.append("end")))[0])
    (y * 3).sum().backward()
    assert order == ["hook", "end"] and x.grad is not None


def test_the_data_loader_iterator_class() -> None:
    cls = dataloader.iterator_class()
    assert cls is not None
    assert isinstance(iter(torch.utils.data.DataLoader(list(range(4)))), cls)
    assert "__next__" in vars(cls)  # the method the anatomy wraps lives on that class


def test_run_in_step_runs_once_between_the_update_and_the_post_hooks() -> None:
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1.0)
    seen: list[tuple[str, float]] = []
    deferred: list[bool] = []

    def pre(o: Any, args: Any, kwargs: Any) -> None:
        if not deferred:
            deferred.append(optim.run_in_step(o, lambda: seen.append(("in step", float(w.detach())))))
            deferred.append(
                optim.run_in_step(o, lambda: seen.append(("twice", 0.0)))
            )  # one pending at a time

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(lambda o, a, k: seen.append(("post", float(w.detach()))))
    for _ in range(2):
        w.grad = torch.ones(1)
        opt.step()
    assert deferred == [True, False]
    assert seen == [("in step", 0.0), ("post", 0.0), ("post", -1.0)]  # after the update, before the post-hook
    assert "_optimizer_step_code" not in vars(opt)  # the instance is left as it was
    assert not optim.run_in_step(SimpleNamespace(), lambda: None)  # nothing to defer into


def test_dynamo_is_named_and_loaded_through_the_adapter() -> None:
    dynamo.load()
    assert dynamo.MODULE in sys.modules and hasattr(sys.modules[dynamo.MODULE], "reset")


def test_doctor_s_probes() -> None:
    assert probe.resolves("torch.optim.optimizer.register_optimizer_step_post_hook")
    assert probe.resolves(probe.HOOKS["flight recorder (gloo)"])
    assert probe.resolves(probe.HOOKS["dynamo callbacks"])
    assert not probe.resolves("torch.no_such_module.thing") and not probe.resolves("torch.cuda.no_such_name")
    assert fr.can_enable_timing() == hasattr(dist.ProcessGroup, "_enable_collectives_timing")


@pytest.mark.parametrize("backend", [None, "cpu:gloo", "gloo"])
def test_a_group_s_backend_is_the_one_its_tensors_use_whether_named_mapped_or_left_undefined(
    backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``get_backend`` says "undefined" for a group made without a backend (a bare
    ``init_process_group()``, ``init_device_mesh``): the NCCL checks read the group's device map."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    try:
        assert fr.group_backend(None) == "gloo"
        assert fr.group_timeout_s(None) is not None  # read from the gloo backend's options
        if backend is None:
            assert str(dist.get_backend()) == "undefined"  # what the helper stands in for
            # the map a CUDA host gets: its collectives on CUDA tensors run through NCCL
            monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            assert fr.group_backend(None) == "nccl"
    finally:
        dist.destroy_process_group()
