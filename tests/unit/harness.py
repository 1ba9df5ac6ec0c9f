"""Agents wired by hand for detector tests: real components holding the state a test gives them, and
several fake ranks in one process (the ``store`` fixture in conftest gives them a real TCPStore)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any

from hpar_agent.agent import Agent
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.memory import MemoryCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.crossrank import Exchange
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.families import Families
from hpar_agent.topology import Topology

_REAL: dict[str, type[Component]] = {
    "steps": StepCollector,
    "compile": CompileCollector,
    "memory": MemoryCollector,
    "collectives": CollectiveCollector,
}


_INERT = {
    "install": Component.install,
    "uninstall": Component.uninstall,
    "poll": Component.poll,
    "step_hook": Component.step_hook,
    "on_step": Component.on_step,
    "collect": Component.collect,
    "span_watermark_ns": Component.span_watermark_ns,
    "summary": Component.summary,
}


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


def make_agent(
    tmp_path: Any,
    rank: int = 0,
    world: int = 1,
    comps: tuple[Component, ...] = (),
    exchange: Exchange | None = None,
    coords: dict[str, int] | None = None,
    model: Any = None,
    **thresholds: float,
) -> tuple[Agent, DetectorsComponent]:
    """An agent wired by hand (no thread, no endpoint) so several fake ranks can live in one process."""
    agent = Agent(
        model, metrics_port=-1, traces="none", run_dir=str(tmp_path / f"r{rank}"), thresholds=thresholds
    )
    c = coords or {}
    agent.topology = Topology(
        rank=rank,
        world_size=world,
        job_id="job",
        dp=c.get("dpn", 1),
        dp_rank=c.get("dp", 0),
        tp_rank=c.get("tp", 0),
        pp_rank=c.get("pp", 0),
        pp_stage=c.get("pp", 0),
    )
    agent.families = Families([str(rank), str(c.get("pp", 0))])
    agent.outputs.run_dir = str(tmp_path / f"r{rank}")
    os.makedirs(agent.run_dir, exist_ok=True)
    from hpar_agent.events import EventLog

    agent.outputs.events = EventLog(os.path.join(agent.run_dir, f"events.rank{rank}.jsonl"), rank)
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
    return Fake(
        "steps", total=total, last_step_ts=time.time() if last_ts is None else last_ts, durations=[0.3] * 8
    )


def dp_all_reduces(t0_ns: int, shift_ns: int = 0, bf16_at: int = -1, n: int = 80) -> deque:
    """A rank's flight-recorder entries of ``n`` dp all-reduces, 4 a 0.3 s step from ``t0_ns``, each
    ``shift_ns`` late (early, below 0); all-reduce ``bf16_at`` in bf16."""
    step = 300_000_000
    return deque(
        {
            "pg": "dp",
            "seq": i,
            "op": "all_reduce",
            "is_p2p": False,
            "input_sizes": [[4]],
            "input_dtypes": ["BFloat16" if i == bf16_at else "Float"],
            "time": (t0_ns + (i // 4) * step + i * 1_000_000 + shift_ns) / 1e9,
        }
        for i in range(n)
    )
