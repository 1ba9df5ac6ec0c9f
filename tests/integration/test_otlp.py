"""OTLP over HTTP and gRPC into a real receiver; endpoint down or slow never stalls or hangs the agent."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import hpar_agent
from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.exporters.otel import Tracing
from hpar_agent.spans import SpanRecord, StepRecord
from hpar_agent.topology import Topology
from hpar_agent.traceids import step_span_id, trace_id
from testkit.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan

pytestmark = pytest.mark.integration

JOB = "job-otlp"
MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000
_OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_SCHEDULE_DELAY",
)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for var in (*_OTEL_VARS, *cat.RESOURCE_ENV):
        monkeypatch.delenv(var, raising=False)


def _rank_agent(tmp_path, rank: int, stage: int) -> Agent:
    """An unstarted Agent standing for one rank of a 2-stage job (config and topology only)."""
    agent = Agent(metrics_port=-1, run_dir=str(tmp_path), trace_every=1)
    agent.topology = Topology(
        rank=rank, world_size=2, job_id=JOB, host="node0", pp=2, pp_rank=stage, pp_stage=stage
    )
    agent.outputs.run_dir = str(tmp_path)
    return agent


def _step(step: int, rank: int) -> StepRecord:
    start = T0 + step * 1000 * MS + rank * MS
    kids = [
        SpanRecord(cat.SPAN_PP_FORWARD, start + 2 * MS, start + 9 * MS, step, {cat.ATTR_MICROBATCH: 0}),
        SpanRecord(
            cat.SPAN_COLLECTIVE_PREFIX + "all_reduce",
            start + 10 * MS,
            start + 12 * MS,
            step,
            {cat.ATTR_PG: "dp", cat.ATTR_OP: "all_reduce"},
        ),
    ]
    return StepRecord(step=step, start_ns=start, end_ns=start + 50 * MS, children=kids)


def _check_two_rank_traces(spans: list[ReceivedSpan], steps: range) -> None:
    assert len(spans) == 2 * 3 * len(steps)
    for step in steps:
        mine = [s for s in spans if s.attributes[cat.ATTR_STEP] == step]
        assert {s.trace_id for s in mine} == {trace_id(JOB, step)}  # one trace per step, both ranks
        roots = [s for s in mine if s.parent_span_id == 0]
        assert [(r.name, r.span_id, r.attributes[cat.ATTR_RANK]) for r in roots] == [
            (cat.SPAN_STEP, step_span_id(JOB, step, 0), 0)
        ]
        step1 = next(s for s in mine if s.name == cat.SPAN_STEP and s.attributes[cat.ATTR_RANK] == 1)
        assert step1.parent_span_id == roots[0].span_id
        assert step1.span_id == step_span_id(JOB, step, 1)
        for s in mine:
            rank = s.attributes[cat.ATTR_RANK]
            assert s.attributes[cat.ATTR_PP_STAGE] == rank  # rank r is stage r here
            assert s.resource["service.name"] == cat.SERVICE_NAME_DEFAULT
            assert s.resource["service.instance.id"] == f"{JOB}-{rank}"
            assert s.resource["host.name"] == "node0" and s.resource["process.pid"] == os.getpid()
            assert s.resource[cat.ATTR_RANK] == rank and s.resource[cat.RES_PP] == 2
            if s.name != cat.SPAN_STEP:
                assert s.parent_span_id == step_span_id(JOB, step, rank)
        coll = [s for s in mine if s.name == "collective.all_reduce"]
        assert len(coll) == 2 and all(s.attributes[cat.ATTR_PG] == "dp" for s in coll)


def _export_two_ranks(tmp_path: Any, rx: Any, kind: str) -> None:
    """Two ranks' tracings export 3 steps each into ``rx``; the traces must join up there."""
    tracings = [Tracing(_rank_agent(tmp_path, r, r).context) for r in (0, 1)]
    assert [t.kind for t in tracings] == [kind, kind]
    for step in range(3):
        for r, t in enumerate(tracings):
            t.export_step(_step(step, r))
    for t in tracings:
        t.shutdown(5.0)
    spans = rx.wait_for(18)
    assert all(t.dropped == 0 for t in tracings)
    _check_two_rank_traces(spans, range(3))


def test_http_protobuf_two_ranks_one_trace(tmp_path, monkeypatch):
    with HttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.base_endpoint)  # SDK appends /v1/traces
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
        _export_two_ranks(tmp_path, rx, "otlp-http")


def test_grpc_two_ranks_one_trace(tmp_path, monkeypatch):
    with GrpcReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        _export_two_ranks(tmp_path, rx, "otlp-grpc")


def test_resource_carries_the_pod_and_slurm_identity(tmp_path, monkeypatch):
    """The downward API's K8S_* variables and Slurm's job id reach the receiver on the Resource, under
    the semantic conventions' names; OTEL_RESOURCE_ATTRIBUTES wins where it names the same key."""
    env = {
        "K8S_POD_NAME": "hpar-trainer-0-x7k2p",
        "K8S_NAMESPACE_NAME": "ml",
        "K8S_NODE_NAME": "gpu-7",
        "SLURM_JOB_ID": "81234",
        "OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=ml-prod,team=llm",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with HttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        t = Tracing(_rank_agent(tmp_path, 1, 1).context)
        t.export_step(_step(0, 1))
        t.shutdown(5.0)
        spans = rx.wait_for(3)
    for s in spans:
        assert s.resource["k8s.pod.name"] == "hpar-trainer-0-x7k2p" and s.resource["k8s.node.name"] == "gpu-7"
        assert s.resource["k8s.namespace.name"] == "ml-prod" and s.resource["team"] == "llm"
        assert s.resource["hpar.slurm.job.id"] == "81234"
        assert s.resource["service.instance.id"] == f"{JOB}-1" and s.resource["process.pid"] == os.getpid()


def test_attached_agent_exports_its_steps(tmp_path, monkeypatch):
    """The whole path: optimizer steps -> agent thread -> OTLP/HTTP, service name from OTEL env."""
    with HttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-pretrain")
        agent = hpar_agent.attach(metrics_port=-1, run_dir=str(tmp_path), trace_every=2, job_id=JOB)
        try:
            model = torch.nn.Linear(2, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(4):
                model(torch.randn(1, 2)).sum().backward()
                opt.step()
            agent.tick()
        finally:
            hpar_agent.detach()  # flushes the tracing within its bound
        spans = rx.wait_for(2)
    steps = sorted(s.attributes[cat.ATTR_STEP] for s in spans if s.name == cat.SPAN_STEP)
    assert {0, 2} <= set(steps)
    for s in spans:
        assert s.trace_id == trace_id(JOB, s.attributes[cat.ATTR_STEP])
        assert s.resource["service.name"] == "llm-pretrain"


@pytest.mark.parametrize(("receiver_cls", "mode"), [(HttpReceiver, "down"), (GrpcReceiver, "slow")])
def test_endpoint_down_or_slow_never_blocks(tmp_path, monkeypatch, receiver_cls, mode):
    with receiver_cls(delay=3.0) as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        if receiver_cls is GrpcReceiver:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
        monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        rx.set_mode(mode)
        t = Tracing(_rank_agent(tmp_path, 0, 0).context)
        assert t.max_queue_size == 64
        n_steps, worst_call, worst_in_flight = 300, 0.0, 0
        for step in range(n_steps):
            t0 = time.perf_counter()
            t.export_step(_step(step, 0))
            worst_call = max(worst_call, time.perf_counter() - t0)
            worst_in_flight = max(worst_in_flight, t.in_flight)
        # no call waited for the exporter (whose every attempt takes its 1 s timeout)
        assert worst_call < 1.0
        assert worst_in_flight <= 64  # memory bounded by the queue
        created = t.spans_created
        assert created == 3 * n_steps
        assert t.dropped >= created - 2 * 64  # at most a queue plus one batch were still in play
        t0 = time.monotonic()
        t.shutdown(1.0)
        assert time.monotonic() - t0 < 3.0  # exit never hangs on the endpoint
        assert t.dropped == created  # nothing reached the endpoint with a success
