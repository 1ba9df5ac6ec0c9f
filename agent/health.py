"""What the agent reports about itself on this rank: its health families on the metrics endpoint (rank
info, the MFU inputs, per-component errors, up and collect time, dropped buffer entries and spans),
the registry's one collector, and the summary file the demo and the run report read.

It reads the agent through ``HealthSource`` rather than importing ``hpar_agent.agent``, which imports
this module."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent._version import __version__
from hpar_agent.collectors.memory import NvmlCollector
from hpar_agent.component import Component
from hpar_agent.context import AgentContext
from hpar_agent.exporters.endpoint_audit import REASONS
from hpar_agent.families import Families
from hpar_agent.safefiles import write_atomic
from hpar_agent.topology import Topology


class HealthSource(Protocol):
    """What the health families and the summary read of the agent."""

    families: Families
    topology: Topology
    components: list[Component]
    errors: Counter[str]
    flops_per_token: float | None
    peak_flops: float | None

    @property
    def collect_seconds(self) -> dict[str, float]: ...

    @property
    def tracing(self) -> Any: ...

    @property
    def server(self) -> Any: ...

    @property
    def metrics_url(self) -> str | None: ...

    @property
    def run_dir(self) -> str: ...

    @property
    def context(self) -> AgentContext: ...

    def record_error(self, component: str, exc: BaseException) -> None: ...


def health_metrics(agent: HealthSource) -> Iterable[Metric]:
    """The agent's own families: what it is, what it is sure of, and what it failed or dropped."""
    f = agent.families
    topo = agent.topology
    info = topo.info_labels()
    info["agent_version"] = __version__
    nvml = agent.context.find(NvmlCollector)
    info["gpu_index"] = nvml.gpu_index if nvml is not None else ""
    info["gpu_uuid"] = nvml.gpu_uuid if nvml is not None else ""
    binding = nvml.binding if nvml is not None else None
    if binding is not None:
        info.update(binding.labels())  # NUMA node and CPU affinity against the GPU's ideal CPUs
    yield f.info("hpar_rank_info", info)
    for name, value in (
        ("hpar_model_flops_per_token", agent.flops_per_token),
        ("hpar_peak_flops", agent.peak_flops),
    ):
        if value is not None:
            g = f.gauge(name)
            f.add(g, [], value)
            yield g
    errors = f.counter("hpar_agent_errors_total")
    up = f.gauge("hpar_agent_component_up")
    took = f.gauge("hpar_agent_collect_duration_seconds")
    names = sorted({c.name for c in agent.components} | set(agent.errors) | {"agent"})
    comps = {c.name: c for c in agent.components}
    for name in names:
        f.add(errors, [name], agent.errors.get(name, 0))
        f.add(up, [name], 1.0 if comps.get(name) is None or comps[name].up else 0.0)
        if name in agent.collect_seconds:
            f.add(took, [name], agent.collect_seconds[name])
    yield errors
    yield up
    yield took
    drops = f.counter("hpar_agent_buffer_dropped_total")
    for comp in agent.components:
        for buf in getattr(comp, "buffers", ()):
            f.add(drops, [buf.name], buf.dropped)
    yield drops
    spans_dropped = f.counter("hpar_agent_spans_dropped_total")
    f.add(spans_dropped, [], getattr(agent.tracing, "dropped", 0))
    yield spans_dropped
    yield from endpoint_metrics(agent)


def endpoint_metrics(agent: HealthSource) -> Iterable[Metric]:
    """The endpoint's audit: refused clients by reason, evicted and timed-out connections (none
    without an endpoint)."""
    server = agent.server
    if server is None:
        return
    f = agent.families
    refused = f.counter("hpar_endpoint_auth_failures_total")
    failures = dict(server.auth_failures)
    for reason in REASONS:
        f.add(refused, [reason], failures.get(reason, 0))
    yield refused
    for name, value in (
        ("hpar_endpoint_connections_evicted_total", server.evicted),
        ("hpar_endpoint_connections_timed_out_total", server.timed_out),
    ):
        fam = f.counter(name)
        f.add(fam, [], value)
        yield fam


class AgentCollector:
    """The registry's single collector: the agent's health plus every component's families."""

    def __init__(self, agent: HealthSource) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Metric]:
        agent = self.agent
        yield from health_metrics(agent)
        for comp in agent.components:
            try:
                yield from list(comp.collect())
            except Exception as exc:
                agent.record_error(comp.name, exc)

    def describe(self) -> Iterable[Metric]:
        """Every catalogued family, without samples: the registry learns the names this collector
        owns, so a second collector exporting one of them fails to register (prometheus_client's
        duplicate check) instead of producing a second copy of the series."""
        return [self.agent.families.empty(m.name) for m in cat.METRICS]


def summary(agent: HealthSource) -> dict[str, Any]:
    """Everything the demo and the run report show for this rank (``Agent.summary``)."""
    comps = {}
    for comp in agent.components:
        try:
            comps[comp.name] = comp.summary()
        except Exception as exc:
            agent.record_error(comp.name, exc)
    return {
        "rank": agent.topology.rank,
        "pp_stage": agent.topology.pp_stage,
        "topology": agent.topology.info_labels(),
        "metrics_url": agent.metrics_url,
        "run_dir": agent.run_dir,
        "errors": dict(agent.errors),
        "components": comps,
    }


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None: the summary is strict JSON, which the
    offline tools require (a NaN step time must read as missing, never as a number)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_summary(agent: HealthSource) -> None:
    """``summary.rank<R>.json`` in the run directory, replaced whole (read by ``hpar-agent demo``)."""
    if not agent.run_dir:
        return
    path = os.path.join(agent.run_dir, f"summary.rank{agent.topology.rank}.json")
    try:
        text = json.dumps(finite(summary(agent)), indent=1, default=str, allow_nan=False)
        write_atomic(path, text.encode())
    except Exception as exc:  # a full disk keeps the previous summary whole
        agent.record_error("agent", exc)
