"""Detectors: pure signals on synthetic shapes (failing and clean), the alert outputs, evidence and the
cross-rank exchange over a real TCPStore."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections import Counter, deque
from typing import Any

import pytest
import torch
from torch import nn

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.memory import MemoryCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.crossrank import Exchange
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors.cluster import CompileDivergence, ReplicaDivergence
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.detectors.local import CollectiveLatencyHigh, GraphBreaks, Hang, MemoryLeak, RecompileStorm
from hpar_agent.evidence import Evidence
from hpar_agent.families import Families
from hpar_agent.spans import StepRecord
from hpar_agent.topology import Topology

MiB = 1 << 20
LEAK = {"warmup_steps": 5, "window": 20, "min_slope": float(MiB), "min_increase_fraction": 0.2}


# ------------------------------------------------------------------------------------------ signals
def test_leak_fires_on_steady_and_stair_step_growth() -> None:
    steady = [(s, 1e9 + 4 * MiB * s) for s in range(40)]
    stairs = [(s, 1e9 + 8 * MiB * (s // 4)) for s in range(40)]  # +8 MiB every 4th step
    for samples in (steady, stairs):
        slope, leaking = sig.leak_signal(samples, **LEAK)
        assert leaking and slope >= MiB


def test_leak_quiet_on_plateau_checkpoint_and_noise() -> None:
    plateau = [(s, 1e9 + 50 * MiB * min(s, 12)) for s in range(40)]  # allocator grows, then plateaus
    checkpoint = [(s, 1e9 + (300 * MiB if s >= 25 else 0)) for s in range(40)]  # one jump, stays
    pause = [(s, 1e9 + (300 * MiB if s == 25 else 0)) for s in range(40)]  # one spike
    noise = [(s, 1e9 + ((s * 7919) % 13) * 300_000) for s in range(40)]
    for samples in (plateau, checkpoint, pause, noise):
        assert not sig.leak_signal(samples, **LEAK)[1]
    assert not sig.leak_signal([(s, 4 * MiB * s) for s in range(12)], **LEAK)[1]  # too few post-warm-up


def test_theil_sen_ignores_an_outlier() -> None:
    pts = [(float(x), 2.0 * x) for x in range(10)]
    pts[4] = (4.0, 1000.0)
    assert sig.theil_sen_slope(pts) == pytest.approx(2.0)


def test_odd_ranks_majority_and_tie() -> None:
    assert sig.odd_ranks({0: 1, 1: 1, 2: 7, 3: 1}) == {2}
    assert sig.odd_ranks({0: 1, 1: 2}) == {0, 1}
    assert sig.odd_ranks({0: 5, 1: 5}) == set()


def test_replica_offenders_dp_and_tp_subset() -> None:
    same = {"w": [1.5, 3.0], "b": [0.25, 0.25]}
    sums = {0: same, 1: same, 2: {"w": [1.5000001, 3.0], "b": [0.25, 0.25]}}
    assert sig.replica_offenders(sums) == {2: ["w"]}
    assert sig.replica_offenders(sums, names=["b"]) == {}
    nan = {0: {"w": [float("nan"), 1.0]}, 1: {"w": [float("nan"), 1.0]}}
    assert sig.replica_offenders(nan) == {}


def _fr(pg: str, seq: int, op: str = "all_reduce", sizes: str = "[[4]]", dt: str = "Float", t: int = 0) -> tuple:
    return (pg, seq, op, sizes, dt, t)


def test_collective_mismatch_by_majority_and_partial_windows() -> None:
    good = [_fr("dp@0,0", s) for s in range(5)]
    bad = [*good[:3], _fr("dp@0,0", 3, dt="BFloat16"), _fr("dp@0,0", 4, sizes="[[8]]")]
    out = sig.collective_mismatches({0: good, 1: good, 2: bad})
    assert set(out) == {2} and [m["seq"] for m in out[2]] == [3, 4]
    # rank 1's window moved on: seq 0-1 are not compared, nothing is flagged
    assert sig.collective_mismatches({0: good, 1: good[2:]}) == {}
    # a member that has not published yet must not turn a majority into a tie
    assert sig.collective_mismatches({0: good, 2: bad}, sizes={"dp@0,0": 3}) == {}


def test_collective_mismatch_tie_goes_to_the_narrow_dtype() -> None:
    good = [_fr("dp@0,0", s) for s in range(3)]
    bf16 = [*good[:2], _fr("dp@0,0", 2, sizes="[[8]]", dt="BFloat16")]
    assert set(sig.collective_mismatches({0: good, 1: bf16})) == {0, 1}  # no majority, no dtype rule
    assert set(sig.collective_mismatches({0: good, 1: bf16}, param_bits=32)) == {1}
    assert set(sig.collective_mismatches({0: good, 1: bf16}, param_bits=16)) == {0, 1}  # bf16 model: no rule


def test_low_precision_reduction_only_on_gradient_groups() -> None:
    entries = [_fr("dp@0,0", 1, dt="BFloat16"), _fr("tp@0,0", 1, dt="BFloat16"), _fr("dp@0,0", 2)]
    low = sig.low_precision_reductions(entries, 32, ["dp@0,0"])
    assert [e[1] for e in low] == [1] and low[0][0] == "dp@0,0"
    assert sig.low_precision_reductions(entries, 16, ["dp@0,0"]) == []


def test_arrival_lag_flags_the_late_rank_not_jitter() -> None:
    step = 300_000_000  # 0.3 s steps, 6 collectives per step
    def entries(rank: int, late_ns: int) -> list[tuple]:
        return [_fr("tp@0,0", i, t=(i // 6) * step + (i % 6) * 1_000_000 + late_ns + (rank * 37 * i) % 500_000)
                for i in range(60)]  # fmt: skip

    ratios = sig.arrival_lag_ratio({0: entries(0, 0), 1: entries(1, 0), 2: entries(2, 60_000_000)})
    assert ratios[2] > 0.1 and max(ratios[0], ratios[1]) < 0.02
    calm = sig.arrival_lag_ratio({r: entries(r, 0) for r in range(3)})
    assert max(calm.values()) < 0.02


def _lagged(late: dict[int, dict[int, int]], n_ranks: int = 2, steps: int = 30, per_step: int = 6) -> dict[int, list[tuple]]:
    """Synchronous collectives 1 ms apart, 0.3 s steps; ``late[rank][i]`` ns added to op i of that rank
    only (its peers waited there, so the following ops start together again)."""
    step = 300_000_000
    out: dict[int, list[tuple]] = {}
    for r in range(n_ranks):
        out[r] = [_fr("tp@0,0", i, t=(i // per_step) * step + (i % per_step) * 1_000_000 + late.get(r, {}).get(i, 0))
                  for i in range(steps * per_step)]  # fmt: skip
    return out


def test_arrival_lag_is_net_persistent_and_counts_a_burst_once() -> None:
    # rank 1 arrives 60 ms late at every step: others wait 60 ms per 0.3 s step
    late = {1: {i: 60_000_000 for i in range(0, 180, 6)}}
    ratios = sig.arrival_lag_ratio(_lagged(late))
    assert ratios[1] == pytest.approx(0.2, abs=0.02) and ratios[0] < 0
    # the same 60 ms late through an asynchronous burst of 6 ops per step: still 60 ms of waiting per step
    burst = {1: {i: 60_000_000 for i in range(180)}}
    assert 0.15 < sig.arrival_lag_ratio(_lagged(burst))[1] < 0.3  # not 6 x 60 ms per step
    # ranks taking turns being last (oversubscribed cores) net out
    turns = {r: {i: 20_000_000 for i in range(r * 6, 180, 12)} for r in (0, 1)}
    assert max(sig.arrival_lag_ratio(_lagged(turns)).values()) < 0.02
    # one 5 s stall (a checkpoint pause, a compile) is not persistent: it fills one half of the window
    stall = {0: {90: 5_000_000_000}}
    assert max(sig.arrival_lag_ratio(_lagged(stall)).values()) < 0.02
    assert sig.arrival_lag_ratio(_lagged(stall), slices=1)[0] > 0.25  # what a plain sum would have said


def test_hang_timeout_and_warmup() -> None:
    assert sig.stalled_seconds(1000.0, 900.0, steps_done=1, warmup_steps=2) == 0.0
    assert sig.stalled_seconds(1000.0, 900.0, steps_done=5, warmup_steps=2) == 100.0
    assert sig.hang_timeout(60, None, 0.3) == 60
    assert sig.hang_timeout(60, None, 20.0) == 200  # slow steps: 10 steps of silence
    assert sig.hang_timeout(60, 30.0, None) == 24  # below the pg timeout


def test_quantile_from_counts_uses_bucket_upper_bound() -> None:
    bounds = cat.LATENCY_BUCKETS
    counts = [0] * (len(bounds) + 1)
    counts[sig.bucket_of(bounds, 0.05)] = 99
    counts[sig.bucket_of(bounds, 0.3)] = 1
    assert sig.quantile_from_counts(bounds, counts, 0.99) == 0.085
    counts[sig.bucket_of(bounds, 0.3)] = 5
    assert sig.quantile_from_counts(bounds, counts, 0.99) == 0.46


# ------------------------------------------------------------------------------------------ harness
_REAL: dict[str, type[Component]] = {
    "steps": StepCollector, "compile": CompileCollector, "memory": MemoryCollector, "collectives": CollectiveCollector,
}  # fmt: skip
_INERT = {"install": Component.install, "uninstall": Component.uninstall, "poll": Component.poll,
          "step_hook": Component.step_hook, "on_step": Component.on_step, "collect": Component.collect,
          "span_watermark_ns": Component.span_watermark_ns, "summary": Component.summary}  # fmt: skip


def inert(cls: type[Component]) -> type[Component]:
    """``cls`` that installs nothing and polls nothing: its state is what the test sets."""
    return type(f"Inert{cls.__name__}", (cls,), dict(_INERT))


def Fake(name: str, **state: Any) -> Any:
    """The real collector of ``name`` (never installed: no hooks) holding ``state``, the fields a detector
    reads. Each must be a field the collector has: a renamed field fails here, not silently."""
    comp = inert(_REAL[name])()
    unknown = sorted(k for k in state if not hasattr(comp, k))
    assert not unknown, f"{_REAL[name].__name__} has no field {unknown}"
    comp.__dict__.update(state)
    return comp


def make_agent(tmp_path: Any, rank: int = 0, world: int = 1, comps: tuple[Component, ...] = (), exchange: Exchange | None = None,
               coords: dict[str, int] | None = None, model: Any = None, **thresholds: float) -> tuple[Agent, DetectorsComponent]:  # fmt: skip
    """An agent wired by hand (no thread, no endpoint) so several fake ranks can live in one process."""
    agent = Agent(model, metrics_port=-1, traces="none", run_dir=str(tmp_path / f"r{rank}"), thresholds=thresholds)
    c = coords or {}
    agent.topology = Topology(rank=rank, world_size=world, job_id="job", dp=c.get("dpn", 1), dp_rank=c.get("dp", 0),
                              tp_rank=c.get("tp", 0), pp_rank=c.get("pp", 0), pp_stage=c.get("pp", 0))  # fmt: skip
    agent.families = Families([str(rank), str(c.get("pp", 0))])
    agent.run_dir = str(tmp_path / f"r{rank}")
    os.makedirs(agent.run_dir, exist_ok=True)
    from hpar_agent.events import EventLog

    agent.events = EventLog(os.path.join(agent.run_dir, f"events.rank{rank}.jsonl"), rank)
    for comp in comps:
        agent.add_component(comp)
    det = DetectorsComponent(exchange=exchange)
    agent.add_component(det)
    return agent, det


def sample(det: DetectorsComponent, metric: str, alert: str) -> float:
    for fam in det.collect():
        for s in fam.samples:
            if s.name == metric and s.labels["alert"] == alert:
                return s.value
    raise AssertionError(f"{metric}{{alert={alert}}} not exported")


def alert_events(agent: Agent) -> list[dict]:
    with open(agent.events.path or "", encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r["kind"] == "alert"]


def steps(total: int, last_ts: float | None = None) -> Fake:
    return Fake("steps", total=total, last_step_ts=time.time() if last_ts is None else last_ts, durations=[0.3] * 8)


# ------------------------------------------------------------------------------------------ outputs
def test_every_alert_exported_from_the_start_and_clean_loop_is_quiet(tmp_path: Any) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = Agent(model, optimizer=opt, metrics_port=-1, traces="none", run_dir=str(tmp_path), trace_every=0)
    try:
        agent.start()
        agent.tick()
        for name in cat.ALERT_NAMES:
            labels = {"rank": "0", "pp_stage": "0", "alert": name}
            assert agent.registry.get_sample_value("hpar_alert_active", labels) == 0.0
            assert agent.registry.get_sample_value("hpar_alerts_total", labels) == 0.0
        det = agent.component("detectors")
        assert isinstance(det, DetectorsComponent) and det is agent.components[-1]
        for _ in range(6):  # a clean loop with the real collectors: no alert, no detector error
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.tick()
        assert agent.errors.get("detectors", 0) == 0
        assert not any(s["active"] for s in det.summary().values())
    finally:
        agent.stop()


def test_memory_leak_fires_with_evidence_then_resolves(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
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
    assert [(e["alert"], e["state"], e["rank"], e["pp_stage"]) for e in fired] == [("MemoryLeak", "firing", 0, 0)]
    txt = [p for p in fired[0]["evidence"] if p.endswith(".pyspy.txt")]
    assert txt, fired[0]["evidence"]
    assert stat.S_IMODE(os.stat(txt[0]).st_mode) == 0o600
    with open(txt[0], encoding="utf-8") as fh:
        assert "Thread" in fh.read()  # py-spy's dump of this very process
    rec = StepRecord(step=40, start_ns=0, end_ns=1)
    det.on_step(rec)
    assert rec.anomalous and rec.events[0][0] == cat.EVENT_ALERT and rec.events[0][2][cat.ATTR_ALERT] == "MemoryLeak"

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


def _run_memory(tmp_path: Any, series: dict[str, list[tuple[int, float]]], compiles: Any, steps_to: int) -> tuple[DetectorsComponent, list[int]]:
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
    for name, series in (("host", {"rss": host}), ("device", {"allocator": allocated}), ("stairs", {"reserved": reserved})):
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


def test_hang_default_timeout_is_not_a_checkpoint_pause(tmp_path: Any) -> None:
    agent, det = make_agent(tmp_path, comps=(steps(50, last_ts=time.time() - 40),))
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 0.0


def test_hang_on_collective_in_flight(tmp_path: Any) -> None:
    coll = Fake("collectives", oldest_age={"dp": 90.0, "tp": 0.0}, recent_entries=deque())
    agent, det = make_agent(tmp_path, comps=(steps(5), coll))
    agent.config.evidence = False
    agent.tick()
    assert sample(det, "hpar_alert_active", "Hang") == 1.0
    assert det.states["Hang"].details["pg"] == "dp"


def test_recompile_storm_and_cache_hit_ratio(tmp_path: Any) -> None:
    comp = Fake("compile", recompiles=Counter({"size": 3}), limit_hits=0, cache=Counter(), graph_breaks=Counter())
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
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 1.0 and st.details["mode"] == "cache_hit_ratio"
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
    comp = Fake("compile", recompiles=Counter({"int_value": 7}), limit_hits=0, cache=Counter(), graph_breaks=Counter())
    agent, det = make_agent(tmp_path, comps=(steps(10), comp))
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 0.0  # 7 recompiles: under 10
    comp.limit_hits = 1  # the 8th recompile was refused: the frame runs eager from now on
    agent.tick()
    assert sample(det, "hpar_alert_active", "RecompileStorm") == 1.0
    assert det.states["RecompileStorm"].details["limit_hits_in_window"] == 1


def test_graph_breaks_after_warmup_only(tmp_path: Any) -> None:
    comp = Fake("compile", graph_breaks=Counter({"gb0007": 2}), break_info={"gb0170": {"reason": "item()", "user_frames": {"model.py:12"}}})
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
        self.timed_ops, self.timed, self.recent_entries = deque(maxlen=2048), 0, deque(maxlen=2048)

    def op(self, seq: int, created_s: float, seconds: float, pg: str = "dp") -> None:
        self.timed_ops.append((pg, "all_reduce", seq, int(created_s * 1e9), seconds))
        self.timed += 1
        self.recent_entries.append({"pg": pg, "seq": seq, "op": "all_reduce", "is_p2p": False, "record_id": seq,
                                    "input_sizes": [[1024]], "input_dtypes": ["Float"], "time": created_s})


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


def _dp_pair(store: Any, tmp_path: Any, compile_state: dict[str, Any]) -> list[tuple[Agent, DetectorsComponent, TimedOps, Fake]]:
    out = []
    for r in range(2):
        coll, st = TimedOps(), steps(1)
        comp = Fake("compile", compiles=Counter(compile_state["compiles"]), _open=dict(compile_state["open"]),
                    compile_seconds=0.0, graphs=set(), fingerprint=7)
        agent, det = make_agent(tmp_path, rank=r, world=2, comps=(st, comp, coll), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 2}, **{"detectors.exchange_s": 0.0})  # fmt: skip
        agent.config.evidence = False
        out.append((agent, det, coll, st))
    return out


def _all_reduces(pair: list, first_seq: int, n: int, late_rank: int, skew_s: float, transfer_s: float) -> None:
    """n all-reduces of a dp pair as NCCL times them: every rank's duration runs from its kernel start to
    the end, so the rank that arrived first also times the wait for ``late_rank`` (``skew_s``)."""
    t0 = time.time()
    for i in range(n):
        seq, start = first_seq + i, t0 + 0.3 * i
        for r, (_agent, _det, coll, _st) in enumerate(pair):
            late = skew_s if r == late_rank else 0.0
            coll.op(seq, start + late, transfer_s + (skew_s - late))


def _tick(pair: list, times: int = 2) -> None:
    for _ in range(times):  # one round publishes, the next reads every peer's entries
        for agent, *_ in pair:
            agent.tick()


def test_collective_latency_ignores_peer_waits_in_compile_warmup_and_after(store: Any, tmp_path: Any) -> None:
    # The clean dp2 H200 run: rank 1 still compiling, rank 0's all-reduces wait for it (p99 0.22 s).
    pair = _dp_pair(store, tmp_path, {"compiles": {("ok", "x"): 1}, "open": {("1/0", "x"): (0, 0)}})
    _tick(pair, 1)
    _all_reduces(pair, 0, 40, late_rank=1, skew_s=0.22, transfer_s=0.003)
    _tick(pair)
    for _agent, det, _coll, st in pair:  # compiles end (seen at step 5); warm-up is over 3 quiet steps later
        det.context.find(CompileCollector)._open = {}  # type: ignore[union-attr]
        st.total = 5
    _tick(pair)
    assert not pair[0][1].warmed_up(3, 10)
    for *_, st in pair:
        st.total = 8
    _tick(pair)
    assert pair[0][1].warmed_up(3, 10)
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


# ------------------------------------------------------------------------------------------ evidence
def test_evidence_pyspy_json_and_rate_limit(tmp_path: Any) -> None:
    ev = Evidence(str(tmp_path), rank=3, min_interval_s=60)
    paths = ev.py_spy("Hang-1")
    assert sorted(p.rsplit(".", 2)[-2:][1] for p in paths) == ["json", "txt"]
    for p in paths:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and ".rank3." in p
    with open(next(p for p in paths if p.endswith(".json")), encoding="utf-8") as fh:
        assert any(t.get("frames") for t in json.load(fh))
    assert stat.S_IMODE(os.stat(tmp_path / "evidence").st_mode) == 0o700
    assert ev.py_spy("Hang-2") == []  # rate-limited
    assert ev.allocator_snapshot("x") == []  # no CUDA history started on CPU


def _spin_for_profile(stop: Any) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_evidence_pyspy_record_profile_is_bounded_and_never_waited_on(tmp_path: Any) -> None:
    import threading

    stop = threading.Event()
    busy = threading.Thread(target=_spin_for_profile, args=(stop,), daemon=True)
    busy.start()
    try:
        ev = Evidence(str(tmp_path), rank=2, min_interval_s=60)
        t0 = time.monotonic()
        (path,) = ev.collect("MemoryLeak-1", MemoryLeak.evidence)[-1:]  # the profile comes last
        assert time.monotonic() - t0 < 1.5  # the 1-5 s recording is not waited for
        assert path.endswith(".profile.speedscope.json") and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.path.getsize(path) > 0 and ev.recording is not None  # a placeholder until py-spy is done
        ev.recording.join(30)
        with open(path, encoding="utf-8") as fh:
            prof = json.load(fh)
        names = {f["name"] for f in prof["shared"]["frames"]}
        assert "_spin_for_profile" in names and prof["profiles"]
        assert ev.py_spy_record("MemoryLeak-2", seconds=1) == []  # rate-limited
    finally:
        stop.set()


def test_evidence_fr_dump_and_missing_pyspy(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ev = Evidence(str(tmp_path), rank=0)
    paths = ev.fr_dump("CollectiveMismatch-1")
    assert paths and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    with open(paths[0], encoding="utf-8") as fh:
        assert "version" in json.load(fh)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("hpar_agent.evidence._beside_python", lambda name: None)
    caplog.set_level(logging.WARNING, logger="hpar_agent")
    assert Evidence(str(tmp_path / "b"), rank=0).py_spy("Hang-1") == []
    assert any("py-spy not found" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------ cross-rank
@pytest.fixture
def store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_compile_divergence_attributed_to_minority(store: Any, tmp_path: Any) -> None:
    ranks = []
    for r in range(3):
        comp = Fake("compile", fingerprint=111 if r != 2 else 222)
        ranks.append(make_agent(tmp_path, rank=r, world=3, comps=(steps(10), comp), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 3}, **{"detectors.exchange_s": 0.0}))  # fmt: skip
    for _ in range(3):  # round 1 publishes; two confirmations follow
        for agent, _det in ranks:
            agent.tick()
    actives = [sample(det, "hpar_alert_active", "CompileDivergence") for _, det in ranks]
    assert actives == [0.0, 0.0, 1.0]
    assert sample(ranks[2][1], "hpar_detector_value", "CompileDivergence") == 2.0
    assert ranks[2][1].states["CompileDivergence"].fired == 1 and CompileDivergence.confirm == 2


def test_compile_divergence_waits_for_every_rank_of_the_stage(store: Any, tmp_path: Any) -> None:
    # the CPU fault matrix once named clean rank 1: it judged with only its own and the odd rank's
    # fingerprints published, a 1-1 split that blames both
    ranks = []
    for r in range(4):
        comp = Fake("compile", fingerprint=111 if r != 3 else 222)
        ranks.append(make_agent(tmp_path, rank=r, world=4, comps=(steps(10), comp), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 4}, **{"detectors.exchange_s": 0.0}))  # fmt: skip
    for _ in range(3):  # ranks 0 and 2 have not published yet
        for r in (1, 3):
            ranks[r][0].tick()
    assert [ranks[r][1].states["CompileDivergence"].fired for r in (1, 3)] == [0, 0]
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    assert [sample(det, "hpar_alert_active", "CompileDivergence") for _, det in ranks] == [0.0, 0.0, 0.0, 1.0]
    assert ranks[1][1].states["CompileDivergence"].fired == 0


def test_replica_divergence_dp_group(store: Any, tmp_path: Any) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ranks = []
    for r in range(3):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        model.load_state_dict(base.state_dict())
        if r == 1:
            with torch.no_grad():
                model[1].weight.add_(1e-3)  # a block that missed its gradient all-reduce
        ranks.append(make_agent(tmp_path, rank=r, world=3, comps=(steps(10),), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 3}, model=model, **{"detectors.exchange_s": 0.0}))  # fmt: skip
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
    assert all(any("/x/ck/" in k for k in det.exchange._seen) for _, det in ranks)  # digests differed: fetched


def test_replica_divergence_in_sync_compares_digests_only(store: Any, tmp_path: Any) -> None:
    """Replicas in sync agree on their checksum digests (in the small ``s`` blob): nobody fetches the
    checksums by name, and the comparison still counts as made."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ranks = []
    for r in range(3):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        model.load_state_dict(base.state_dict())
        ranks.append(make_agent(tmp_path, rank=r, world=3, comps=(steps(10),), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 3}, model=model, **{"detectors.exchange_s": 0.0}))  # fmt: skip
    for _agent, det in ranks:
        det.step_hook(10, 0)
    for _ in range(2):
        for agent, _det in ranks:
            agent.tick()
    for agent, det in ranks:
        assert agent.errors == {} and det.peers_fresh
        verdict = det.detector(ReplicaDivergence).evaluate(det)
        assert verdict is not None and not verdict.active and verdict.value == 0.0
        assert not any("/x/ck/" in k for k in det.exchange._seen)
        assert set(det.peers[1 - min(det.rank, 1)]["cd"]) == {"10"}


def test_collective_mismatch_and_straggler_through_store(store: Any, tmp_path: Any) -> None:
    step = 300_000_000
    ranks = []
    for r in range(3):
        entries = deque(
            {"pg": "dp", "seq": i, "op": "all_reduce", "is_p2p": False, "input_sizes": [[4]],
             "input_dtypes": ["BFloat16" if (r == 0 and i == 7) else "Float"],
             "time": ((i // 4) * step + i * 1_000_000 + (80_000_000 if r == 2 else 0)) / 1e9}
            for i in range(40)
        )  # fmt: skip
        coll = Fake("collectives", recent_entries=entries)
        ranks.append(make_agent(tmp_path, rank=r, world=3, comps=(steps(10), coll), exchange=Exchange(store, "job", r),
                                coords={"dp": r, "dpn": 3}, **{"detectors.exchange_s": 0.0}))  # fmt: skip
    for agent, _det in ranks:
        agent.config.evidence = False
    for _ in range(3):
        for agent, _det in ranks:
            agent.tick()
    assert [sample(d, "hpar_alert_active", "CollectiveMismatch") for _, d in ranks] == [1.0, 0.0, 0.0]
    assert ranks[0][1].states["CollectiveMismatch"].details["mismatched"][0]["seq"] == 7
    assert [sample(d, "hpar_alert_active", "Straggler") for _, d in ranks] == [0.0, 0.0, 1.0]
    assert sample(ranks[2][1], "hpar_detector_value", "Straggler") > 0.1


def history_probe(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, source: str,
                  n_steps: int) -> tuple[Any, Any, deque, list[str]]:
    """An agent whose memory series ``source`` the test fills, and the allocator-history starts/stops
    its evidence collector is asked for (recorded, not run)."""
    series: deque = deque(maxlen=64)
    agent, det = make_agent(tmp_path, comps=(steps(n_steps), Fake("memory", post_step={source: series})))
    calls: list[str] = []
    assert det.evidence is not None
    monkeypatch.setattr(det.evidence, "start_memory_history", lambda: calls.append("start") or True)
    monkeypatch.setattr(det.evidence, "stop_memory_history", lambda: calls.append("stop"))
    return agent, det, series, calls


def test_allocator_history_runs_only_while_a_leak_is_suspected(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_allocator_history_is_not_restarted_after_the_leak_fired(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_every_component_parameter_is_a_valid_setting(tmp_path: Any) -> None:
    """``detectors.<param>`` settings the component reads are accepted by the config and applied."""
    from hpar_agent.thresholds import COMPONENT_DEFAULTS

    overrides = {f"detectors.{k}": v / 2 for k, v in COMPONENT_DEFAULTS.items()}
    _agent, det = make_agent(tmp_path, comps=(steps(1),), **overrides)
    for k, v in COMPONENT_DEFAULTS.items():
        assert getattr(det, k) == v / 2, k


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
        agent, det = make_agent(tmp_path, rank=r, world=2, comps=(st, comp, Fake("collectives", recent_entries=entries)),
                                exchange=Exchange(store, "job", r), coords={"dp": r, "dpn": 2},
                                **{"detectors.exchange_s": 0.0})  # fmt: skip
        agent.config.evidence = False
        ranks.append((agent, det, entries, comp, st))

    def ops(first: int, n: int, start: float, late_s: float) -> None:
        for i in range(first, first + n):  # 4 all-reduces per 0.3 s step, rank 1 late by late_s
            t = start + (i - first) // 4 * 0.3 + (i % 4) * 0.001
            for r, (*_, entries, _comp, _st) in enumerate(ranks):
                entries.append({"pg": "dp", "seq": i, "op": "all_reduce", "is_p2p": False, "input_sizes": [[4]],
                                "input_dtypes": ["Float"], "time": t + (late_s if r == 1 else 0.0), "record_id": i})

    ranks[1][3].compiles[("ok", "x")] += 1  # rank 1 compiles at its step 4
    for *_, st in ranks:
        st.total = 4
    ops(0, 40, t0, 0.2)
    for _ in range(3):
        for agent, *_ in ranks:
            agent.tick()
    assert not ranks[1][1].warmed_up(3, 10)
    assert [d.states["Straggler"].fired for _a, d, *_ in ranks] == [0, 0]
    for *_, st in ranks:  # compiles quiet for 4 steps; the lag goes on: rank 1 is a straggler now
        st.total = 8
    for agent, *_ in ranks:
        agent.tick()
    ops(40, 40, time.time(), 0.2)
    for _ in range(3):
        for agent, *_ in ranks:
            agent.tick()
    assert [d.states["Straggler"].active for _a, d, *_ in ranks] == [False, True]


def test_the_store_client_the_agent_opened_is_dropped_on_detach(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from hpar_agent.detectors import component as comp_mod

    store = dist.HashStore()
    monkeypatch.setattr(comp_mod, "open_store", lambda: store)
    agent, det = make_agent(tmp_path, rank=0, world=2, comps=(steps(3),))
    agent.tick()
    assert det.exchange is not None and det.exchange.store is store  # opened by the agent itself
    det.uninstall()
    assert det.exchange is None
    given = Exchange(store, "job", 0)
    _agent2, det2 = make_agent(tmp_path / "b", exchange=given)
    det2.uninstall()
    assert det2.exchange is given  # a caller's exchange stays the caller's
