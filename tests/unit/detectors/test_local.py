"""The single-rank detectors (``detectors.local``) through the detectors component: memory leak, hang,
recompile storm, graph breaks, compiled graphs growing, collective latency, and the allocator history a
suspected leak turns on."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import Counter, deque
from typing import Any

import pytest
import torch

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.collectors.collective_state import PgState
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.crossrank import Exchange
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors.base import StepTick
from hpar_agent.detectors.cluster import Straggler
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.detectors.liveness import Hang
from hpar_agent.detectors.local import CollectiveLatencyHigh, GraphBreaks, MemoryLeak, RecompileStorm
from hpar_agent.spans import StepRecord
from tests.unit.harness import Fake, alert_events, inert, make_agent, sample, steps

MiB = 1 << 20


def test_memory_leak_fires_with_evidence_then_resolves(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    series: deque = deque(maxlen=64)
    mem = Fake("memory", post_step={"rss": series})
    agent, det = make_agent(tmp_path, comps=(steps(40), mem))
    caplog.set_level(logging.INFO, logger="hpar_agent")
    for s in range(40):
        series.append((s, 10**9 + 4 * MiB * s))
    agent.tick()
    assert sample(det, "hpar_alert_active", "MemoryLeak") == 1.0
    assert sample(det, "hpar_alerts_total", "MemoryLeak") == 1.0
    assert sample(det, "hpar_detector_value", "MemoryLeak") == pytest.approx(4 * MiB)
    fired = alert_events(agent)
    assert [(e["alert"], e["state"], e["rank"], e["pp_stage"]) for e in fired] == [
        ("MemoryLeak", "firing", 0, 0)
    ]
    txt = [p for p in fired[0]["evidence"] if p.endswith(".pyspy.txt")]
    assert txt, fired[0]["evidence"]
    assert stat.S_IMODE(os.stat(txt[0]).st_mode) == 0o600
    with open(txt[0], encoding="utf-8") as fh:
        assert "Thread" in fh.read()  # py-spy's dump of this very process
    rec = StepRecord(step=40, start_ns=0, end_ns=1)
    det.on_step(rec)
    assert (
        rec.anomalous
        and rec.events[0][0] == cat.EVENT_ALERT
        and rec.events[0][2][cat.ATTR_ALERT] == "MemoryLeak"
    )

    series.extend((s, 10**9 + 4 * MiB * 40) for s in range(40, 80))  # flat: the leak stopped
    for _ in range(MemoryLeak.clear):
        agent.tick()
    assert sample(det, "hpar_alert_active", "MemoryLeak") == 0.0
    assert [e["state"] for e in alert_events(agent)] == ["firing", "resolved"]

    series.extend((s, 10**9 + 4 * MiB * s) for s in range(80, 120))  # leaks again: fires, no new log line
    agent.tick()
    assert sample(det, "hpar_alerts_total", "MemoryLeak") == 2.0
    assert alert_events(agent)[-1]["evidence"] == []  # evidence is rate-limited too
    warnings = [r for r in caplog.records if "alert MemoryLeak firing" in r.getMessage()]
    assert len(warnings) == 1
    assert det.summary()["MemoryLeak"]["fired"] == 2


#: steps at which the clean pp2 1F1B inductor run compiled: both stages' blocks in the first steps, then
#: lazily compiled backward and microbatch-shape variants now and then until step 27
WARMUP_COMPILES = (0, 1, 2, 6, 13, 20, 27)


def _warmup_rss(s: int) -> float:
    """Host RSS of that run's shape: +40 MiB a step in the first compiles, then +2 MiB a step while
    compiles still come now and then (kernels loaded, caches filling: a trend window of 20 steps from
    step 10 saw a leak and fired at step 30), then a tail that fades out after the last compile, flat."""
    import math

    grow = 40 * MiB * min(s, 3) + 2 * MiB * min(max(s - 3, 0), 24)
    tail = 0 if s < 27 else 8 * MiB * (1 - math.exp(-(s - 27) / 4))
    return 2e9 + grow + tail + ((s * 7919) % 5) * 100_000


def _run_memory(
    tmp_path: Any, series: dict[str, list[tuple[int, float]]], compiles: Any, steps_to: int
) -> tuple[DetectorsComponent, list[int]]:
    """Tick the detectors once per step as the agent would, with a compile at each step of
    ``compiles``; returns the steps (completed) at which MemoryLeak was active."""
    fed: dict[str, deque] = {k: deque(maxlen=256) for k in series}
    comp = Fake("compile", compiles=Counter(), _open={}, compile_seconds=0.0, graphs=set())
    st = steps(0)
    agent, det = make_agent(tmp_path, comps=(st, comp, Fake("memory", post_step=fed)))
    agent.config.evidence = False
    active = []
    for s in range(steps_to):
        if s in compiles:
            comp.compiles[("ok", "x")] += 1
        for k, v in series.items():
            fed[k].append(v[s])
        st.total = s + 1
        agent.tick()
        if det.states["MemoryLeak"].active:
            active.append(s + 1)
    return det, active


def test_memory_leak_ignores_warmup_growth_that_flattens(tmp_path: Any) -> None:
    rss = [(s, _warmup_rss(s)) for s in range(90)]
    # the old trend (20 steps from step 5 on) saw a leak here
    assert sig.leak_signal(rss[:31], warmup_steps=5, window=20, min_slope=MiB, min_increase_fraction=0.2)[1]
    det, active = _run_memory(tmp_path, {"rss": rss}, WARMUP_COMPILES, steps_to=90)
    assert active == [], active
    assert det.states["MemoryLeak"].fired == 0


def test_memory_leak_catches_4mib_per_step_on_host_and_device_within_the_bound(tmp_path: Any) -> None:
    inject = 3
    host = [(s, _warmup_rss(s) + 4 * MiB * max(0, s - inject)) for s in range(60)]
    # allocated bytes grow 4 MiB a step; the caching allocator reserves 20 MiB segments: a stair, +20 MiB
    # every 5 steps (judged alone too: reserved and NVML bytes see only the stairs)
    allocated = [(s, 1e9 + 4 * MiB * max(0, s - inject)) for s in range(60)]
    reserved = [(s, 1e9 + 20 * MiB * (max(0, s - inject) // 5)) for s in range(60)]
    for name, series in (
        ("host", {"rss": host}),
        ("device", {"allocator": allocated}),
        ("stairs", {"reserved": reserved}),
    ):
        det, active = _run_memory(tmp_path / name, series, range(2), steps_to=60)
        assert active, name
        assert active[0] - inject <= 20, (name, active[0])
        assert det.states["MemoryLeak"].details["source"] == next(iter(series))


def test_memory_leak_host_rss_drift_below_2mib_per_step_is_not_a_leak(tmp_path: Any) -> None:
    # a clean 40-step CPU demo (4 ranks, aot_eager) fired on every rank: RSS rose 1.3 MB a step for a
    # whole window after compiles, glibc arenas and Python's allocator settling; the same rise of
    # allocated CUDA bytes would be a leak (1 MiB threshold there)
    drift = [(s, 4e8 + 1.3e6 * s) for s in range(40)]
    _det, active = _run_memory(tmp_path / "rss", {"rss": drift}, range(2), steps_to=40)
    assert active == [], active
    _det, active = _run_memory(tmp_path / "alloc", {"allocator": drift}, range(2), steps_to=40)
    assert active, "the device threshold stays at 1 MiB/step"


def test_memory_leak_of_compiled_graphs_is_not_warmup(tmp_path: Any) -> None:
    # compile-leak: a compile every step for good; that is not warm-up, the trend is judged anyway
    series = {"rss": [(s, 1e9 + 4 * MiB * s) for s in range(60)]}
    _det, active = _run_memory(tmp_path, series, range(60), steps_to=60)
    assert active and active[0] <= 30, active


def test_hang_on_no_progress_with_threshold_override(tmp_path: Any) -> None:
    st = steps(5, last_ts=time.time() - 30)
    agent, det = make_agent(tmp_path, comps=(st,), **{"Hang.timeout_s": 10.0})
    agent.config.evidence = False
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 1.0
    assert sample(det, "hpar_detector_value", "Hang") >= 30
    st.last_step_ts = time.time()  # progress again
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 0.0


def test_an_alert_line_prints_the_threshold_its_value_was_compared_with(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Hang's limit comes from the process group's timeout (80 % of 20 s), not its 60 s parameter: the
    line, the event, the callbacks' alert and the summary show the 16 s it fired past."""
    coll = Fake("collectives", pg_timeout_s=20.0, recent_entries=deque())
    agent, det = make_agent(tmp_path, comps=(steps(5, last_ts=time.time() - 17), coll))
    agent.config.evidence = False
    caplog.set_level(logging.INFO, logger="hpar_agent")
    agent.tick()
    (fired,) = [e for e in alert_events(agent) if e["alert"] == "Hang"]
    assert fired["threshold"] == pytest.approx(16.0) and fired["value"] > 16.0
    (line,) = [r.getMessage() for r in caplog.records if "alert Hang firing" in r.getMessage()]
    assert ", threshold 16)" in line, line
    assert det.summary()["Hang"]["threshold"] == pytest.approx(16.0)
    assert det.active_alerts()[0].threshold == pytest.approx(16.0)


def test_hang_default_timeout_is_not_a_checkpoint_pause(tmp_path: Any) -> None:
    agent, det = make_agent(tmp_path, comps=(steps(50, last_ts=time.time() - 40),))
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 0.0


def test_hang_on_collective_in_flight(tmp_path: Any) -> None:
    ages = {"dp": PgState(oldest_age=90.0), "tp": PgState(oldest_age=0.0)}
    coll = Fake("collectives", pgs=ages, recent_entries=deque())
    agent, det = make_agent(tmp_path, comps=(steps(5), coll))
    agent.config.evidence = False
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 1.0
    assert det.states["Hang"].details["pg"] == "dp"


def test_recompile_storm_and_cache_hit_ratio(tmp_path: Any) -> None:
    comp = Fake(
        "compile", recompiles=Counter({"size": 3}), limit_hits=0, cache=Counter(), graph_breaks=Counter()
    )
    st = steps(10)
    agent, det = make_agent(tmp_path, comps=(st, comp))
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 0.0
    comp.recompiles["int"] += 9  # 12 in the window
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 1.0
    assert sample(det, "hpar_detector_value", "RecompileStorm") == 12.0  # counted since attach
    # a second process: no recompiles, but the cache misses after warm-up
    comp2 = Fake("compile", recompiles=Counter(), limit_hits=0, cache=Counter({("fx_graph", "hit"): 2}))
    agent2, det2 = make_agent(tmp_path / "b", comps=(steps(10), comp2))
    agent2.tick()
    comp2.cache[("fx_graph", "miss")] += 25
    comp2.cache[("fx_graph", "hit")] += 5
    agent2.tick()
    assert sample(det2, "hpar_alert_active", "RecompileStorm") == 1.0


def test_cache_pollution_needs_both_many_recompiles_and_a_low_hit_ratio(tmp_path: Any) -> None:
    """The design document's cache pollution: recompiles > 10 AND cache hit ratio < 0.3 over the window
    (counters recorded from a run whose shapes change every step with inductor's FX graph cache)."""
    comp = Fake("compile", recompiles=Counter(), limit_hits=0, cache=Counter({("fx_graph", "miss"): 4}))
    agent, det = make_agent(tmp_path, comps=(steps(10), comp))
    agent.tick()
    comp.recompiles["tensor_size"] += 6
    comp.cache.update({("fx_graph", "miss"): 24, ("fx_graph", "hit"): 2})  # ratio 0.08, 6 recompiles
    agent.tick()
    st = det.states["RecompileStorm"]
    assert (
        sample(det, "hpar_alert_active", "RecompileStorm") == 1.0 and st.details["mode"] == "cache_hit_ratio"
    )
    comp.recompiles["tensor_size"] += 6  # 12 recompiles in the window and still ratio < 0.3
    comp.cache.update({("fx_graph", "miss"): 6})
    agent.tick()
    assert det.states["RecompileStorm"].details["mode"] == "cache_pollution"
    assert det.states["RecompileStorm"].details["hit_ratio"] < 0.3
    # many recompiles while the cache hits (a warm cache) is a recompile storm, not pollution
    comp2 = Fake("compile", recompiles=Counter(), limit_hits=0, cache=Counter())
    agent2, det2 = make_agent(tmp_path / "b", comps=(steps(10), comp2))
    agent2.tick()
    comp2.recompiles["int_value"] += 12
    comp2.cache.update({("fx_graph", "hit"): 30, ("fx_graph", "miss"): 2})
    agent2.tick()
    assert det2.states["RecompileStorm"].details["mode"] == "recompiles"


def test_graph_break_from_a_c10d_call_points_to_functional_collectives(tmp_path: Any) -> None:
    from hpar_agent.collectors.compile import CompileCollector
    from tests.unit.test_compile import C10D_BREAK

    coll = CompileCollector()
    coll._count_break("gb0007", C10D_BREAK, "/src/train.py:14")  # recorded dist.broadcast break (torch 2.13)
    comp = Fake("compile", graph_breaks=Counter(), break_info=coll.break_info)
    agent, det = make_agent(tmp_path, comps=(steps(10), comp))
    agent.tick()
    comp.graph_breaks["gb0007"] += 1  # the break appears after warm-up
    agent.tick()
    d = det.states["GraphBreaks"].details
    assert sample(det, "hpar_alert_active", "GraphBreaks") == 1.0
    assert d["c10d_calls"] == {"gb0007": "broadcast"} and "_functional_collectives" in d["fix"]
    assert d["reasons"]["gb0007"].startswith("c10d call `broadcast` inside compiled code")


def test_compiled_graphs_growing_after_warmup_names_the_location(tmp_path: Any) -> None:
    from hpar_agent.detectors.local import CompiledGraphsGrowing

    where = "_leaky_graph trainer/inject.py:27"
    warm = [(0, "forward model.py:40")] * 6 + [(1, "forward model.py:40")] * 2  # warm-up compiles
    comp = Fake("compile", graph_log=deque(warm))
    st = steps(6)
    agent, det = make_agent(tmp_path, comps=(st, comp))
    agent.tick()
    assert sample(det, "hpar_alert_active", "CompiledGraphsGrowing") == 0.0  # warm-up only
    comp.graph_log.extend([(6, where), (6, where)])  # one late burst on one step: not growth
    st.total = 7
    agent.tick()
    assert sample(det, "hpar_alert_active", "CompiledGraphsGrowing") == 0.0
    for s in (7, 8, 9):  # a new graph per microbatch, step after step
        comp.graph_log.extend([(s, where)] * 2)
        st.total = s + 1
        agent.tick()
    d = det.states["CompiledGraphsGrowing"].details
    assert sample(det, "hpar_alert_active", "CompiledGraphsGrowing") == 1.0
    assert d["location"] == where and d["graphs_in_window"] == 8 and d["steps_with_compiles"] == 4
    assert CompiledGraphsGrowing().threshold == 4


def test_recompile_limit_hit_is_a_storm(tmp_path: Any) -> None:
    comp = Fake(
        "compile", recompiles=Counter({"int_value": 7}), limit_hits=0, cache=Counter(), graph_breaks=Counter()
    )
    agent, det = make_agent(tmp_path, comps=(steps(10), comp))
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 0.0  # 7 recompiles: under 10
    comp.limit_hits = 1  # the 8th recompile was refused: the frame runs eager from now on
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 1.0
    assert det.states["RecompileStorm"].details["limit_hits_in_window"] == 1


def test_graph_breaks_after_warmup_only(tmp_path: Any) -> None:
    comp = Fake(
        "compile",
        graph_breaks=Counter({"gb0007": 2}),
        break_info={"gb0170": {"reason": "item()", "user_frames": {"model.py:12"}}},
    )
    st = steps(1)
    agent, det = make_agent(tmp_path, comps=(st, comp))
    agent.tick()  # warm-up break: baseline
    st.total = 10
    agent.tick()
    assert sample(det, "hpar_alert_active", "GraphBreaks") == 0.0
    comp.graph_breaks["gb0170"] += 1
    agent.tick()
    assert sample(det, "hpar_alert_active", "GraphBreaks") == 1.0
    assert "model.py:12" in alert_events(agent)[-1]["details"]["reasons"]["gb0170"]
    st.total = 40  # hold_steps (20) later without a new reason: resolved
    agent.tick()
    assert sample(det, "hpar_alert_active", "GraphBreaks") == 0.0


class TimedOps(inert(CollectiveCollector)):  # type: ignore[misc]
    """A collectives collector fed by the test: timed ops (pg, op, seq, enqueue ns, seconds) and the
    flight-recorder entries this rank publishes for the exchange."""

    def __init__(self) -> None:
        super().__init__()
        self.stats.timed_ops, self.stats.timed, self.recent_entries = (
            deque(maxlen=2048),
            0,
            deque(maxlen=2048),
        )

    def op(self, seq: int, created_s: float, seconds: float, pg: str = "dp") -> None:
        self.stats.timed_ops.append((pg, "all_reduce", seq, int(created_s * 1e9), seconds))
        self.stats.timed += 1
        self.recent_entries.append(
            {
                "pg": pg,
                "seq": seq,
                "op": "all_reduce",
                "is_p2p": False,
                "record_id": seq,
                "input_sizes": [[1024]],
                "input_dtypes": ["Float"],
                "time": created_s,
            }
        )


def test_collective_latency_single_rank_p99_above_slo(tmp_path: Any) -> None:
    coll = TimedOps()
    agent, det = make_agent(tmp_path, comps=(steps(5), coll))
    agent.tick()  # warm-up over (no compiles): ops enqueued from now on are judged
    t0 = time.time()
    for i in range(100):
        coll.op(i, t0 + 0.01 * i, 0.02)
    agent.tick()
    assert sample(det, "hpar_alert_active", "CollectiveLatencyHigh") == 0.0
    for i in range(100, 110):
        coll.op(i, t0 + 0.01 * i, 0.4)
    agent.tick()
    assert sample(det, "hpar_alert_active", "CollectiveLatencyHigh") == 1.0
    assert sample(det, "hpar_detector_value", "CollectiveLatencyHigh") == pytest.approx(0.4)


def _dp_pair(
    store: Any, tmp_path: Any, compile_state: dict[str, Any]
) -> list[tuple[Agent, DetectorsComponent, TimedOps, Fake]]:
    out = []
    for r in range(2):
        coll, st = TimedOps(), steps(1)
        comp = Fake(
            "compile",
            compiles=Counter(compile_state["compiles"]),
            _open=dict(compile_state["open"]),
            compile_seconds=0.0,
            graphs=set(),
            fingerprint=7,
        )
        agent, det = make_agent(
            tmp_path,
            rank=r,
            world=2,
            comps=(st, comp, coll),
            exchange=Exchange(store, "job", r),
            coords={"dp": r, "dpn": 2},
            **{"detectors.exchange_s": 0.0},
        )
        agent.config.evidence = False
        out.append((agent, det, coll, st))
    return out


def _all_reduces(
    pair: list,
    first_seq: int,
    n: int,
    late_rank: int,
    skew_s: float,
    transfer_s: float,
    t0: float | None = None,
) -> None:
    """n all-reduces of a dp pair 0.3 s apart from ``t0`` (now) as NCCL times them: every rank's duration
    runs from its kernel start to the end, so the rank that arrived first also times the wait for
    ``late_rank`` (``skew_s``)."""
    t0 = time.time() if t0 is None else t0
    for i in range(n):
        seq, start = first_seq + i, t0 + 0.3 * i
        for r, (_agent, _det, coll, _st) in enumerate(pair):
            late = skew_s if r == late_rank else 0.0
            coll.op(seq, start + late, transfer_s + (skew_s - late))
        for _agent, det, *_ in pair:  # each all-reduce ends a step (Straggler measures steps)
            det.detector(Straggler).step_hook(
                StepTick(seq, int((start + skew_s + transfer_s + 0.005) * 1e9), None, 0)
            )


def _tick(pair: list, times: int = 2) -> None:
    for _ in range(times):  # one round publishes, the next reads every peer's entries
        for agent, *_ in pair:
            agent.tick()


def test_collective_latency_ignores_peer_waits_in_compile_warmup_and_after(store: Any, tmp_path: Any) -> None:
    # The clean dp2 H200 run: rank 1 still compiling, rank 0's all-reduces wait for it (p99 0.22 s).
    pair = _dp_pair(store, tmp_path, {"compiles": {("ok", "x"): 1}, "open": {("1/0", "x"): (0, 0)}})
    _tick(pair, 1)
    _all_reduces(
        pair, 0, 40, late_rank=1, skew_s=0.22, transfer_s=0.003, t0=time.time() - 0.3 * 40 - 0.1
    )  # done by now
    _tick(pair)
    for agent, _det, _coll, st in pair:  # compiles end (seen at step 5); warm-up is over 3 quiet steps later
        agent.context.find(CompileCollector)._open = {}  # type: ignore[union-attr]
        st.total = 5
    _tick(pair)
    assert not pair[0][1].snapshot.warmup.warmed_up(3, 10)
    for *_, st in pair:
        st.total = 8
    _tick(pair)
    assert pair[0][1].snapshot.warmup.warmed_up(3, 10)
    for _agent, det, *_ in pair:
        assert sample(det, "hpar_alert_active", "CollectiveLatencyHigh") == 0.0
        assert det.detector(CollectiveLatencyHigh).judged == {}  # type: ignore[union-attr]  # nothing of warm-up
    # after warm-up a peer is still late at every op (a straggler, a checkpoint-like pause): the waiting
    # rank times 0.25 s, but the transfer took 3 ms
    _all_reduces(pair, 40, 40, late_rank=1, skew_s=0.25, transfer_s=0.003)
    _tick(pair)
    for _agent, det, *_ in pair:
        assert sample(det, "hpar_alert_active", "CollectiveLatencyHigh") == 0.0
        assert sample(det, "hpar_detector_value", "CollectiveLatencyHigh") < 0.01
        assert [len(w) for w in det.detector(CollectiveLatencyHigh).judged.values()] == [40]  # type: ignore[union-attr]
    _tick(pair, 1)  # Straggler confirms on a second exchange
    assert pair[1][1].states["Straggler"].active and not pair[0][1].states["Straggler"].active  # who was late
    # a genuinely slow link: both arrive within 1 ms, the transfer takes 0.2 s: fires on both ranks
    _all_reduces(pair, 80, 30, late_rank=1, skew_s=0.001, transfer_s=0.2)
    _tick(pair)
    for _agent, det, *_ in pair:
        assert sample(det, "hpar_alert_active", "CollectiveLatencyHigh") == 1.0
        assert sample(det, "hpar_detector_value", "CollectiveLatencyHigh") == pytest.approx(0.2, abs=0.002)


def test_collective_latency_leaves_unmatched_ops_unjudged(store: Any, tmp_path: Any) -> None:
    pair = _dp_pair(store, tmp_path, {"compiles": {}, "open": {}})
    for *_, st in pair:
        st.total = 10
    _tick(pair, 1)
    t0 = time.time()
    for i in range(30):  # only rank 0 saw these (its peer's entries were overwritten): not judged
        pair[0][2].op(i, t0 + 0.01 * i, 0.5)
    _tick(pair)
    lat = pair[0][1].detector(CollectiveLatencyHigh)
    assert lat is not None and lat.judged == {} and len(lat.pending) == 30
    assert sample(pair[0][1], "hpar_alert_active", "CollectiveLatencyHigh") == 0.0


def test_thresholds_override_defaults() -> None:
    d = MemoryLeak({"MemoryLeak.window": 8, "Hang.timeout_s": 1})
    assert d.p("window") == 8 and d.p("min_slope_bytes") == MiB
    assert RecompileStorm().threshold == 10 and CollectiveLatencyHigh().threshold == 0.085
    assert GraphBreaks().p("warmup_steps") == 3 and Hang().threshold == 60


def history_probe(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, source: str, n_steps: int
) -> tuple[Any, Any, deque, list[str]]:
    """An agent whose memory series ``source`` the test fills, and the allocator-history starts/stops
    its evidence collector is asked for (recorded, not run)."""
    series: deque = deque(maxlen=64)
    agent, det = make_agent(tmp_path, comps=(steps(n_steps), Fake("memory", post_step={source: series})))
    calls: list[str] = []
    assert det.evidence is not None
    monkeypatch.setattr(det.evidence, "start_memory_history", lambda **_: calls.append("start") or True)
    monkeypatch.setattr(det.evidence, "stop_memory_history", lambda: calls.append("stop"))
    return agent, det, series, calls


def test_allocator_history_runs_only_while_a_leak_is_suspected(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording every allocation's stack costs every step: a warm-up rise starts it, the plateau after
    stops it (left running it cost users 2-7% from the first steps on)."""
    agent, det, series, calls = history_probe(tmp_path, monkeypatch, "allocator", 60)
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(5, 15))  # warm-up growth: suspected
    agent.tick()
    assert calls == ["start"]
    series.extend((s, 10**9 + 8 * MiB * 15) for s in range(15, 60))  # plateau: cleared
    agent.tick()
    assert calls[-1] == "stop"
    assert sample(det, "hpar_alert_active", "MemoryLeak") == 0.0


def test_allocator_history_is_not_restarted_after_the_leak_fired(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot taken when MemoryLeak fires stops the recording; a leak still going on must not start
    it again (it would record every allocation's stack for the rest of the leak, for no snapshot)."""
    agent, det, series, calls = history_probe(tmp_path, monkeypatch, "allocator", 80)
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(5, 40))  # a leak: suspected, then confirmed
    for _ in range(3):
        agent.tick()
    assert sample(det, "hpar_alert_active", "MemoryLeak") == 1.0
    fired_at = len(calls)
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(40, 60))  # still leaking
    agent.tick()
    agent.tick()
    assert "start" not in calls[fired_at:]


def test_host_rss_growth_does_not_record_cuda_stacks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocation stacks explain device memory only: RSS growth alone never turns the recording on."""
    agent, _det, series, calls = history_probe(tmp_path, monkeypatch, "rss", 30)
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(5, 25))
    agent.tick()
    assert "start" not in calls


def test_memory_leak_says_when_the_device_is_full_at_this_slope(tmp_path: Any) -> None:
    """8 MiB a step with 800 MiB of headroom at step 40: full at step 140, 100 steps of 0.3 s away."""
    series: deque = deque((s, 10**9 + 8 * MiB * s) for s in range(40))
    mem = Fake("memory", post_step={"allocator": series}, headroom=800 * MiB, device_free=500 * MiB)
    agent, det = make_agent(tmp_path, comps=(steps(40), mem))
    agent.config.evidence = False
    agent.tick()
    d = det.states["MemoryLeak"].details
    assert d["full_at_step"] == 140 and d["room_bytes"] == 800 * MiB
    assert d["seconds_to_full"] == pytest.approx(30.0)
    assert d["forecast"] == "at 8.0 MiB/step the device is full at step 140 (in ~30 s)"
    fired = alert_events(agent)
    assert fired and fired[0]["details"]["full_at_step"] == 140  # the alert's event says it too
    series.clear()
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(40))
    mem.post_step = {"reserved": series}  # reserved bytes grow into the free device memory only
    agent.tick()
    assert det.states["MemoryLeak"].details["full_at_step"] == 40 + 63  # 500 MiB / 8 MiB = 62.5 steps


def test_allocator_history_resumes_when_the_device_is_full_within_the_window(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the leak's own snapshot the recording stays off, unless an out-of-memory is due within the
    trend window: its snapshot then names the code holding the memory."""
    agent, det, series, calls = history_probe(tmp_path, monkeypatch, "allocator", 40)
    series.extend((s, 10**9 + 8 * MiB * s) for s in range(5, 40))
    for _ in range(3):
        agent.tick()
    assert sample(det, "hpar_alert_active", "MemoryLeak") == 1.0
    fired_at = len(calls)
    agent.tick()
    assert "start" not in calls[fired_at:]  # no headroom known: nothing is due
    mem = agent.component("memory")
    assert mem is not None
    mem.__dict__.update(headroom=200 * MiB, device_free=100 * MiB)  # 25 steps left: not within 12
    agent.tick()
    assert "start" not in calls[fired_at:]
    mem.__dict__.update(headroom=80 * MiB)  # 10 steps left
    agent.tick()
    assert calls[fired_at:] == ["start"]


def _block(size: int, site: str | None, state: str = "active_allocated") -> dict[str, Any]:
    """An allocator snapshot's block; ``site`` ("file:line name") allocated it while history recorded."""
    frames = []
    if site:
        where, name = site.split(" ")
        filename, line = where.split(":")
        frames = [
            {
                "filename": os.path.join(os.path.dirname(torch.__file__), "_tensor.py"),
                "line": 1,
                "name": "ones",
            },
            {"filename": f"/home/user/{filename}", "line": int(line), "name": name},
        ]
    return {"size": size, "state": state, "frames": frames}


def test_the_leak_site_is_the_allocating_line_whose_live_bytes_grew() -> None:
    """Ten steps recorded: 16 MiB kept every step at train.py:42; the batch (churn: one step's worth
    live) and 2 GiB allocated before the recording (no frames) are not the site."""
    from hpar_agent.memory_forensics import leak_site

    blocks = [_block(16 * MiB, "train.py:42 main") for _ in range(10)]
    blocks += [_block(4 * MiB, "train.py:30 get_batch"), _block(4 * MiB, "train.py:30 get_batch", "inactive")]
    blocks += [_block(1 << 30, None), _block(1 << 30, None)]
    snap = {"segments": [{"device": 0, "blocks": blocks}]}
    site = leak_site(snap, 0, 10, 20 * MiB)  # the reserved bytes grew 20 MiB a step
    assert site == {
        "site": "train.py:42 in main",
        "site_live_bytes": 160 * MiB,
        "site_growth_bytes_per_step": 16 * MiB,
        "site_steps": 10,
    }
    churn = {"segments": [{"device": 0, "blocks": blocks[10:]}]}
    unknown = leak_site(churn, 0, 10, 16 * MiB)
    assert (
        unknown["site"] == "unknown" and "train.py:30 in get_batch holds the most" in unknown["site_unknown"]
    )
    assert leak_site({"segments": [{"device": 1, "blocks": blocks}]}, 0, 10, 16 * MiB)["site"] == "unknown"
    assert "began at the step the alert fired" in leak_site(snap, 0, 0, 16 * MiB)["site_unknown"]


def test_memory_leak_on_cpu_says_site_unknown_and_why_and_keeps_the_stack_apart(tmp_path: Any) -> None:
    """No allocator history on CPU: the alert says "site unknown" with the reason, never a site; the
    py-spy stack at firing stays in the details as what the thread was doing, not as "stack" (the site)."""
    series: deque = deque((s, 10**9 + 4 * MiB * s) for s in range(40))
    agent, det = make_agent(tmp_path, comps=(steps(40), Fake("memory", post_step={"rss": series})))
    agent.tick()
    d = alert_events(agent)[0]["details"]
    assert d["site"] == "unknown" and d["site_unknown"].startswith("the memory that grew is the host's (rss)")
    assert "stack" not in d and d.get("stack_at_firing"), d
    agent.tick()  # still active: the details read at firing stay
    assert det.states["MemoryLeak"].details["site"] == "unknown"
    series2: deque = deque((s, 10**9 + 4 * MiB * s) for s in range(40))
    agent2, _ = make_agent(
        tmp_path / "b", comps=(steps(40), Fake("memory", post_step={"allocator": series2}))
    )
    agent2.tick()
    d2 = alert_events(agent2)[0]["details"]
    assert d2["site"] == "unknown" and "no allocator history (CPU)" in d2["site_unknown"], d2
