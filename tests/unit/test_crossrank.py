"""The cross-rank exchange: one key per rank and purpose on a real store, each rank's comparison peers
for the layouts users run (dp; dp x tp; the reference trainer's dp x pp x tp; HSDP), bounded whatever
the job's size, and equal to the groups torch's own DeviceMesh makes; and its cadence, which keeps the
store's request rate bounded whatever the job's size."""

from __future__ import annotations

import json
import time
import zlib
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpar_agent.crossrank import (
    COMPRESS_ABOVE,
    PEERS_PER_DIM,
    READS,
    SPREAD_PER_RANK_S,
    WHOLE_GROUP,
    Cadence,
    Exchange,
    Grid,
    cadence,
    plan,
    select,
    unpack,
)
from hpar_agent.detectors.base import StepTick


@pytest.fixture
def store() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )


PARTS = {
    "s": {"step": 3},
    "fr": {"fr": {"k": [], "e": [], "u0": 0}},
    "gs": {"gst": {"1": [[1.0], [1.0]]}},
    "ck": {"cks": {"10": {"w": [1.0, 2.0]}}, "sk": {}},
}


# ------------------------------------------------------------------------------------------ store
def test_one_key_per_rank_and_purpose_overwritten(store: Any) -> None:
    a, b = Exchange(store, "j1", 0), Exchange(store, "j1", 1)
    a.publish(PARTS)
    assert all(store.check([f"hpar/j1/x/{p}/0"]) for p in PARTS)
    b.publish({**PARTS, "s": {"step": 4}})
    b.publish({**PARTS, "s": {"step": 5}})
    got = a.read({"s": [0, 1], "ck": [1]})
    assert (
        got["s"] == {1: {**got["s"][1], "step": 5}} and got["ck"][1]["cks"] == PARTS["ck"]["cks"]
    )  # never its own
    assert (
        a.own["s"]["step"] == 3 and a.own["ck"]["cks"] == PARTS["ck"]["cks"]
    )  # its own, as readers decode it
    assert Exchange(store, "other", 0).read({"s": [1]}) == {}  # namespaced by job


def test_a_rank_that_never_published_is_not_waited_for(store: Any) -> None:
    a = Exchange(store, "j", 0)
    Exchange(store, "j", 1).publish(PARTS)
    t0 = time.perf_counter()
    got = a.read({"s": [1, 2, 3], "fr": [1, 2, 3]})  # ranks 2, 3 never published; the store would wait 30 s
    assert time.perf_counter() - t0 < 1.0
    assert {p: set(v) for p, v in got.items()} == {"s": {1}, "fr": {1}}
    Exchange(store, "j", 2).publish(PARTS)
    assert set(a.read({"s": [1, 2, 3]})["s"]) == {1, 2}  # a key that appears later is found


def test_stale_blobs_are_dropped_by_publish_time(store: Any) -> None:
    a, b = Exchange(store, "j", 0), Exchange(store, "j", 1)
    b.publish(PARTS)
    assert set(a.read({"s": [1], "gs": [1]}, max_age_s={"s": -1.0})) == {"gs"}
    assert set(a.read({"s": [1]}, max_age_s={"s": 30.0})["s"]) == {1}


def test_purposes_that_change_rarely_are_set_only_when_they_change(store: Any) -> None:
    ex = Exchange(store, "j", 0)
    first = ex.publish(PARTS)
    t_gs = ex.own["gs"]["t"]
    again = ex.publish(PARTS)
    every = sum(len(json.dumps(ex.own[p], separators=(",", ":"))) for p in ("s", "fr"))
    assert again == every < first  # s and fr again, gs and ck not
    assert ex.own["gs"]["t"] == t_gs
    ex.publish({**PARTS, "gs": {}})  # emptied: set, so readers see it gone
    assert Exchange(store, "j", 1).read({"gs": [0]})["gs"][0] == {"t": ex.own["gs"]["t"]}


def test_bytes_are_counted_both_ways(store: Any) -> None:
    a, b = Exchange(store, "j", 0), Exchange(store, "j", 1)
    sent = b.publish(PARTS)
    a.read({p: [1] for p in PARTS})
    assert b.bytes_out == sent == a.bytes_in > 0


BIG = {  # a flight-recorder window's worth of packed entries: over COMPRESS_ABOVE as JSON
    "fr": {"fr": {"k": [["tp", "all_reduce"]], "e": [v % 7 for v in range(3072)], "u0": 17}},
    "s": {"step": 3, "fp": 1022026788184957},
}


def test_large_blobs_travel_compressed_and_decode_to_the_same_payload(store: Any) -> None:
    a, b = Exchange(store, "j", 0), Exchange(store, "j", 1)
    sent = b.publish(BIG)
    plain = json.dumps(b.own["fr"], separators=(",", ":")).encode()
    raw_fr, raw_s = store.get("hpar/j/x/fr/1"), store.get("hpar/j/x/s/1")
    assert len(plain) > COMPRESS_ABOVE and raw_fr[:1] != b"{" and len(raw_fr) < len(plain) / 4
    assert json.loads(raw_s) == b.own["s"]  # a small blob stays plain JSON
    got = a.read({"s": [1], "fr": [1]})
    assert got == {"s": {1: b.own["s"]}, "fr": {1: b.own["fr"]}}
    assert {k: v for k, v in got["fr"][1].items() if k != "t"} == BIG["fr"]
    assert sent == b.bytes_out == a.bytes_in == len(raw_fr) + len(raw_s)  # the bytes the store moved


def test_malformed_blobs_are_dropped_and_the_rest_kept(store: Any) -> None:
    good = Exchange(store, "j", 1)
    good.publish(BIG)
    packed = zlib.compress(json.dumps({"t": 1.0, "x": "y" * 5000}).encode(), 1)
    bad = {
        2: b"not json",
        3: b"x\x01garbage",  # a zlib header, then no stream
        4: packed[: len(packed) // 2],  # a compressed blob cut short
        5: zlib.compress(b"[1, 2, 3]"),  # compressed JSON that is no payload
        6: zlib.compress(b"{" + b" " * (2 << 20) + b"}"),  # inflates past max_bytes
        7: b"{\xff",  # not UTF-8
    }
    for r, blob in bad.items():
        store.set(f"hpar/j/x/fr/{r}", blob)
    reader = Exchange(store, "j", 0)
    got = reader.read({"fr": [1, *bad]})
    assert set(got["fr"]) == {1} and got["fr"][1] == good.own["fr"]
    assert unpack(zlib.compress(b'{"a":1}'), 7) == {"a": 1} and unpack(zlib.compress(b'{"a":1}'), 6) is None


# ------------------------------------------------------------------------------------------ cadence
def test_small_jobs_wait_a_few_ms_at_most_and_exchange_as_often() -> None:
    for n in (1, 2):
        assert cadence(n, 3.0, 1.0) == Cadence(0.0, 1, 1, 3.0)  # nothing waits
    for n in (4, 8):  # the demo, the fault matrix
        c = cadence(n, 3.0, 1.0)
        assert 0 < c.window_s <= 0.004 and (c.polls, c.gap, c.interval_s) == (1, 1, 3.0)
    assert cadence(4, 0.0, 1.0).gap == 1  # exchange_s 0 (every pass) stays every pass


def test_1024_ranks_spread_over_half_the_interval_at_the_same_exchange_interval() -> None:
    c = cadence(1024, 3.0, 1.0)
    assert (c.window_s, c.polls, c.interval_s) == (0.5, 1, 3.0)
    assert c.gap == 2  # both windows no longer fit in one pass: a read pass publishes nothing
    assert cadence(512, 3.0, 1.0).gap == 1 and cadence(512, 3.0, 1.0).window_s == 0.25


def test_8192_ranks_spread_over_passes_and_exchange_less_often() -> None:
    c = cadence(8192, 3.0, 1.0)
    assert (c.window_s, c.polls, c.gap, c.interval_s) == (0.5, 8, 16, 16.0)
    slow = cadence(8192, 3.0, 5.0)  # a longer agent interval holds more of a phase per pass
    assert slow.polls == 2 and slow.window_s == 2.0 and slow.interval_s == 20.0


@pytest.mark.parametrize("interval", [0.05, 1.0, 5.0])
def test_the_stores_request_rate_is_bounded_whatever_the_jobs_size(interval: float) -> None:
    for n in (3, 64, 1000, 1024, 1025, 3000, 8192, 100_000):
        c = cadence(n, 3.0, interval)
        assert (
            c.window_s <= 0.5 * interval + 1e-12
        )  # a pass waits at most half its interval, or twice a quarter
        assert n / (c.polls * c.window_s) <= 1 / SPREAD_PER_RANK_S * (
            1 + 1e-9
        )  # requests a second, one phase
        assert c.interval_s >= c.gap * interval  # the reads of one exchange end before the next capture
        if c.gap == 1:  # a read window then a publish window in one pass
            assert c.polls == 1 and 2 * c.window_s <= 0.5 * interval
        else:  # a phase of publishes, then a phase of reads
            assert c.gap == 2 * c.polls


def test_offsets_spread_the_ranks_evenly_over_the_window() -> None:
    for n in (64, 1024, 8192):
        c = cadence(n, 3.0, 1.0)
        at = sorted(k + off / c.window_s for k, off in map(c.offset, range(n)))  # in windows
        assert at[0] >= 0 and at[-1] < c.polls
        buckets = [0] * (50 * c.polls)
        for a in at:
            buckets[int(a * 50)] += 1
        assert max(buckets) <= 1.5 * n / len(buckets) + 2  # no burst: ~even over every 1/50 of a window
    c = cadence(1024, 3.0, 1.0)
    assert [c.offset(r) for r in (0, 1)] == [(0, 0.0), (0, pytest.approx(0.309, abs=1e-3))]  # stable by rank


# ------------------------------------------------------------------------------------------ peers
LAYOUTS = {
    "dp": [("dp", 1024)],
    "dp_tp": [("dp", 128), ("tp", 8)],
    "pp_dp_tp": [("dp", 32), ("pp", 4), ("tp", 8)],  # the reference trainer's mesh order
    "hsdp": [("dp_replicate", 128), ("dp_shard", 8)],
}


def _coords(grid: Grid, rank: int) -> dict[str, int]:
    pos, out = grid.ranks.index(rank), {}
    for name, size in reversed(list(zip(grid.names, grid.shape, strict=True))):
        pos, out[name] = divmod(pos, size)
    return out


def test_select_takes_a_small_group_whole_and_four_of_a_large_one() -> None:
    assert select([0, 1], 0) == [1]
    assert select(list(range(5)), 2) == [0, 1, 3, 4]
    members = list(range(100, 160))  # 60 members: peers near +-60 // 5 and +-2 * 60 // 5, moved to 13
    assert select(members, 100) == [113, 147, 126, 134]  # (odd, 47 back) and 26 (even, 24 is a node)
    for n in (6, 7, 8, 9, 64, 1000):
        for i in range(n):
            peers = select(list(range(n)), i)
            assert len(peers) == (n - 1 if n <= WHOLE_GROUP else PEERS_PER_DIM) and i not in peers
            assert all(i in select(list(range(n)), p) for p in peers)  # symmetric: read by whom it reads
    assert len(select(list(range(64)), 0, k=6)) == 6


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_compares_only_within_its_groups_and_a_bounded_few(layout: str) -> None:
    grid = Grid.row_major(LAYOUTS[layout])
    sizes = dict(LAYOUTS[layout])
    for rank in range(0, len(grid.ranks), 37):
        p = plan(grid, rank)
        me = _coords(grid, rank)
        assert set(p.groups) == {d for d in sizes if d != "pp"}  # never across pipeline stages
        for dim, peers in p.groups.items():
            assert len(peers) == (sizes[dim] - 1 if sizes[dim] <= WHOLE_GROUP else PEERS_PER_DIM)
            for r in peers:  # the members of this rank's group on dim: equal on every other dim
                c = _coords(grid, r)
                assert c[dim] != me[dim] and all(c[d] == me[d] for d in sizes if d != dim)
        wants = p.wants()
        assert set(wants) == set(READS) - ({"gs"} if "tp" not in sizes else set())
        assert wants["s"] == wants["fr"] == p.peers and len(p.peers) == sum(len(g) for g in p.groups.values())
        if "tp" in sizes:
            assert wants["gs"] == list(p.groups["tp"])


def test_what_a_rank_reads_does_not_grow_with_the_job() -> None:
    for n in (64, 1024, 8192):
        for layout in ("dp", "dp_tp"):
            dims = [("dp", n)] if layout == "dp" else [("dp", n // 8), ("tp", 8)]
            grid = Grid.row_major(dims)
            want = sum(size - 1 if size <= WHOLE_GROUP else PEERS_PER_DIM for _, size in dims)
            assert {len(plan(grid, r).peers) for r in (0, n // 2, n - 1)} == {want}


def test_a_pure_pipeline_of_any_size_reads_a_bounded_few_stages_s() -> None:
    """Stages hold different graphs: no comparison group along pp. A pure pipeline (every other dim 1)
    still reads some stages' ``s`` (their own work a step, which Straggler judges a stage against):
    every other stage up to ``WHOLE_GROUP`` ranks, past that the four ``select`` picks, symmetric;
    its ``fr`` from nobody. A dp x pp job past ``WHOLE_GROUP`` reads no other stage."""
    for n in (4, 16, 64, 1024):
        grid = Grid.row_major([("pp", n)])
        for rank in (0, n // 2 + 1, n - 1):
            p = plan(grid, rank)
            assert p.groups == {} and p.wants() == {
                "s": list(p.world) if n <= WHOLE_GROUP else sorted(p.world)
            }
            assert len(p.world) == min(n - 1, PEERS_PER_DIM if n > WHOLE_GROUP else n) and rank not in p.world
            assert all(rank in plan(grid, q).world for q in p.world)
    assert plan(Grid.row_major([("dp", 8), ("pp", 4)]), 5).world == ()


def test_hsdp_replicas_of_one_shard_are_compared() -> None:
    grid = Grid.row_major(LAYOUTS["hsdp"])
    p = plan(grid, 8 * 5 + 3)  # replica 5, shard 3
    assert all(r % 8 == 3 for r in p.groups["dp_replicate"])  # the same shard in other replicas
    assert all(r // 8 == 5 for r in p.groups["dp_shard"])  # the other shards of its replica


def test_a_rank_outside_the_grid_compares_with_nobody() -> None:
    assert plan(Grid.row_major([("dp", 4)]), 9).groups == {}
    assert plan(Grid.row_major([("dp", 4)], base=4), 5).peers == [4, 6, 7]


@pytest.fixture
def fake_pg() -> Any:
    """torch's fake process group (no peers): DeviceMesh builds its real layout and groups on it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_groups_match_the_device_meshs_own(fake_pg: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    cases = [
        ((2, 2, 4), ("dp", "pp", "tp"), None),
        ((2, 8), ("dp_replicate", "dp_shard"), None),
        (
            (2, 2, 4),
            ("dp", "pp", "tp"),
            torch.randperm(16, generator=torch.Generator().manual_seed(0)).view(2, 2, 4),
        ),
    ]
    for shape, names, layout in cases:
        for rank in (0, 5, 14):
            fake_pg(rank, 16)
            if layout is None:
                mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            else:  # ranks in any order: the layout is read, not assumed
                mesh = DeviceMesh("cpu", layout, mesh_dim_names=names)
            grid = Grid.from_mesh(mesh, names)
            for dim in names:
                assert sorted(grid.group(rank, dim)) == sorted(
                    dist.get_process_group_ranks(mesh.get_group(dim))
                )


# ------------------------------------------------------------------------------------------ detectors
def _ranks(
    store: Any, tmp_path: Any, dims: list[tuple[str, int]], comps: Any, **kw: Any
) -> list[tuple[Any, Any]]:
    """One agent per rank of a job laid out over ``dims`` (no mesh: (pp, dp, tp) row-major), all on
    ``store``; ``comps(rank)`` gives each rank's collectors."""
    import dataclasses

    from hpar_agent.detectors.component import DetectorsComponent
    from tests.unit.harness import make_agent

    grid = Grid.row_major(dims)
    sizes = dict(dims)
    out = []
    for r in grid.ranks:
        c = _coords(grid, r)
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=len(grid.ranks),
            comps=comps(r),
            exchange=Exchange(store, "job", r),
            **{"detectors.exchange_s": 0.0},
            **kw,
        )
        agent.topology = dataclasses.replace(
            agent.topology,
            dp=sizes.get("dp", 1),
            tp=sizes.get("tp", 1),
            dp_rank=c.get("dp", 0),
            tp_rank=c.get("tp", 0),
        )
        agent._context = None
        agent.components.remove(det)
        det = DetectorsComponent(exchange=det.exchange)
        agent.add_component(det)
        agent.config.evidence = False
        out.append((agent, det))
    return out


def _tick(ranks: list[tuple[Any, Any]], times: int) -> None:
    for _ in range(times):
        for agent, _det in ranks:
            agent.tick()
    assert [a.errors for a, _ in ranks if a.errors] == []


def _active(ranks: list[tuple[Any, Any]], alert: str) -> set[int]:
    return {det.snapshot.rank for _, det in ranks if det.states[alert].active}


def test_compile_divergence_on_sampled_peers_names_the_odd_rank_only(store: Any, tmp_path: Any) -> None:
    from tests.unit.harness import Fake, steps

    ranks = _ranks(
        store, tmp_path, [("dp", 12)], lambda r: (steps(10), Fake("compile", fingerprint=2 if r == 7 else 1))
    )
    _tick(ranks, 3)
    assert _active(ranks, "CompileDivergence") == {7}
    assert all(
        len(det.snapshot.exchange.peers) == 5 for _, det in ranks
    )  # each compared itself with 4 of its 11 peers
    assert ranks[7][1].states["CompileDivergence"].details["fingerprints"] == {
        "4": 1,  # offsets 3 (12 // 5 = 2 moved to odd) and 10 (2 * 12 // 5 = 4 is 8 back, 6 half-way)
        "5": 1,
        "7": 2,
        "9": 1,
        "10": 1,
    }


def test_compile_divergence_of_a_whole_node_is_outvoted_along_dp(store: Any, tmp_path: Any) -> None:
    """dp8 x tp8: the 8 tp ranks of dp index 3 (a node) compiled alike and differently from the rest.
    Among the peers each reads (4 tp, 4 dp) they are the majority; along dp they are outvoted."""
    from tests.unit.harness import Fake, steps

    ranks = _ranks(
        store,
        tmp_path,
        [("dp", 8), ("tp", 8)],
        lambda r: (steps(10), Fake("compile", fingerprint=2 if r // 8 == 3 else 1)),
    )
    _tick(ranks, 3)
    assert _active(ranks, "CompileDivergence") == set(range(24, 32))
    culprits = {r for _, det in ranks for r in det.states["CompileDivergence"].details.get("culprits", ())}
    assert culprits == set(range(24, 32))  # never their healthy dp peers (the minority of all 12 compared)


def test_compile_divergence_in_dp2_x_tp2_is_judged_over_the_whole_stage(store: Any, tmp_path: Any) -> None:
    """Each of rank 3's dims holds one peer (1-1 splits); a job of 4 reads every rank, and the stage's
    3-1 names rank 3 alone."""
    from tests.unit.harness import Fake, steps

    ranks = _ranks(
        store,
        tmp_path,
        [("dp", 2), ("tp", 2)],
        lambda r: (steps(10), Fake("compile", fingerprint=2 if r == 3 else 1)),
    )
    _tick(ranks, 3)
    assert _active(ranks, "CompileDivergence") == {3}
    assert ranks[3][1].states["CompileDivergence"].details["culprits"] == [3]


def test_collective_mismatch_and_straggler_on_sampled_dp_peers(store: Any, tmp_path: Any) -> None:
    from tests.unit.harness import Fake, dp_all_reduces, steps

    step = 300_000_000

    def comps(r: int) -> Any:
        entries = dp_all_reduces(0, 80_000_000 if r == 5 else 0, 7 if r == 0 else -1)
        return steps(10), Fake("collectives", recent_entries=entries)

    from hpar_agent.detectors.cluster import Straggler

    ranks = _ranks(store, tmp_path, [("dp", 10)], comps)
    for _, det in ranks:  # 20 steps of 4 all-reduces, each ending 0.2 s in
        for s in range(20):
            det.detector(Straggler).step_hook(StepTick(s, s * step + 200_000_000, None, 0))
    _tick(ranks, 3)
    assert _active(ranks, "CollectiveMismatch") == {0}
    assert _active(ranks, "Straggler") == {5}
    for _, det in ranks:
        assert len(det.snapshot.exchange.peers) == 5  # itself and 4 of 9
    readers_of_5 = {
        det.snapshot.rank for _, det in ranks if 5 in det.snapshot.exchange.peers and det.snapshot.rank != 5
    }
    assert readers_of_5 == {
        2,
        4,
        6,
        8,
    }  # +-3 (10 // 5 moved to odd) and +-1 (4 and 6 reach a node or half one)
    from hpar_agent.detectors.cluster import Straggler

    slowest = {det.snapshot.rank: getattr(det.detector(Straggler), "slowest", None) for _, det in ranks}
    assert {r for r, s in slowest.items() if s is not None and s[0] == 5} == readers_of_5 | {5}


def test_the_component_reads_the_meshs_layout(fake_pg: Any, tmp_path: Any) -> None:
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    from tests.unit.harness import make_agent

    fake_pg(5, 16)
    mesh = init_device_mesh(
        "cpu", (2, 2, 4), mesh_dim_names=("dp", "pp", "tp")
    )  # the reference trainer's order
    agent, det = make_agent(tmp_path, rank=5, world=16)
    agent.context.mesh = mesh
    groups = {d: sorted(dist.get_process_group_ranks(mesh.get_group(d))) for d in ("dp", "tp")}
    assert {
        d: sorted((5, *g)) for d, g in det.crossrank.peer_groups.items()
    } == groups  # no pp: stages never compared
    agent.context.mesh = mesh["tp"]  # a mesh without every rank: the topology's degrees instead
    agent.context.topology = dataclasses.replace(agent.topology, dp=2, pp=2, tp=4)
    assert det.crossrank.peer_groups == {
        "dp": (1,),
        "tp": (4, 6, 7),
    }  # (pp, dp, tp) row-major: rank 5 is pp0 dp1 tp1
