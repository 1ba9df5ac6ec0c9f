"""Topology from torchtitan-style mesh dims: atomic dims, flattened ones, a plain ``dp`` read by its
parameters' placements, and unnamed FSDP meshes named by placement."""

from __future__ import annotations

from torch import nn

from hpar_agent.topology import Topology, _atomic_coords, mesh_dim_names


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
    t = Topology(dp=4, dp_rank=3, dp_replicate=2, dp_shard=2, dp_replicate_rank=1, dp_shard_rank=1, mesh_dims="x")
    assert t.coords() == {"dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0, "pp": 0}
    assert Topology(dp=2, dp_rank=1).coords()["dp_replicate"] == 1  # dp given alone (HPAR_DP, old callers)
    labels = t.info_labels()
    assert (labels["dp_replicate"], labels["dp_shard"], labels["mesh_dims"]) == ("2", "2", "x")
