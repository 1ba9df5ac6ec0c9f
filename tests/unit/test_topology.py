"""Topology: a single process, torchtitan-style mesh dims (atomic, flattened, a plain ``dp`` read by its
parameters' placements, unnamed FSDP meshes named by placement), and a job id agreed without any rank
waiting for another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from torch import nn

from hpar_agent.topology import Topology, _atomic_coords, mesh_dim_names, replica
from testkit.ports import free_port


def test_atomic_coords_from_torchtitan_names() -> None:
    dims = {"pp": (2, 1), "dp_replicate": (2, 1), "dp_shard": (4, 3), "cp": (1, 0), "tp": (2, 0)}
    c = _atomic_coords(dims, sharded={"dp_shard", "tp"})
    assert c == {"dp_replicate": (2, 1), "dp_shard": (4, 3), "cp": (1, 0), "tp": (2, 0), "pp": (2, 1)}


def test_plain_dp_is_read_by_placement() -> None:
    assert _atomic_coords({"dp": (4, 2)}, sharded={"dp"})["dp_shard"] == (4, 2)  # FSDP over a "dp" mesh
    replicated = _atomic_coords({"dp": (4, 2), "tp": (2, 1)}, sharded={"tp"})  # DDP / replicate
    assert replicated["dp_replicate"] == (4, 2) and replicated["dp_shard"] == (1, 0)


def test_flattened_dims_fill_the_atomic_ones_they_span() -> None:
    assert _atomic_coords({"dp_shard_cp": (4, 1)}, sharded={"dp_shard_cp"})["dp_shard"] == (4, 1)
    both = _atomic_coords({"dp_shard": (2, 1), "cp": (2, 0), "dp_shard_cp": (4, 2)}, sharded=set())
    assert (both["dp_shard"], both["cp"]) == ((2, 1), (2, 0))  # the atomic dims win


class _Unnamed:
    mesh_dim_names = None

    def __init__(self, ndim: int) -> None:
        self.ndim = ndim


def test_unnamed_mesh_is_named_only_for_fsdp_models() -> None:
    from torch.distributed.fsdp import FSDPModule

    layer = nn.Linear(2, 2)
    layer.__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # what fully_shard does to the class
    model = nn.Sequential(layer)
    assert mesh_dim_names(_Unnamed(1), model) == ("dp_shard",)
    assert mesh_dim_names(_Unnamed(2), model) == ("dp_replicate", "dp_shard")
    assert mesh_dim_names(_Unnamed(1), nn.Linear(2, 2)) == ()
    assert mesh_dim_names(None, model) == ()


def test_coords_and_info_labels() -> None:
    t = Topology(
        dp=4, dp_rank=3, dp_replicate=2, dp_shard=2, dp_replicate_rank=1, dp_shard_rank=1, mesh_dims="x"
    )
    assert t.coords() == {"dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0, "pp": 0}
    assert Topology(dp=2, dp_rank=1).coords()["dp_replicate"] == 1  # dp given alone (HPAR_DP, old callers)
    labels = t.info_labels()
    assert (labels["dp_replicate"], labels["dp_shard"], labels["mesh_dims"]) == ("2", "2", "x")


def test_a_pipelines_place_among_its_replicas() -> None:
    assert [replica(r, 2, 4) for r in ([0, 1], [2, 3])] == [0, 1]  # rank = replica * pp + stage
    assert [replica(r, 2, 4) for r in ([0, 2], [3, 1])] == [0, 1]  # rank = stage * dp + replica
    assert [replica(r, 4, 8) for r in ([0, 1, 2, 3], [4, 5, 6, 7], [1, 3, 5, 7])] == [0, 1, 1]
    assert replica([0, 2], 2, 8) == 0 and replica([5, 7], 2, 8) == 3  # pp 2 of tp x dp 4 (stride 2)
    assert replica([0, 1, 3], 3, 6) is None and replica([0, 1], 2, 3) is None  # no regular layout
    assert replica([4], 1, 8) == 4


_RANK = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch.distributed as dist
    import hpar_agent

    rank, out = int(os.environ["RANK"]), sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))

    def wait_for(name):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, name)):
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: {name} never came")
            time.sleep(0.05)

    def mark(name, text=""):
        with open(os.path.join(out, name + ".tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    if rank == 0:
        wait_for("attached1")  # rank 0 (which would write the id) attaches only after rank 1 has
    agent = hpar_agent.attach(metrics_port=-1, traces="none", detectors=False, run_dir=os.path.join(out, f"r{rank}"))
    mark(f"attached{rank}", agent.topology.job_id)
    wait_for(f"attached{1 - rank}")
    hpar_agent.detach()
    mark(f"done{rank}")
    wait_for(f"done{1 - rank}")  # rank 0 hosts the store: keep it until rank 1 is done
    """
)


def test_late_peer_does_not_block_attach_and_ids_agree(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPAR_", "TORCHELASTIC"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(tmp_path)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ids = [(tmp_path / f"attached{r}").read_text() for r in range(2)]
    assert ids[0] == ids[1] and not ids[0].startswith("local-"), ids
    assert json.loads((tmp_path / "r1" / "summary.rank1.json").read_text())["topology"]["job_id"] == ids[0]
