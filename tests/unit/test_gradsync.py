"""Gradient-sync coverage from synthetic flight-recorder entries and a parameter set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Replicate, Shard

from hpar_agent.collectors.gradsync import GradSyncCollector, required_elements
from tests.unit.test_collectives import L, fake, ring_at_attach  # noqa: F401 (fixtures)


class _Mesh:
    def __init__(self, **dims: int) -> None:
        self.mesh_dim_names = tuple(dims)
        self._sizes = list(dims.values())

    def size(self, i: int) -> int:
        return self._sizes[i]


class _DParam:
    """A DTensor parameter as required_elements sees one: local shard, placements, mesh."""

    requires_grad = True

    def __init__(self, local: int, mesh: _Mesh, *placements: object) -> None:
        self._local = torch.empty(local)
        self.device_mesh = mesh
        self.placements = placements

    def to_local(self) -> torch.Tensor:
        return self._local


def test_required_elements_local_shards_fsdp_and_hsdp() -> None:
    lin = nn.Linear(4, 4)  # 20 trainable elements
    frozen = nn.Parameter(torch.empty(100), requires_grad=False)
    assert required_elements([lin.weight, lin.bias, frozen, lin.weight]) == 20  # frozen and repeats out
    tp = _DParam(6, _Mesh(tp=2), Shard(0))  # DDP + TP: dp reduces the tp-local shard
    assert required_elements([tp]) == 6
    fsdp = _DParam(6, _Mesh(dp_shard=4, tp=2), Shard(0), Shard(1))  # reduce-scatter of the unsharded grad
    assert required_elements([fsdp]) == 24
    hsdp = _DParam(6, _Mesh(dp_replicate=2, dp_shard=4), Replicate(), Shard(0))  # + the shard's all-reduce
    assert required_elements([hsdp]) == 24 + 6
    rep = _DParam(6, _Mesh(dp=2), Replicate())  # composable replicate
    assert required_elements([rep]) == 6


def _coverage_agent(agent, gs_model: nn.Module) -> GradSyncCollector:
    agent.model = agent.context.model = gs_model  # as attached with this model, in a dp=2 job
    agent.topology = agent.context.topology = dataclasses.replace(agent.topology, dp=2)
    gs = agent.component("gradsync")
    assert isinstance(gs, GradSyncCollector)
    gs.up = gs.dp_up = True
    return gs


def _sample(agent, name: str, labels: dict) -> float | None:
    return agent.registry.get_sample_value(name, {**L, **labels})


def test_whole_partial_and_compressed_steps(fake) -> None:  # noqa: F811
    rec, agent, _ = fake
    gs = _coverage_agent(agent, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))  # 40 elements
    agent.step()  # step 0 ends (its window starts at attach: never judged)
    rec.add(0, 1, "1", "mesh_dp", 1, n=24)  # two DDP buckets: the whole gradient
    rec.add(1, 1, "1", "mesh_dp", 2, n=16)
    rec.add(2, 2, "3", "mesh_tp", 1, n=1000)  # tp traffic is not dp reduction
    agent.step()
    agent.tick()
    assert gs.judged == 1 and gs.coverage == pytest.approx(1.0)
    assert _sample(agent, "hpar_grad_sync_coverage_ratio", {"group": "dp"}) == pytest.approx(1.0)
    assert _sample(agent, "hpar_alert_active", {"alert": "GradSyncIncomplete"}) == 0.0

    rec.add(3, 1, "1", "mesh_dp", 3, n=40)  # bf16-compressed bucket: half the bytes, every element
    rec.entries[-1]["input_dtypes"] = ["BFloat16"]
    agent.step()
    agent.tick()
    assert gs.judged == 2 and gs.coverage == pytest.approx(1.0)

    rec.add(4, 1, "1", "mesh_dp", 4, n=24, name="gloo:all_reduce")  # a block outside DDP: 16 never reduced
    agent.step()
    agent.tick()
    assert gs.judged == 3 and gs.coverage == pytest.approx(0.6)
    assert _sample(agent, "hpar_grad_sync_coverage_ratio", {"group": "dp"}) == pytest.approx(0.6)
    assert _sample(agent, "hpar_alert_active", {"alert": "GradSyncIncomplete"}) == 1.0
    assert _sample(agent, "hpar_detector_value", {"alert": "GradSyncIncomplete"}) == pytest.approx(0.6)


def test_step_waits_until_its_collectives_are_read(fake) -> None:  # noqa: F811
    rec, agent, coll = fake
    gs = _coverage_agent(agent, nn.Linear(4, 4))
    agent.step()
    rec.add(0, 1, "1", "mesh_dp", 1, n=20)
    agent.step()
    read = coll.read_through_ns
    coll.read_through_ns = lambda: 0  # the FR read that holds step 1 has not happened yet
    agent.tick()
    assert gs.judged == -1 and gs.coverage is None
    coll.read_through_ns = read
    agent.tick()
    assert gs.judged == 1 and gs.coverage == pytest.approx(1.0)


def test_no_dp_no_coverage(fake) -> None:  # noqa: F811
    _, agent, _ = fake
    gs = agent.component("gradsync")
    assert gs is not None and not gs.up  # no model, dp 1: nothing to reduce, no series
    agent.tick()
    assert _sample(agent, "hpar_grad_sync_coverage_ratio", {"group": "dp"}) is None


def test_tp_coverage_from_gradient_samples() -> None:
    from hpar_agent.collectors.gradsync import tp_coverage

    sizes = [64, 8, 8]  # a norm fed by replicated input, q_norm and k_norm fed by this rank's heads
    clean = {0: [[1.0, 0.5, 0.7], [1.0, 1.2, 1.9]], 1: [[1.0, 0.6, 1.2], [1.0, 1.2, 1.9]]}
    assert tp_coverage(clean, sizes) == 1.0
    skipped = {0: [[1.0, 0.5, 0.7], [1.0, 0.5, 0.7]], 1: [[1.0, 0.6, 1.2], [1.0, 0.6, 1.2]]}
    assert tp_coverage(skipped, sizes) == 0.0
    half = {0: [[1.0, 0.5, 0.7], [1.0, 1.2, 0.7]], 1: [[1.0, 0.6, 1.2], [1.0, 1.2, 1.2]]}
    assert tp_coverage(half, sizes) == 0.5
    nothing_needed = {0: [[1.0, None, 2.0], [1.0, None, 2.0]], 1: [[1.0, None, 2.0], [1.0, None, 2.0]]}
    assert tp_coverage(nothing_needed, sizes) == 1.0
    assert tp_coverage({0: clean[0]}, sizes) is None  # one rank: nothing to compare


def test_tp_replicated_parameters_are_those_not_sharded_on_tp() -> None:
    from hpar_agent.collectors.gradsync import tp_replicated

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)  # plain: replicated

    model = Model()
    colwise = _DParam(6, _Mesh(tp=2), Shard(0))
    replicate_dp = _DParam(6, _Mesh(dp=2), Replicate())  # composable replicate / FSDP: dp only
    on_tp = _DParam(6, _Mesh(dp_shard=2, tp=2), Shard(0), Replicate())
    model.parameters = lambda: iter([model.norm.weight, model.norm.bias, colwise, replicate_dp, on_tp])  # type: ignore[method-assign]
    assert tp_replicated(model) == [model.norm.weight, model.norm.bias, replicate_dp, on_tp]


def test_steps_whose_reductions_the_ring_overwrote_get_no_verdict(fake) -> None:  # noqa: F811
    """Entries the ring overwrote before a read would read as gradients never
    reduced: the steps that began before the poll that found them are skipped, later ones judged again."""
    rec, agent, _ = fake
    gs = _coverage_agent(agent, nn.Linear(4, 4))  # 20 elements
    agent.step()
    rec.add(0, 1, "1", "mesh_dp", 1, n=20)
    agent.step()
    agent.tick()
    assert gs.judged == 1 and gs.coverage == pytest.approx(1.0)
    for rid, seq in ((1, 2), (2, 3)):
        rec.add(rid, 1, "1", "mesh_dp", seq, n=10)  # step 2's two buckets ...
    agent.step()
    del rec.entries[1]  # ... the first overwritten before the read
    agent.tick()
    assert agent.registry.get_sample_value("hpar_collective_unobserved_total", {**L, "pg": "dp"}) == 1
    assert gs.judged == 2 and gs.coverage == pytest.approx(1.0)  # step 2 skipped, not judged at 0.5
    assert _sample(agent, "hpar_alert_active", {"alert": "GradSyncIncomplete"}) == 0.0
    rec.add(3, 1, "1", "mesh_dp", 4, n=20)
    agent.step()  # step 3 began before that read: skipped as well
    agent.tick()
    assert gs.judged == 3 and gs.coverage == pytest.approx(1.0)
    rec.add(4, 1, "1", "mesh_dp", 5, n=10)  # step 4 reduces half: judged
    agent.step()
    agent.tick()
    assert gs.judged == 4 and gs.coverage == pytest.approx(0.5)
