"""A verdict's culprits with their GPU health against their peers' median (``details.culprit_gpu``).

This machine has no GPU: the health comes from the health collector driven by a fake ``pynvml``
(``tests/unit/test_gpu_health.py``'s; a throttle cannot be caused on a real GPU here), and the peers'
from payloads as the exchange reads them. The real NVML reads are checked by ``tests/gpu/test_health.py``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
import torch

from hpar_agent.agent import Agent
from hpar_agent.collectors.gpu_health import GpuHealthCollector
from hpar_agent.collectors.memory import NvmlCollector
from hpar_agent.crossrank import Exchange
from hpar_agent.detectors.base import Verdict
from hpar_agent.detectors.cluster import CollectiveMismatch, Straggler
from hpar_agent.detectors.component import payload
from hpar_agent.detectors.snapshot import PeerView, Snapshot
from hpar_agent.tools.culprits import culprit_lines
from hpar_agent.topology import Topology
from tests.unit.harness import alert_events, inert, make_agent, steps
from tests.unit.test_gpu_health import FakeNvml

SINCE = time.mktime((2026, 12, 6, 14, 2, 11, 0, 0, -1))


def _gh(sm: float, throttled: bool = False, temp: float = 60.0) -> dict[str, Any]:
    out: dict[str, Any] = {"g": "0", "sm": sm, "smx": 1980, "tc": temp, "w": 690, "wl": 700}
    if throttled:
        out["th"] = {"hw_slowdown": SINCE}
    return out


@pytest.fixture
def agent(tmp_path: Any) -> Any:
    a = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    a.start()
    try:
        yield a
    finally:
        a.stop()


def _snap(peers: dict[int, dict[str, Any]], rank: int = 0) -> Snapshot:
    view = PeerView(peers=peers, fresh=True)
    return Snapshot(now=time.time(), topology=Topology(rank=rank, world_size=8), coords={}, exchange=view)


def _fire(agent: Agent, verdict_details: dict[str, Any], snap: Snapshot, cls: type = Straggler) -> Any:
    det = agent.component("detectors")
    d = det.detector(cls)
    for _ in range(d.confirm):
        det.book.update(d, Verdict(True, 0.4, dict(verdict_details)), snap)
    return det.states[d.name]


def test_each_rank_publishes_its_gpus_health_read_through_the_feed(agent: Agent, monkeypatch: Any) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    agent.device = agent.context.device = torch.device("cuda", 1)
    old = agent.component("gpu_health")
    old.uninstall()
    agent.components.remove(old)
    agent.add_component(GpuHealthCollector(nvml=FakeNvml()))
    agent.tick()
    agent.component("nvml").values = {
        "throttle": {"hw_slowdown": 1, "gpu_idle": 0},
        "clocks": {"sm": 1410e6},
        "temperature": 87.0,
        "power": 402.5,
    }
    agent.tick()
    det = agent.component("detectors")
    snap = det.feed.snapshot(agent.context, time.time())
    gh = payload(snap, det.detectors)["s"]["gh"]
    assert gh["g"] == "1" and gh["sm"] == 1410 and gh["smx"] == 1980 and gh["wl"] == 700
    assert gh["tc"] == 87 and gh["w"] == 402 and set(gh["th"]) == {"hw_slowdown"}
    assert len(json.dumps(gh, separators=(",", ":"))) < 160  # a handful of numbers (docs/capacity.md)


def test_a_straggler_verdict_carries_its_culprits_throttled_gpu_against_the_median(
    agent: Agent, caplog: Any
) -> None:
    peers = {r: {"gh": _gh(1980 - r)} for r in range(8)}
    peers[5] = {"gh": _gh(1410, throttled=True, temp=91)}
    caplog.set_level(logging.INFO, logger="hpar_agent")
    st = _fire(agent, {"culprits": [5], "victims": [0, 1]}, _snap(peers, rank=5))
    assert st.active
    got = st.details["culprit_gpu"]["5"]
    assert got["health"]["sm_mhz"] == 1410 and got["health"]["throttles"] == {"hw_slowdown": SINCE}
    assert got["peers_median"]["sm_mhz"] == 1977.0 and got["peers_median"]["ranks"] == 7  # 5 left out
    assert got["line"] == (
        "rank 5: hw_slowdown since 14:02:11, SM clock 1,410 MHz against 1,977 (peers' median), 91 C against 60"
    )
    assert got["line"] in caplog.text  # the firing line quotes it
    lines = culprit_lines(
        [
            {
                "kind": "alert",
                "state": "firing",
                "alert": "Straggler",
                "rank": 5,
                "ts": 1.0,
                "details": st.details,
            }
        ]
    )
    assert lines[0].startswith("  culprit: rank 5 (Straggler")
    assert lines[1] == f"    {got['line']}"  # hpar-agent run's closing lines and the report's Culprits


def test_no_gpu_health_known_means_no_culprit_gpu_key(agent: Agent) -> None:
    """CPU hosts publish no health: the verdict's details are the detector's own."""
    peers: dict[int, dict[str, Any]] = {r: {"step": 10} for r in range(4)}
    st = _fire(agent, {"culprits": [2]}, _snap(peers))
    assert st.active and "culprit_gpu" not in st.details
    assert culprit_lines(
        [
            {
                "kind": "alert",
                "state": "firing",
                "alert": "Straggler",
                "rank": 0,
                "ts": 1.0,
                "details": st.details,
            }
        ]
    ) == ["  culprit: rank 2 (Straggler; raised on rank 0)"]


def test_only_detectors_whose_culprits_a_gpu_can_cause_get_it(agent: Agent) -> None:
    peers = {r: {"gh": _gh(1980, throttled=r == 3)} for r in range(4)}
    st = _fire(agent, {"culprits": [3]}, _snap(peers), cls=CollectiveMismatch)
    assert st.active and "culprit_gpu" not in st.details  # a mismatched collective is the program's


def _gpu(throttled: bool) -> tuple[Any, Any]:
    """This rank's health and NVML collectors holding a reading (never installed: no NVML call)."""
    health = inert(GpuHealthCollector)()
    health.__dict__.update(
        up=True,
        gpu="3",
        values={"clock_max": {"sm": 1980e6}, "power_limit": 700.0},
        throttled_since={"hw_slowdown": SINCE} if throttled else {},
    )
    nvml = inert(NvmlCollector)()
    nvml.__dict__.update(values={"clocks": {"sm": (1410 if throttled else 1980) * 1e6}, "temperature": 60.0})
    return health, nvml


def test_the_health_travels_through_the_store_to_the_rank_that_judges(store: Any, tmp_path: Any) -> None:
    """Collector state -> snapshot -> ``s`` in the c10d store -> the peer's read -> the verdict's details."""
    ranks = [
        make_agent(
            tmp_path,
            rank=r,
            world=2,
            comps=(steps(10), *_gpu(throttled=r == 1)),
            exchange=Exchange(store, "job", r),
            coords={"dp": r, "dpn": 2},
        )
        for r in range(2)
    ]
    t0 = 3.0 * (time.time() // 3.0)
    for now in (t0, t0 + 1):  # publish, then read
        for _agent, det in ranks:
            det.poll(now)
    agent, det = ranks[0]
    assert det.snapshot.exchange.fresh and det.snapshot.exchange.peers[1]["gh"]["th"] == {
        "hw_slowdown": SINCE
    }
    d = det.detector(Straggler)
    for _ in range(d.confirm):
        det.book.update(d, Verdict(True, 0.4, {"culprits": [1]}), det.snapshot)
    (event,) = [e for e in alert_events(agent) if e["alert"] == "Straggler"]
    assert event["details"]["culprit_gpu"]["1"]["line"] == (
        "rank 1: hw_slowdown since 14:02:11, SM clock 1,410 MHz against 1,980 (peers' median)"
    )
