"""A user's own FSDP2 program (not the reference trainer), 2 gloo ranks, ``hpar_agent.attach(model)``
with nothing else: an unnamed 1-D mesh, ``fully_shard`` per layer then the root, bf16 params and bf16
gradient reduction (MixedPrecisionPolicy). The clean run must raise no alert (ReplicaDivergence must not
compare the two ranks' different shards, CollectiveMismatch must not flag the agreed bf16 reduction),
``hpar_rank_info`` must say dp_shard=2, and the collective series must carry FSDP's all-gathers under
``pg="dp_shard"`` with the flight recorder's counts and bytes. Also: a DDP program with torch's compress
hook on every rank raises no CollectiveMismatch.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hpar_agent
from hpar_agent.detectors.cluster import ReplicaDivergence
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat.fr_decode import op_label
from testkit.ports import free_port

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 12  # past a ReplicaDivergence checksum (every 10 steps)


def _user_program(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (WORLD,))  # unnamed, as many user scripts do
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t_attach = time.time_ns()
    agent = hpar_agent.attach(
        model,
        metrics_port=0,
        metrics_addr="127.0.0.1",
        traces="none",
        run_dir=out_dir,
        job_id="fsdp-user",
        fr_interval=0.001,
        thresholds={"detectors.exchange_s": 0.0},
    )
    try:
        data = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x = torch.randn(8, 16, generator=data)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        for _ in range(3):  # publish, read the peer's payload, evaluate (every rank, in lockstep)
            dist.barrier()
            agent.tick()
        with urllib.request.urlopen(agent.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        scraped = [
            [s.name, s.labels, s.value]
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith(("hpar_collective", "hpar_rank_info", "hpar_alert_active", "hpar_grad_sync"))
        ]
        entries = [
            [e["profiling_name"], e["input_sizes"], e["input_dtypes"]]
            for e in fr.dump("gloo")["entries"]
            if e["time_created_ns"] >= t_attach
        ]
        rep = agent.component("detectors").detector(ReplicaDivergence)  # type: ignore[union-attr]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"scraped": scraped, "fr": entries, "checksummed": [s for s, _ in rep.history]}, fh)
        dist.barrier()
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()


def test_user_fsdp2_program_is_quiet_and_its_series_are_right(tmp_path):
    mp.start_processes(
        _user_program, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="fork"
    )
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        alerts = {s[1]["alert"]: s[2] for s in res["scraped"] if s[0] == "hpar_alert_active"}
        assert alerts and not any(alerts.values()), alerts
        assert (
            10 in res["checksummed"]
        )  # ReplicaDivergence did sample the shards: quiet by design, not by absence
        info = next(s[1] for s in res["scraped"] if s[0] == "hpar_rank_info")
        assert (info["dp"], info["dp_shard"], info["dp_replicate"], info["dp_shard_rank"]) == (
            "2",
            "2",
            "1",
            str(rank),
        )
        assert info["mesh_dims"] == "dp_shard=2"
        total = {(s[1]["pg"], s[1]["op"]): s[2] for s in res["scraped"] if s[0] == "hpar_collectives_total"}
        nbytes = {
            (s[1]["pg"], s[1]["op"]): s[2] for s in res["scraped"] if s[0] == "hpar_collective_bytes_total"
        }
        gathers = [e for e in res["fr"] if op_label(e[0]) == "all_gather"]
        # FSDP's all-gathers of the bf16 shards: per step each of the two layers at least once (forward)
        assert len(gathers) >= 2 * STEPS and all(e[2] == ["BFloat16"] for e in gathers)
        assert total[("dp_shard", "all_gather")] == len(
            gathers
        )  # the world-sized mesh group, named by its dim
        shard_bytes = sum(2 * e[1][0][0] for e in gathers)  # bf16 input: this rank's shard
        assert nbytes[("dp_shard", "all_gather")] == shard_bytes
        # gloo runs FSDP's reduce-scatter as an all-reduce of the whole bf16 gradient (the FR says so)
        reductions = [e for e in res["fr"] if op_label(e[0]) == "all_reduce" and e[2] == ["BFloat16"]]
        assert len(reductions) >= 2 * STEPS and total[("dp_shard", "all_reduce")] >= len(reductions)
        # the unnamed mesh is FSDP's dp_shard: every step reduced the whole (bf16) gradient
        coverage = next(s[2] for s in res["scraped"] if s[0] == "hpar_grad_sync_coverage_ratio")
        assert 1.0 <= coverage < 1.01, coverage


def _ddp_compressed_program(rank: int, port: int, out_dir: str) -> None:
    """DDP with torch's compress hook on every rank: an intended, agreed low-precision reduction (fp16:
    DDP refuses its bf16 hook without NCCL; the unit tests cover the bf16 hook's recognition)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    agent = hpar_agent.attach(
        model,
        metrics_port=0,
        metrics_addr="127.0.0.1",
        traces="none",
        run_dir=out_dir,
        job_id="ddp-fp16",
        fr_interval=0.001,
        thresholds={"detectors.exchange_s": 0.0},
    )
    try:
        for _ in range(STEPS):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        for _ in range(3):
            dist.barrier()
            agent.tick()
        with urllib.request.urlopen(agent.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        alerts = {
            s.labels["alert"]: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "hpar_alert_active"
        }
        coverage = [
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == "hpar_grad_sync_coverage_ratio"
        ]
        half = [e for e in fr.dump("gloo")["entries"] if e["input_dtypes"] == ["Half"]]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"alerts": alerts, "half_reductions": len(half), "coverage": coverage}, fh)
        dist.barrier()
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()


def test_ddp_compress_hook_on_every_rank_is_quiet(tmp_path):
    mp.start_processes(
        _ddp_compressed_program,
        args=(free_port(), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["half_reductions"] >= STEPS  # the gradients really were reduced in 16 bits
        assert len(res["coverage"]) == 1 and res["coverage"][0] == pytest.approx(1.0), (
            res
        )  # elements, not bytes
        assert res["alerts"] and not any(res["alerts"].values()), res["alerts"]
