"""ReplicaDivergence and CollectiveMismatch under FSDP/HSDP: shards are compared only with the same
shard, and low-precision reductions every rank agrees on (FSDP reduce_dtype, DDP compress hooks) are
never flagged, while one rank reducing narrower than its peers still is."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from hpar_agent.crossrank import Exchange
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors.cluster import CollectiveMismatch, intended_reduce_bits, shard_key
from hpar_agent.topology import Topology
from tests.unit.test_detectors import Fake, make_agent, sample, steps


@pytest.fixture
def store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class _Mesh:
    """The two DeviceMesh methods shard_key reads, for one rank's coordinates."""

    def __init__(self, names: tuple[str, ...] | None, coords: tuple[int, ...]) -> None:
        self.mesh_dim_names = names
        self.coords = coords

    def get_local_rank(self, i: int) -> int:
        return self.coords[i]


class _Param:
    def __init__(self, placements: tuple[Any, ...], mesh: _Mesh) -> None:
        self.placements, self.device_mesh = placements, mesh


def test_shard_key_names_only_the_sharded_dims() -> None:
    hsdp = _Mesh(("dp_replicate", "dp_shard"), (1, 0))
    assert shard_key(_Param((Replicate(), Shard(0)), hsdp)) == "dp_shard=0"  # the replicate coord is not in it
    fsdp_tp = _Mesh(("dp_shard", "tp"), (1, 1))
    assert shard_key(_Param((Shard(0), Shard(0)), fsdp_tp)) == "dp_shard=1,tp=1"
    assert shard_key(_Param((Shard(0), Replicate()), fsdp_tp)) == "dp_shard=1"  # a TP-replicated norm weight
    assert shard_key(_Param((Replicate(),), _Mesh(("dp",), (1,)))) == ""  # replicate/DDP: whole
    assert shard_key(_Param((Shard(0),), _Mesh(None, (1,)))) == "0=1"  # unnamed mesh: by index
    assert shard_key(nn.Parameter(torch.ones(2))) == ""


def test_same_shard_offenders_compare_shards_only_across_replicas() -> None:
    # HSDP 2x2: ranks 0,1 hold shards 0,1 of replica 0; ranks 2,3 the same shards of replica 1.
    keys = {r: {"w": f"dp_shard={r % 2}"} for r in range(4)}
    sums = {0: {"w": [1.0, 1.0], "b": [5.0, 5.0]}, 1: {"w": [2.0, 2.0], "b": [5.0, 5.0]},
            2: {"w": [1.0, 1.0], "b": [5.0, 5.0]}, 3: {"w": [2.0, 2.0], "b": [5.0, 5.0]}}  # fmt: skip
    for r in range(4):  # different shards differ: that is correct
        assert sig.same_shard_offenders(sums, keys, r) == []
    sums[3] = {"w": [2.5, 2.5], "b": [5.0, 5.0]}  # replica 1's shard 1 missed the replicate all-reduce
    assert [sig.same_shard_offenders(sums, keys, r) for r in range(4)] == [[], ["w"], [], ["w"]]  # a 1-1 split
    sums[2]["b"] = [6.0, 6.0]  # a whole (replicated) parameter compares across all four: 3-1 majority
    assert sig.same_shard_offenders(sums, keys, 2) == ["b"] and sig.same_shard_offenders(sums, keys, 0) == []
    fsdp = {r: {"w": f"dp_shard={r}"} for r in range(2)}  # plain FSDP: nothing to compare
    assert sig.same_shard_offenders({0: {"w": [1.0, 1.0]}, 1: {"w": [9.0, 9.0]}}, fsdp, 0) == []


def test_entry_bytes_and_narrower_than_peers() -> None:
    fp32 = ("dp@0", 1, "all_reduce", "[[8]]", "Float", 0)
    padded_bf16 = ("dp@0", 1, "all_reduce", "[[16]]", "BFloat16", 0)  # the same 32 bytes, in bf16
    assert sig.entry_bytes(fp32) == sig.entry_bytes(padded_bf16) == 32
    assert sig.entry_bytes(("dp@0", 1, "all_reduce", "[[2, 3], [4]]", "Float,Float", 0)) == 40
    peers = sig.peer_reduction_bits({0: [fp32], 1: [padded_bf16]}, rank=1)
    assert sig.narrower_than_peers([padded_bf16], peers) == [padded_bf16]
    agreed = sig.peer_reduction_bits({0: [padded_bf16], 1: [padded_bf16]}, rank=1)
    assert sig.narrower_than_peers([padded_bf16], agreed) == []
    loss = ("dp@0", 2, "all_reduce", "[[]]", "Float", 0)  # an fp32 scalar on the same group: other bytes
    assert sig.narrower_than_peers([padded_bf16], sig.peer_reduction_bits({0: [loss]}, rank=1)) == []


class _FsdpLike(nn.Linear):
    """The FSDPModule surface intended_reduce_bits reads (a real fully_shard needs a process group)."""

    def __init__(self, mp: MixedPrecisionPolicy) -> None:
        super().__init__(4, 4)
        self._state = type("State", (), {"_mp_policy": mp})()

    def _get_fsdp_state(self) -> Any:
        return self._state


class _DdpLike(nn.Linear):
    def __init__(self, hook: Any) -> None:
        super().__init__(4, 4)
        self._comm_hooks = [(hook, None)]


def test_intended_reduce_bits_reads_fsdp_policy_and_ddp_compress_hooks() -> None:
    assert intended_reduce_bits(_FsdpLike(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))) == {16}
    assert intended_reduce_bits(_FsdpLike(MixedPrecisionPolicy(param_dtype=torch.bfloat16))) == {16}
    assert intended_reduce_bits(_FsdpLike(MixedPrecisionPolicy())) == set()
    assert intended_reduce_bits(_DdpLike(default_hooks.bf16_compress_hook)) == {16}
    assert intended_reduce_bits(_DdpLike(default_hooks.allreduce_hook)) == set()
    assert intended_reduce_bits(nn.Linear(2, 2)) == set()


def _ranks(store: Any, tmp_path: Any, model: Any, pg: str, op: str, dtype_of: Any, job: str) -> list[tuple[Any, Any]]:
    """Two fake dp ranks whose flight recorders hold 40 gradient reductions each (fp32 model)."""
    ranks = []
    for r in range(2):
        entries = deque(
            {"pg": pg, "seq": i, "op": op, "is_p2p": False,
             "input_sizes": [[8]] if dtype_of(r, i) == "Float" else [[16]],
             "input_dtypes": [dtype_of(r, i)], "time": i * 1e-3}
            for i in range(40)
        )  # fmt: skip
        agent, det = make_agent(tmp_path, rank=r, world=2, comps=(steps(10), Fake("collectives", recent_entries=entries)),
                                exchange=Exchange(store, job, r), coords={"dp": r, "dpn": 2}, model=model,
                                **{"detectors.exchange_s": 0.0})  # fmt: skip
        agent.config.evidence = False
        ranks.append((agent, det))
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    return ranks


def test_agreed_low_precision_reductions_are_quiet(store: Any, tmp_path: Any) -> None:
    cases = {
        # FSDP2 MixedPrecisionPolicy(reduce_dtype=bf16): bf16 reduce-scatters on every rank
        "fsdp": (_FsdpLike(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
                 "dp_shard", "reduce_scatter_tensor_coalesced"),
        # DDP's bf16 compress hook on every rank
        "ddp": (_DdpLike(default_hooks.bf16_compress_hook), "dp", "all_reduce"),
        # an undeclared bf16 hook, but every rank runs it: still agreement, still quiet
        "custom": (nn.Linear(4, 4), "dp", "all_reduce"),
    }
    for job, (model, pg, op) in cases.items():
        ranks = _ranks(store, tmp_path / job, model, pg, op, lambda r, i: "BFloat16", job)
        assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [0.0, 0.0], job
        verdict = ranks[1][1].detector(CollectiveMismatch).evaluate(ranks[1][1])
        assert verdict is not None and not verdict.active, (job, verdict)
        assert verdict.details["agreed_low_precision"] == 40, (job, verdict)  # seen, and not counted


def test_one_rank_reducing_narrower_still_fires(store: Any, tmp_path: Any) -> None:
    # rank 1 sends its buckets as bf16 padded to the fp32 byte size from seq 10 on (the trainer's
    # dtype-mismatch injection): its peer reduces the same bytes in fp32
    ranks = _ranks(store, tmp_path, nn.Linear(4, 4), "dp", "all_reduce",
                   lambda r, i: "BFloat16" if r == 1 and i >= 10 else "Float", "mismatch")
    assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [0.0, 1.0]
    details = ranks[1][1].states["CollectiveMismatch"].details
    assert details["low_precision"] and details["low_precision"][0]["dtypes"] == "BFloat16"
    assert details["mismatched"] and details["mismatched"][0]["seq"] >= 10  # and the cross-rank compare agrees


def test_group_key_separates_hsdp_groups() -> None:
    from hpar_agent.detectors.sources import _group_key

    def topo(rep: int, shard: int) -> Topology:
        return Topology(dp=4, dp_replicate=2, dp_shard=2, dp_rank=rep * 2 + shard, dp_replicate_rank=rep,
                        dp_shard_rank=shard)

    keys = {(rep, sh): _group_key("dp_shard", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}
    assert keys[(0, 0)] == keys[(0, 1)] != keys[(1, 0)] == keys[(1, 1)]  # one dp_shard group per replica
    rkeys = {(rep, sh): _group_key("dp_replicate", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}
    assert rkeys[(0, 0)] == rkeys[(1, 0)] != rkeys[(0, 1)]
    assert len({_group_key("dp", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}) == 1
