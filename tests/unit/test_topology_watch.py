"""Topology re-resolution: a process group, a data-parallel wrapper or a mesh that appears after attach
changes what every series, span and summary says about the rank (on torch's fake process group: 4
ranks in one process, no peer)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import hpar_agent
from hpar_agent import topology_watch
from hpar_agent.agent import Agent

WORLD, RANK = 4, 1


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """Attached before any process group exists (a zero-code attach at the first compile, or a user
    who calls ``attach()`` at the top of the script)."""
    assert not dist.is_initialized()
    a = hpar_agent.attach(
        metrics_port=-1, traces="file", run_dir=str(tmp_path), interval=3600, detectors=False, job_id="watch"
    )
    try:
        yield a
    finally:
        hpar_agent.detach()
        if dist.is_initialized():
            dist.destroy_process_group()


def _group() -> None:
    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


def test_a_group_after_attach_gives_the_rank_every_label_and_file(agent: Agent, tmp_path: Path) -> None:
    assert agent.topology.rank == 0 and agent.topology.world_size == 1
    _group()
    agent.tick()
    topo = agent.topology
    assert (topo.rank, topo.world_size, topo.backend) == (RANK, WORLD, "fake")
    (info,) = [s.labels for m in agent.registry.collect() if m.name == "hpar_rank" for s in m.samples]
    assert (info["rank"], info["world_size"], info["backend"]) == (str(RANK), str(WORLD), "fake")
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": str(RANK), "pp_stage": "0"}) == 0.0
    events = [json.loads(line) for line in (tmp_path / f"events.rank{RANK}.jsonl").read_text().splitlines()]
    (ev,) = [e for e in events if e["kind"] == "topology"]
    assert (
        ev["rank"] == RANK
        and ev["changed"]["rank"] == str(RANK)
        and ev["changed"]["world_size"] == str(WORLD)
    )
    assert agent.component("topology").summary() == {"redetects": 1, "sources": ["process_group"]}
    hpar_agent.detach()
    summary = json.loads((tmp_path / f"summary.rank{RANK}.json").read_text())
    assert summary["rank"] == RANK and summary["topology"]["world_size"] == str(WORLD)


def test_ddp_after_attach_sets_dp(agent: Agent) -> None:
    _group()
    agent.tick()
    assert agent.topology.dp == 1
    torch.nn.parallel.DistributedDataParallel(_model())
    agent.tick()
    topo = agent.topology
    assert (topo.dp, topo.dp_rank, topo.dp_replicate, topo.dp_replicate_rank) == (WORLD, RANK, WORLD, RANK)
    assert agent.tracing.resource.attributes["hpar.dp.size"] == WORLD  # spans from now on say it too


def test_a_named_mesh_sets_every_degree_and_its_slices_do_not_win(agent: Agent) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _group()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh["tp"]  # a slice: a DeviceMesh of 2 ranks, not the job's
    agent.tick()
    topo = agent.topology
    assert (topo.dp, topo.tp, topo.dp_rank, topo.tp_rank, topo.mesh_dims) == (2, 2, 0, 1, "dp=2,tp=2")


def test_a_mesh_named_data_and_model_is_dp_and_tp(agent: Agent, caplog: pytest.LogCaptureFixture) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _group()
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))  # read as dp=1, tp=1 before
    agent.tick()
    topo = agent.topology
    assert (topo.dp, topo.tp, topo.dp_rank, topo.tp_rank, topo.dp_replicate) == (2, 2, 0, 1, 2)
    assert not [r for r in caplog.records if "mesh dim" in r.getMessage()]
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "experts"))  # a name no label has: said once
    agent.tick()
    agent.tick()
    (said,) = [r.getMessage() for r in caplog.records if "mesh dim" in r.getMessage()]
    assert "'experts'" in said and "HPAR_TP" in said
    assert (agent.topology.dp, agent.topology.tp) == (2, 1)


def test_fully_shard_on_its_default_mesh_is_dp_shard(agent: Agent) -> None:
    from torch.distributed.fsdp import fully_shard

    _group()
    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    agent.tick()
    topo = agent.topology
    assert (topo.dp, topo.dp_shard, topo.dp_shard_rank, topo.dp_replicate) == (WORLD, WORLD, RANK, 1)


def test_replicate_is_dp_replicate(agent: Agent) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    _group()
    replicate(_model())
    agent.tick()
    topo = agent.topology
    assert (topo.dp, topo.dp_replicate, topo.dp_replicate_rank, topo.dp_shard) == (WORLD, WORLD, RANK, 1)


def test_a_redetection_still_due_runs_before_the_group_is_destroyed(agent: Agent) -> None:
    """A short job: the wrapper appears and the group goes before the agent's next pass; what the
    wrapper said is kept (the wrapper itself dropped already)."""
    _group()
    agent.tick()
    torch.nn.parallel.DistributedDataParallel(_model())  # dropped at once
    dist.destroy_process_group()
    assert agent.topology.dp == WORLD
    agent.tick()  # no group now: the environment's rank 0 of 1 does not overwrite what the group said
    assert (agent.topology.rank, agent.topology.world_size, agent.topology.dp) == (RANK, WORLD, WORLD)


def test_detach_restores_every_patch() -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import schedules, stage

    before = (
        DeviceMesh.__init__,
        torch.nn.parallel.DistributedDataParallel.__init__,
        dist.init_process_group,
        dist.destroy_process_group,
        stage._PipelineStageBase.__init__,
        schedules.PipelineScheduleMulti.step,
    )
    a = hpar_agent.attach(metrics_port=-1, traces="none", event_log=False, interval=3600, detectors=False)
    try:
        assert getattr(DeviceMesh.__init__, topology_watch.TAG, None) is before[0]
        assert getattr(dist.init_process_group, topology_watch.TAG, None) is before[2]
        assert getattr(schedules.PipelineScheduleMulti.step, topology_watch.TAG, None) is before[5]
    finally:
        hpar_agent.detach()
    assert not a.started
    after = (
        DeviceMesh.__init__,
        torch.nn.parallel.DistributedDataParallel.__init__,
        dist.init_process_group,
        dist.destroy_process_group,
        stage._PipelineStageBase.__init__,
        schedules.PipelineScheduleMulti.step,
    )
    assert after == before


def test_the_wrapper_built_around_the_given_model_is_read_not_another(tmp_path: Path) -> None:
    """``attach(model)`` before a framework wraps that model in DDP (Lightning's setup, the HF Trainer):
    the wrapper says dp; a DDP around some other module does not speak for the given model."""
    _group()
    model = _model()
    a = hpar_agent.attach(
        model, metrics_port=-1, traces="none", run_dir=str(tmp_path), interval=3600, detectors=False
    )
    try:
        torch.nn.parallel.DistributedDataParallel(_model())  # not around the given model
        a.tick()
        assert a.topology.dp == 1
        torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(model)
        )  # a wrapper around a wrapper of it
        assert (a.topology.dp, a.topology.dp_rank) == (WORLD, RANK)  # at once, before any pass
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()


def _stage(index: int, num: int, group: Any = None) -> Any:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(torch.nn.Linear(4, 4), index, num, torch.device("cpu"), group=group)


def test_a_pipeline_stage_after_attach_is_the_ranks_stage(agent: Agent, tmp_path: Path) -> None:
    """A plain pipelining program (no mesh, no HPAR_PP_STAGE): the stage it builds says pp, the rank's
    place in the pipeline and its stage, on every series at once."""
    _group()
    agent.tick()
    assert (agent.topology.pp, agent.topology.pp_stage) == (1, 0)
    stage = _stage(RANK, WORLD)
    topo = agent.topology
    assert (topo.pp, topo.pp_rank, topo.pp_stage, topo.pp_stages, topo.dp) == (WORLD, RANK, RANK, "1", 1)
    labels = {"rank": str(RANK), "pp_stage": str(RANK)}
    assert agent.registry.get_sample_value("hpar_steps_total", labels) == 0.0
    assert "stage" in agent.component("topology").summary()["sources"]
    # its chunks are timed with no watch_pipeline() call (the program knows nothing of the agent)
    pipe = agent.component("pipeline")
    assert [(s is stage, m) for s, m in pipe.wrapped] == [
        (True, "forward_one_chunk"),
        (True, "backward_one_chunk"),
    ]
    agent.watch_pipeline([stage])  # a program that calls it too: wrapped once
    assert len(pipe.wrapped) == 2
    assert pipe.summary()["schedule"] == ""  # no schedule runs it yet
    from torch.distributed.pipelining import ScheduleGPipe

    ScheduleGPipe(stage, n_microbatches=2)  # the summary names the schedule as watch_pipeline() does
    assert pipe.summary()["schedule"] == "ScheduleGPipe" and len(pipe.wrapped) == 2


def test_an_interleaved_schedule_built_after_attach_on_stages_built_before(tmp_path: Path) -> None:
    """Two stages a rank (1 and 5 of 8 on 4 ranks), built before ``attach(model)``: the schedule built
    after it says them; pp_stage is the rank's first stage, its place in the pipeline."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    _group()
    stages = [_stage(RANK, 2 * WORLD), _stage(RANK + WORLD, 2 * WORLD)]
    a = hpar_agent.attach(
        stages[0].submod,
        metrics_port=-1,
        traces="none",
        run_dir=str(tmp_path),
        interval=3600,
        detectors=False,
    )
    try:
        assert a.topology.pp == 1
        ScheduleInterleaved1F1B(stages, n_microbatches=4)
        topo = a.topology
        assert (topo.pp, topo.pp_rank, topo.pp_stage, topo.pp_stages) == (WORLD, RANK, RANK, "1,5")
        assert {id(s) for s, _m in a.component("pipeline").wrapped} == {id(s) for s in stages}  # chunks timed
        assert a.component("pipeline").summary()["schedule"] == "ScheduleInterleaved1F1B"
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()
    assert all("forward_one_chunk" not in vars(s) for s in stages)  # the wrappers go with the agent


def test_dp_x_pp_without_a_mesh_reads_the_replicas_from_the_pipeline_group(agent: Agent) -> None:
    """2 pipelines of 2 stages, stage-major (rank = stage * dp + replica): rank 1 is stage 0 of
    pipeline 1 ([1, 3]); the ranks outside its pipeline are its replicas."""
    _group()
    pipes = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    _stage(0, 2, group=pipes[1])
    topo = agent.topology
    assert (topo.pp, topo.pp_rank, topo.pp_stage, topo.dp, topo.dp_rank) == (2, 0, 0, 2, 1)
    assert (topo.dp_replicate, topo.dp_replicate_rank) == (2, 1)
