"""The cross-rank detectors (``detectors.cluster``) over a real TCPStore: compile and replica divergence,
collective mismatch, straggler; under FSDP/HSDP shards are compared only with the same shard, and
low-precision reductions every rank agrees on are never flagged, while one rank reducing narrower is."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

from hpar_agent.crossrank import Exchange
from hpar_agent.detectors.base import StepTick
from hpar_agent.detectors.cluster import (
    CollectiveMismatch,
    CompileDivergence,
    ReplicaDivergence,
    Straggler,
    intended_reduce_bits,
    shard_key,
)
from tests.unit.harness import Fake, dp_all_reduces, make_agent, sample, steps


def test_compile_divergence_attributed_to_minority(store: Any, tmp_path: Any) -> None:
    ranks = []
    for r in range(3):
        comp = Fake("compile", fingerprint=111 if r != 2 else 222)
        ranks.append(
            make_agent(
                tmp_path,
                rank=r,
                world=3,
                comps=(steps(10), comp),
                exchange=Exchange(store, "job", r),
                coords={"dp": r, "dpn": 3},
                **{"detectors.exchange_s": 0.0},
            )
        )
    for _ in range(3):  # round 1 publishes; two confirmations follow
        for agent, _det in ranks:
            agent.tick()
    actives = [sample(det, "hpar_alert_active", "CompileDivergence") for _, det in ranks]
    assert actives == [0.0, 0.0, 1.0]
    assert sample(ranks[2][1], "hpar_detector_value", "CompileDivergence") == 2.0
    assert ranks[2][1].states["CompileDivergence"].fired == 1 and CompileDivergence.confirm == 2
    # the value (differing fingerprints) is compared with 0, not with the warm-up parameter
    assert ranks[2][1].active_alerts()[0].threshold == 0.0


def test_compile_divergence_waits_for_every_rank_of_the_stage(store: Any, tmp_path: Any) -> None:
    # the CPU fault matrix once named clean rank 1: it judged with only its own and the odd rank's
    # fingerprints published, a 1-1 split that blames both
    ranks = []
    for r in range(4):
        comp = Fake("compile", fingerprint=111 if r != 3 else 222)
        ranks.append(
            make_agent(
                tmp_path,
                rank=r,
                world=4,
                comps=(steps(10), comp),
                exchange=Exchange(store, "job", r),
                coords={"dp": r, "dpn": 4},
                **{"detectors.exchange_s": 0.0},
            )
        )
    for _ in range(3):  # ranks 0 and 2 have not published yet
        for r in (1, 3):
            ranks[r][0].tick()
    assert [ranks[r][1].states["CompileDivergence"].fired for r in (1, 3)] == [0, 0]
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    assert [sample(det, "hpar_alert_active", "CompileDivergence") for _, det in ranks] == [0.0, 0.0, 0.0, 1.0]
    assert ranks[1][1].states["CompileDivergence"].fired == 0


def _dp_replicas(store: Any, tmp_path: Any, drifted: int | None = None) -> list[Any]:
    """Three dp replicas of one small model, each a hand-wired agent on the store; ``drifted``'s second
    layer moved by 1e-3 (a block that missed its gradient all-reduce)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ranks = []
    for r in range(3):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        model.load_state_dict(base.state_dict())
        if r == drifted:
            with torch.no_grad():
                model[1].weight.add_(1e-3)
        ranks.append(
            make_agent(
                tmp_path,
                rank=r,
                world=3,
                comps=(steps(10),),
                exchange=Exchange(store, "job", r),
                coords={"dp": r, "dpn": 3},
                model=model,
                **{"detectors.exchange_s": 0.0},
            )
        )
    return ranks


def test_replica_divergence_dp_group(store: Any, tmp_path: Any) -> None:
    ranks = _dp_replicas(store, tmp_path, drifted=1)
    for agent, det in ranks:
        det.step_hook(10, 0)  # training thread: capture at the checksum step
        assert agent.errors == {}
    for _ in range(2):
        for agent, _det in ranks:
            agent.tick()
    assert [sample(det, "hpar_alert_active", "ReplicaDivergence") for _, det in ranks] == [0.0, 1.0, 0.0]
    details = ranks[1][1].states["ReplicaDivergence"].details
    assert details["dp"]["params"] == ["1.weight"] and details["dp"]["step"] == 10
    rep = ranks[0][1].detector(ReplicaDivergence)
    assert rep is not None and rep.sampler.replicated() == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(
        any("/x/ck/" in k for k in det.exchange._seen) for _, det in ranks
    )  # digests differed: fetched


def test_replica_divergence_in_sync_compares_digests_only(store: Any, tmp_path: Any) -> None:
    """Replicas in sync agree on their checksum digests (in the small ``s`` blob): nobody fetches the
    checksums by name, and the comparison still counts as made."""
    ranks = _dp_replicas(store, tmp_path)
    for _agent, det in ranks:
        det.step_hook(10, 0)
    for _ in range(2):
        for agent, _det in ranks:
            agent.tick()
    for agent, det in ranks:
        assert agent.errors == {} and det.snapshot.exchange.fresh
        verdict = det.detector(ReplicaDivergence).evaluate(det.snapshot)
        assert verdict is not None and not verdict.active and verdict.value == 0.0
        assert not any("/x/ck/" in k for k in det.exchange._seen)
        assert set(det.snapshot.exchange.peers[1 - min(det.snapshot.rank, 1)]["cd"]) == {"10"}


def _three_dp_ranks(
    store: Any,
    tmp_path: Any,
    shift_ms: dict[int, int],
    stops_at: dict[int, int] | None = None,
    bf16_at: int = -1,
) -> list[Any]:
    """Three dp ranks, 20 steps of 0.3 s with 4 all-reduces each, every rank ticked 3 times: a rank of
    ``shift_ms`` reaches every all-reduce that much late (early, below 0), one of ``stops_at`` counts
    no step after that one, and rank 0 reduces all-reduce ``bf16_at`` in bf16."""
    step, t0 = 300_000_000, int((time.time() - 8) * 1e9)
    ranks = []
    for r in range(3):
        entries = dp_all_reduces(t0, shift_ms.get(r, 0) * 1_000_000, bf16_at if r == 0 else -1)
        n = (stops_at or {}).get(r, 20)
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=3,
            comps=(steps(n), Fake("collectives", recent_entries=entries)),
            exchange=Exchange(store, "job", r),
            coords={"dp": r, "dpn": 3},
            **{"detectors.exchange_s": 0.0},
        )
        agent.config.evidence = False
        for s in range(n):  # each step ends 0.2 s in, after its 4 all-reduces
            det.detector(Straggler).step_hook(StepTick(s, t0 + s * step + 200_000_000, None, 0))
        ranks.append((agent, det))
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    return ranks


def test_collective_mismatch_and_straggler_through_store(store: Any, tmp_path: Any) -> None:
    ranks = _three_dp_ranks(store, tmp_path, shift_ms={2: 80}, bf16_at=7)
    assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [1.0, 0.0, 0.0]
    assert ranks[0][1].states["CollectiveMismatch"].details["mismatched"][0]["seq"] == 7
    assert [sample(d, "hpar_alert_active", "Straggler") for _, d in ranks] == [0.0, 0.0, 1.0]
    assert sample(ranks[2][1], "hpar_detector_value", "Straggler") > 0.1


def test_straggler_sets_aside_a_rank_that_stopped_stepping(store: Any, tmp_path: Any) -> None:
    # DDP's Join with uneven inputs: the rank out of data steps no more and shadows the others'
    # all-reduces at once, so it is first at each; the two still training, on time with each other,
    # were a 2-1 "slower side" and fired Straggler with no culprit
    ranks = _three_dp_ranks(store, tmp_path, shift_ms={0: -80}, stops_at={0: 5})
    assert [d.states["Straggler"].fired for _, d in ranks] == [0, 0, 0]
    # every rank sets rank 0 aside, rank 0 itself too (its verdict is inactive, value 0)
    assert [d.detector(Straggler)._idle(d.snapshot) for _, d in ranks] == [{0}, {0}, {0}]
    assert [d.states["Straggler"].judged > 0 for _, d in ranks] == [True, True, True]


def test_straggler_still_names_a_slow_rank_beside_one_that_stopped(store: Any, tmp_path: Any) -> None:
    ranks = _three_dp_ranks(store, tmp_path, shift_ms={0: -80, 2: 80}, stops_at={0: 5})
    assert [sample(d, "hpar_alert_active", "Straggler") for _, d in ranks] == [0.0, 0.0, 1.0]
    assert ranks[2][1].states["Straggler"].details["culprits"] == [2]


def test_straggler_ignores_a_late_ranks_compile_warmup(store: Any, tmp_path: Any) -> None:
    # The clean dp2 x pp2 run with rank 1 starting 10 s late: it still compiled through its step 3, so
    # in steps 3-8 its peers waited for it (lag ratio 0.67 over 11 collectives) and Straggler fired.
    # Its collectives count once its own compiles have been quiet 3 steps; a lag that persists then fires.
    t0 = time.time()
    ranks = []
    for r in range(2):
        entries: deque = deque(maxlen=512)
        comp = Fake("compile", compiles=Counter(), _open={}, compile_seconds=0.0, graphs=set())
        st = steps(4)
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=2,
            comps=(st, comp, Fake("collectives", recent_entries=entries)),
            exchange=Exchange(store, "job", r),
            coords={"dp": r, "dpn": 2},
            **{"detectors.exchange_s": 0.0},
        )
        agent.config.evidence = False
        ranks.append((agent, det, entries, comp, st))

    def ops(first: int, n: int, start: float, late_s: float) -> None:
        for i in range(first, first + n):  # 4 all-reduces per 0.3 s step, rank 1 late by late_s
            t = start + (i - first) // 4 * 0.3 + (i % 4) * 0.001
            for r, (*_, entries, _comp, _st) in enumerate(ranks):
                entries.append(
                    {
                        "pg": "dp",
                        "seq": i,
                        "op": "all_reduce",
                        "is_p2p": False,
                        "input_sizes": [[4]],
                        "input_dtypes": ["Float"],
                        "time": t + (late_s if r == 1 else 0.0),
                        "record_id": i,
                    }
                )
            if i % 4 == 3:  # the step ends (every rank's step hook) once both ranks entered its last op
                for _a, det, *_ in ranks:
                    det.detector(Straggler).step_hook(
                        StepTick(i // 4, int((t - 0.003 + 0.25) * 1e9), None, 0)
                    )

    ranks[1][3].compiles[("ok", "x")] += 1  # rank 1 compiles at its step 4
    for *_, st in ranks:
        st.total = 4
    ops(0, 40, t0, 0.2)
    for _ in range(3):
        for agent, *_ in ranks:
            agent.tick()
    assert not ranks[1][1].snapshot.warmup.warmed_up(3, 10)
    assert [d.states["Straggler"].fired for _a, d, *_ in ranks] == [0, 0]
    for *_, st in ranks:  # compiles quiet for 4 steps; the lag goes on: rank 1 is a straggler now
        st.total = 8
    for agent, *_ in ranks:
        agent.tick()
    ops(40, 80, time.time(), 0.2)
    for _ in range(3):
        for agent, *_ in ranks:
            agent.tick()
    assert [d.states["Straggler"].active for _a, d, *_ in ranks] == [False, True]


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
    assert (
        shard_key(_Param((Replicate(), Shard(0)), hsdp)) == "dp_shard=0"
    )  # the replicate coord is not in it
    fsdp_tp = _Mesh(("dp_shard", "tp"), (1, 1))
    assert shard_key(_Param((Shard(0), Shard(0)), fsdp_tp)) == "dp_shard=1,tp=1"
    assert shard_key(_Param((Shard(0), Replicate()), fsdp_tp)) == "dp_shard=1"  # a TP-replicated norm weight
    assert shard_key(_Param((Replicate(),), _Mesh(("dp",), (1,)))) == ""  # replicate/DDP: whole
    assert shard_key(_Param((Shard(0),), _Mesh(None, (1,)))) == "0=1"  # unnamed mesh: by index
    assert shard_key(nn.Parameter(torch.ones(2))) == ""


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


def _ranks(
    store: Any, tmp_path: Any, model: Any, pg: str, op: str, dtype_of: Any, job: str
) -> list[tuple[Any, Any]]:
    """Two fake dp ranks whose flight recorders hold 40 gradient reductions each (fp32 model)."""
    ranks = []
    for r in range(2):
        entries = deque(
            {
                "pg": pg,
                "seq": i,
                "op": op,
                "is_p2p": False,
                "input_sizes": [[8]] if dtype_of(r, i) == "Float" else [[16]],
                "input_dtypes": [dtype_of(r, i)],
                "time": i * 1e-3,
            }
            for i in range(40)
        )
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=2,
            comps=(steps(10), Fake("collectives", recent_entries=entries)),
            exchange=Exchange(store, job, r),
            coords={"dp": r, "dpn": 2},
            model=model,
            **{"detectors.exchange_s": 0.0},
        )
        agent.config.evidence = False
        ranks.append((agent, det))
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    return ranks


def test_agreed_low_precision_reductions_are_quiet(store: Any, tmp_path: Any) -> None:
    cases = {
        # FSDP2 MixedPrecisionPolicy(reduce_dtype=bf16): bf16 reduce-scatters on every rank
        "fsdp": (
            _FsdpLike(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
            "dp_shard",
            "reduce_scatter_tensor_coalesced",
        ),
        # DDP's bf16 compress hook on every rank
        "ddp": (_DdpLike(default_hooks.bf16_compress_hook), "dp", "all_reduce"),
        # an undeclared bf16 hook, but every rank runs it: still agreement, still quiet
        "custom": (nn.Linear(4, 4), "dp", "all_reduce"),
    }
    for job, (model, pg, op) in cases.items():
        ranks = _ranks(store, tmp_path / job, model, pg, op, lambda r, i: "BFloat16", job)
        assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [0.0, 0.0], job
        verdict = ranks[1][1].detector(CollectiveMismatch).evaluate(ranks[1][1].snapshot)
        assert verdict is not None and not verdict.active, (job, verdict)
        assert verdict.details["agreed_low_precision"] == 40, (job, verdict)  # seen, and not counted


def test_one_rank_reducing_narrower_still_fires(store: Any, tmp_path: Any) -> None:
    # rank 1 sends its buckets as bf16 padded to the fp32 byte size from seq 10 on (the trainer's
    # dtype-mismatch injection): its peer reduces the same bytes in fp32
    ranks = _ranks(
        store,
        tmp_path,
        nn.Linear(4, 4),
        "dp",
        "all_reduce",
        lambda r, i: "BFloat16" if r == 1 and i >= 10 else "Float",
        "mismatch",
    )
    assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [0.0, 1.0]
    details = ranks[1][1].states["CollectiveMismatch"].details
    assert details["low_precision"] and details["low_precision"][0]["dtypes"] == "BFloat16"
    assert (
        details["mismatched"] and details["mismatched"][0]["seq"] >= 10
    )  # and the cross-rank compare agrees
