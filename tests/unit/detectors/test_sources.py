"""The detectors' readers (``detectors/sources.py``) read fields the real collectors have: with every
collector present each reader returns data of its type, built from the collector's own state, so a
renamed field fails here (and in mypy) instead of turning a detector silently off."""

from __future__ import annotations

import dataclasses
from collections import Counter

from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.gradsync import GradSyncCollector
from hpar_agent.collectors.memory import MemoryCollector, NvmlCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.config import AgentConfig
from hpar_agent.context import AgentContext
from hpar_agent.detectors import sources as src
from hpar_agent.histogram import Histogram
from hpar_agent.topology import Topology


def _context() -> AgentContext:
    """Real collectors, never installed (no hooks), holding state as their poll leaves it."""
    comp, coll, mem, steps = CompileCollector(), CollectiveCollector(), MemoryCollector(), StepCollector()
    comp.recompiles = Counter({"size_mismatch": 2})
    comp.limit_hits = 1
    comp.cache = Counter({("fx_graph", "hit"): 3, ("fx_graph", "miss"): 1})
    comp.graph_breaks = Counter({"gb0007": 2})
    comp.break_info = {"gb0007": {"reason": "broadcast", "c10d": "broadcast", "user_frames": {"m.py:3"}}}
    comp.graph_log.append((4, "m.py:3"))
    comp.compiles = Counter({("ok", "first", "inductor"): 2})
    comp.graphs = {"g1"}
    mem._post("rss", 5, 1 << 20)
    hist = Histogram((0.1, 1.0))
    hist.observe(0.05)
    coll.stats.hists[("dp", "all_reduce", "nccl:0")] = hist
    coll.stats.timed, coll.stats.timed_ops = (
        1,
        coll.stats.timed_ops.__class__([("dp", "all_reduce", 0, 1, 0.01)]),
    )
    coll.recent_entries.append(
        {"pg": "dp", "seq": 0, "op": "all_reduce", "record_id": 9, "time_created_ns": 5}
    )
    coll.pg("dp").oldest_age = 1.5
    coll.pg_timeout_s = 600.0
    steps.total, steps.last_step_ts, steps.durations = 6, 1.0, [0.3]
    comps = [comp, coll, mem, steps, GradSyncCollector(), NvmlCollector()]
    return AgentContext(AgentConfig(), Topology(rank=0, world_size=2), components=comps)


def test_every_reader_returns_the_collectors_state() -> None:
    ctx = _context()
    comp = src.compile_state(ctx)
    assert comp is not None
    assert comp.recompiles == 3.0  # 2 recompiles + 1 limit hit
    assert comp.limit_hits == 1.0
    assert comp.cache_lookups == (3.0, 1.0)
    assert comp.graph_breaks == {"gb0007": 2}
    assert "c10d call `broadcast`" in comp.break_detail("gb0007") == src.graph_break_detail(ctx, "gb0007")
    assert comp.break_c10d("gb0007") == "broadcast"
    assert comp.graph_log == [(4, "m.py:3")]
    assert isinstance(comp.fingerprint, int)
    assert comp.activity == (2.0, 0.0, 1.0, 0.0)
    assert src.memory_state(ctx) == ({"rss": [(5, float(1 << 20))]}, {})  # no room off CUDA
    ((bounds, counts),) = src.latency_histograms(ctx).values()
    assert bounds == (0.1, 1.0) and sum(counts) == 1
    coll = src.collective_state(ctx)
    assert (coll.timed, coll.timed_ops) == (1, [("dp", "all_reduce", 0, 1, 0.01)])
    assert coll.oldest_inflight == {"dp": 1.5}
    assert coll.pg_timeout_s == 600.0
    assert [e[1:3] for e in coll.fr_entries] == [(0, "all_reduce")] == [e[1:3] for e in src.fr_entries(ctx)]
    assert src.step_state(ctx) == (6, 1.0, [0.3])
    assert src.grad_sync(ctx) == (None, None, -1, 0, {})  # nothing judged yet
    assert src.cpu_binding(ctx) is None  # read at install


def test_without_collectors_every_reader_reads_no_data() -> None:
    ctx = AgentContext(AgentConfig(), Topology())
    assert src.compile_state(ctx) is None and src.graph_break_detail(ctx, "gb0007") == ""
    assert (
        src.memory_state(ctx) == ({}, {}) and src.latency_histograms(ctx) == {} and src.fr_entries(ctx) == []
    )
    assert src.collective_state(ctx) == (0, [], {}, {}, None, [], (), ()) and src.step_state(ctx) == (
        0,
        0.0,
        [],
    )
    assert src.grad_sync(ctx) is None and src.cpu_binding(ctx) is None


def test_no_reader_guesses_attribute_names() -> None:
    """The readers use typed attribute access only: no ``getattr`` with a fallback name."""
    import inspect

    text = inspect.getsource(src)
    assert "getattr(" not in text and "_get(" not in text


def test_fr_entries_are_shared_until_the_kept_entries_change() -> None:
    """The feed asks every pass; the answer is computed again only when an FR read added entries."""
    ctx = AgentContext(AgentConfig(), Topology())
    c = CollectiveCollector()
    ctx.components = [c]
    entry = {
        "pg": "dp",
        "seq": 1,
        "is_p2p": False,
        "op": "all_reduce",
        "input_sizes": "[[4]]",
        "input_dtypes": "Float",
        "time": 1.0,
        "record_id": 1,
    }
    c.recent_entries.append(entry)
    window = src.FrWindow()
    first = window.read(ctx)
    assert window.read(ctx) is first and [e[1] for e in first] == [1]
    c.recent_entries.append({**entry, "seq": 2, "record_id": 2})
    second = window.read(ctx)
    assert second is not first and [e[1] for e in second] == [1, 2]
    assert [e[1] for e in window.read(ctx, limit=1)] == [2]
    ctx.topology = dataclasses.replace(ctx.topology, tp_rank=1)  # other coordinates: other group ids
    assert window.read(ctx) is not second


def test_the_fr_window_widens_to_span_its_steps_up_to_four_times_its_limit() -> None:
    """160 collectives a 0.3 s step: 256 entries hold 1.6 steps; asked to span 3 steps (0.9 s) the window
    holds 482 entries, never more than 4 x 256."""
    c = CollectiveCollector()
    for i in range(2000):
        c.recent_entries.append(
            {
                "pg": "dp",
                "seq": i,
                "op": "all_reduce",
                "time_created_ns": i // 160 * 300_000_000 + i % 160 * 1_000_000,
            }
        )
    coords = Topology().coords()
    assert len(src.FrWindow().entries(c, coords, 256)) == 256
    assert (
        len(src.FrWindow().entries(c, coords, 256, span_ns=900_000_000)) == 3 * 160 + 2
    )  # and the one before
    assert len(src.FrWindow().entries(c, coords, 256, span_ns=10 * 300_000_000)) == 4 * 256


def test_steps_done_is_the_training_threads_count_not_the_last_drain():
    """A paced pass reaches the detectors most of an interval after the step collector drained its
    boundaries; a graph break of step 3 read in between must not count as one of warm-up step 2."""
    steps = StepCollector()
    ctx = AgentContext(config=AgentConfig(), topology=Topology(), components=[steps])
    steps.total, steps.count = 2, 3  # drained two boundaries; the training thread has marked a third
    assert src.step_state(ctx)[0] == 3


def test_fr_entries_convert_a_sliding_window_as_a_fresh_conversion_would() -> None:
    """Entries converted at an earlier read are reused (by identity: a new dict at a reused id is
    converted again); the answer equals converting the window from scratch, and the coordinates
    the pg ids carry are those of the call."""
    ctx = _context()
    coll = ctx.find(CollectiveCollector)
    assert coll is not None
    coll.recent_entries.clear()

    def add(first: int, n: int) -> None:
        for i in range(first, first + n):
            coll.recent_entries.append(
                {
                    "pg": "tp" if i % 3 else "dp",
                    "seq": i,
                    "op": "all_reduce",
                    "record_id": i,
                    "input_sizes": [[4, i % 5]],
                    "input_dtypes": ["Float"],
                    "time_created_ns": 10**18 + i,
                    "is_p2p": i % 7 == 0,
                }
            )

    def fresh() -> list[tuple]:
        return src.fr_entries(ctx, 64)  # a window of its own: converted from scratch

    window = src.FrWindow()
    add(0, 100)
    window.read(ctx, 64)
    for first in (100, 130, 160):
        add(first, 30)
        got = window.read(ctx, 64)
        assert got == fresh()
        assert [e[1] for e in got] == [i for i in range(first + 30 - 64, first + 30) if i % 7]  # no p2p
    coll.recent_entries[-1] = {
        **coll.recent_entries[-1],
        "op": "broadcast",
        "seq": 999,
        "is_p2p": False,
    }  # a new dict
    assert window.read(ctx, 64)[-1][1:3] == (999, "broadcast")
    ctx.topology = dataclasses.replace(ctx.topology, dp_rank=1)  # other coordinates: other pg ids
    assert window.read(ctx, 64) == fresh()


def test_memory_series_last_keeps_the_latest_samples_only() -> None:
    ctx = _context()
    mem = ctx.find(MemoryCollector)
    assert mem is not None
    for step in range(6, 30):
        mem.post_step["rss"].append((step, step << 20))
    assert src.memory_state(ctx, last=4).series == {"rss": [(s, float(s << 20)) for s in range(26, 30)]}
    assert len(src.memory_state(ctx).series["rss"]) == 25  # unset: the whole history


def test_group_key_separates_hsdp_groups() -> None:
    from hpar_agent.detectors.sources import _group_key

    def topo(rep: int, shard: int) -> Topology:
        return Topology(
            dp=4,
            dp_replicate=2,
            dp_shard=2,
            dp_rank=rep * 2 + shard,
            dp_replicate_rank=rep,
            dp_shard_rank=shard,
        )

    keys = {(rep, sh): _group_key("dp_shard", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}
    assert keys[(0, 0)] == keys[(0, 1)] != keys[(1, 0)] == keys[(1, 1)]  # one dp_shard group per replica
    rkeys = {(rep, sh): _group_key("dp_replicate", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}
    assert rkeys[(0, 0)] == rkeys[(1, 0)] != rkeys[(0, 1)]
    assert len({_group_key("dp", topo(rep, sh).coords()) for rep in (0, 1) for sh in (0, 1)}) == 1
