"""Tracing: one trace per step across ranks, parent/child links, sampling, drops, file mode, exemplars."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import hpar_agent
from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.exporters.otel import Tracing, parse_otlp_json_line
from hpar_agent.spans import SpanRecord, StepRecord
from hpar_agent.topology import Topology
from hpar_agent.traceids import step_span_id, trace_id, trace_id_hex

JOB = "job-test"
MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000


def _agent(tmp_path, rank: int = 0, stage: int = 0, **cfg) -> Agent:
    """An Agent that is not started (no hooks, no thread): just config, topology and run dir."""
    cfg.setdefault("metrics_port", -1)
    cfg.setdefault("run_dir", str(tmp_path))
    agent = Agent(**cfg)
    agent.topology = Topology(
        rank=rank,
        world_size=4,
        job_id=JOB,
        host="h",
        dp=2,
        pp=2,
        dp_rank=rank % 2,
        pp_rank=stage,
        pp_stage=stage,
    )
    agent.outputs.run_dir = str(tmp_path)
    return agent


@pytest.fixture
def tracings(tmp_path) -> Iterator[list[Tracing]]:
    made: list[Tracing] = []
    yield made
    for t in made:
        t.shutdown(2.0)


def _tracing(tmp_path, made, rank=0, stage=0, exporter=None, **cfg) -> tuple[Tracing, InMemorySpanExporter]:
    exp = exporter or InMemorySpanExporter()
    t = Tracing(_agent(tmp_path, rank, stage, **cfg).context, exp, schedule_delay_millis=60_000)
    made.append(t)
    return t, exp


def _step(step: int, dur_ms: float = 100, children: bool = True, **kw) -> StepRecord:
    start = T0 + step * 1000 * MS
    end = start + int(dur_ms * MS)
    kids = []
    if children:
        kids = [
            SpanRecord(cat.SPAN_PP_FORWARD, start + 1 * MS, start + 11 * MS, step, {cat.ATTR_MICROBATCH: 0}),
            SpanRecord(
                cat.SPAN_COLLECTIVE_PREFIX + "all_reduce",
                start + 20 * MS,
                start + 25 * MS,
                step,
                {cat.ATTR_PG: "dp", cat.ATTR_OP: "all_reduce", cat.ATTR_BYTES: 4096},
            ),
            SpanRecord(
                cat.SPAN_COMPILE,
                start + 30 * MS,
                start + 40 * MS,
                step,
                {cat.ATTR_COMPILE_ID: "0/1"},
                events=[(cat.EVENT_GRAPH_BREAK, start + 35 * MS, {cat.REASON: "gb0170"})],
            ),
        ]
    return StepRecord(step=step, start_ns=start, end_ns=end, children=kids, **kw)


def _spans(t: Tracing, exp: InMemorySpanExporter) -> list[ReadableSpan]:
    assert t.flush(5.0)
    return list(exp.get_finished_spans())


def test_step_trace_names_links_and_times(tmp_path, tracings):
    t, exp = _tracing(tmp_path, tracings, trace_every=1)
    rec = _step(3)
    assert t.export_step(rec)
    spans = _spans(t, exp)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {cat.SPAN_STEP, cat.SPAN_PP_FORWARD, "collective.all_reduce", cat.SPAN_COMPILE}
    root = by_name[cat.SPAN_STEP]
    assert root.parent is None
    assert root.context.trace_id == trace_id(JOB, 3)
    assert root.context.span_id == step_span_id(JOB, 3, 0)
    assert (root.start_time, root.end_time) == (rec.start_ns, rec.end_ns)
    for child_rec in rec.children:
        child = by_name[child_rec.name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert (child.start_time, child.end_time) == (child_rec.start_ns, child_rec.end_ns)
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
        for key, value in child_rec.attributes.items():
            assert child.attributes[key] == value
    for s in spans:  # the common attributes on every span
        assert (
            s.attributes[cat.ATTR_RANK],
            s.attributes[cat.ATTR_PP_STAGE],
            s.attributes[cat.ATTR_STEP],
        ) == (0, 0, 3)
    (event,) = by_name[cat.SPAN_COMPILE].events
    assert (event.name, event.timestamp, event.attributes[cat.REASON]) == (
        cat.EVENT_GRAPH_BREAK,
        rec.start_ns + 35 * MS,
        "gb0170",
    )
    assert root.attributes[cat.ATTR_TRACE_REASON] == "sampled"


def test_two_ranks_share_one_trace_rank0_is_root(tmp_path, tracings):
    t0, exp0 = _tracing(tmp_path, tracings, rank=0, stage=0, trace_every=1)
    t1, exp1 = _tracing(tmp_path, tracings, rank=1, stage=1, trace_every=1)
    for step in (0, 1):
        t0.export_step(_step(step))
        t1.export_step(_step(step))
    s0 = [s for s in _spans(t0, exp0) if s.name == cat.SPAN_STEP]
    s1 = [s for s in _spans(t1, exp1) if s.name == cat.SPAN_STEP]
    assert len(s0) == len(s1) == 2
    for a, b in zip(
        sorted(s0, key=lambda s: s.start_time), sorted(s1, key=lambda s: s.start_time), strict=True
    ):
        step = a.attributes[cat.ATTR_STEP]
        assert b.attributes[cat.ATTR_STEP] == step
        assert a.context.trace_id == b.context.trace_id == trace_id(JOB, step)
        assert a.parent is None
        assert b.parent is not None and b.parent.is_remote
        assert b.parent.span_id == a.context.span_id == step_span_id(JOB, step, 0)
        assert b.context.span_id == step_span_id(JOB, step, 1)
        assert b.attributes[cat.ATTR_RANK] == 1 and b.attributes[cat.ATTR_PP_STAGE] == 1
    # rank 1's children hang off rank 1's own step span
    kids1 = [s for s in exp1.get_finished_spans() if s.name != cat.SPAN_STEP]
    assert kids1 and {s.parent.span_id for s in kids1} <= {step_span_id(JOB, st, 1) for st in (0, 1)}


def test_sampling_every_nth_anomalous_and_slow(tmp_path, tracings):
    t, exp = _tracing(tmp_path, tracings, trace_every=5)
    kept = {}
    for step in range(12):
        rec = _step(step, dur_ms=100, children=False)
        if step == 7:
            rec.anomalous = True
        if step == 9:
            rec = _step(step, dur_ms=500, children=False)  # 5x the running median
        kept[step] = t.export_step(rec)
    # a child marked anomalous keeps its step too
    rec = _step(12, children=True)
    rec.children[0].anomalous = True
    kept[12] = t.export_step(rec)
    assert [s for s, k in kept.items() if k] == [0, 5, 7, 9, 10, 12]
    spans = _spans(t, exp)
    steps = sorted(s.attributes[cat.ATTR_STEP] for s in spans if s.name == cat.SPAN_STEP)
    assert steps == [0, 5, 7, 9, 10, 12]
    reasons = {
        s.attributes[cat.ATTR_STEP]: s.attributes[cat.ATTR_TRACE_REASON]
        for s in spans
        if s.name == cat.SPAN_STEP
    }
    assert reasons == {0: "sampled", 5: "sampled", 7: "anomalous", 9: "slow", 10: "sampled", 12: "anomalous"}
    # dropped steps create no spans at all
    assert len(spans) == 6 + len(rec.children)
    assert t.steps_skipped == 7


def test_resource_identity_and_otel_env(tmp_path, tracings, monkeypatch):
    for var in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", *cat.RESOURCE_ENV):
        monkeypatch.delenv(var, raising=False)
    t, _ = _tracing(tmp_path, tracings, rank=3, stage=1)
    res = t.provider.resource.attributes
    assert res["service.name"] == cat.SERVICE_NAME_DEFAULT
    assert res["service.instance.id"] == f"{JOB}-3"
    assert res["host.name"] == "h" and res["process.pid"] == os.getpid()
    assert not [k for k in res if k.startswith("k8s.") or k == cat.RES_SLURM_JOB_ID]  # absent when not set
    assert res[cat.ATTR_JOB] == JOB and res[cat.ATTR_RANK] == 3 and res[cat.ATTR_PP_STAGE] == 1
    assert (res[cat.RES_DP], res[cat.RES_TP], res[cat.RES_PP], res[cat.RES_DP_RANK]) == (2, 1, 2, 1)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-train")
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "deployment.environment=ci,host.name=override,k8s.node.name=mine,hpar.rank=9",
    )
    monkeypatch.setenv("K8S_POD_NAME", "train-0-abcde")
    monkeypatch.setenv("K8S_NAMESPACE_NAME", "ml")
    monkeypatch.setenv("K8S_NODE_NAME", "gpu-node-7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    t2, _ = _tracing(tmp_path, tracings)
    res2 = t2.provider.resource.attributes
    assert res2["service.name"] == "my-train"
    assert res2["deployment.environment"] == "ci" and res2["host.name"] == "override"
    assert res2["k8s.pod.name"] == "train-0-abcde" and res2["k8s.namespace.name"] == "ml"
    assert res2["k8s.node.name"] == "mine"  # the user's OTEL_RESOURCE_ATTRIBUTES win
    assert res2[cat.ATTR_RANK] == 0  # but never over the topology, which the metrics carry too
    assert res2["hpar.slurm.job.id"] == "4242"


def test_resource_names_are_the_semantic_conventions():
    """Names a backend's Kubernetes or host views key on, checked against the OTel semconv package."""
    from opentelemetry.semconv._incubating.attributes import (
        host_attributes,
        k8s_attributes,
        process_attributes,
    )
    from opentelemetry.semconv.attributes import service_attributes

    assert cat.RES_SERVICE_NAME == service_attributes.SERVICE_NAME
    assert cat.RES_SERVICE_INSTANCE_ID == service_attributes.SERVICE_INSTANCE_ID
    assert cat.RES_HOST_NAME == host_attributes.HOST_NAME
    assert cat.RES_PROCESS_PID == process_attributes.PROCESS_PID
    assert (cat.RES_K8S_POD_NAME, cat.RES_K8S_NAMESPACE_NAME, cat.RES_K8S_NODE_NAME) == (
        k8s_attributes.K8S_POD_NAME,
        k8s_attributes.K8S_NAMESPACE_NAME,
        k8s_attributes.K8S_NODE_NAME,
    )
    assert cat.RES_SLURM_JOB_ID.startswith("hpar.")  # no convention: our namespace


def test_tracer_provider_is_not_global(tmp_path, tracings):
    from opentelemetry import trace

    before = trace.get_tracer_provider()
    t, _ = _tracing(tmp_path, tracings)
    assert trace.get_tracer_provider() is before
    assert trace.get_tracer_provider() is not t.provider


class _BlockedExporter(SpanExporter):
    """Stands for an endpoint that never answers until released; fails every export afterwards."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.release.set()


def test_queue_bounded_and_drops_counted(tmp_path, tracings):
    blocked = _BlockedExporter()
    t = Tracing(_agent(tmp_path, trace_every=1).context, blocked, max_queue_size=32, schedule_delay_millis=10)
    tracings.append(t)
    n_steps = 100  # 4 spans each
    worst_in_flight = 0
    for step in range(n_steps):
        t.export_step(_step(step))
        worst_in_flight = max(worst_in_flight, t.in_flight)
    assert worst_in_flight <= t.max_queue_size == 32
    created = t.spans_created
    assert created == 4 * n_steps
    # everything not in the queue or in the one stuck export was dropped and counted
    assert t.dropped >= created - 32 - 32
    t0 = time.monotonic()
    t.shutdown(0.5)
    assert time.monotonic() - t0 < 2.0  # bounded, with the exporter still stuck
    assert t.dropped == created  # nothing was confirmed exported: every span counted as lost
    assert t.export_step(_step(n_steps)) is False  # no spans after shutdown


def test_failed_exports_counted(tmp_path, tracings):
    class Failing(SpanExporter):
        def export(self, spans):
            return SpanExportResult.FAILURE

    t, _ = _tracing(tmp_path, tracings, exporter=Failing(), trace_every=1)
    t.export_step(_step(0))
    t.flush()
    assert t.dropped == 4


def test_file_mode_writes_parseable_otlp_json(tmp_path):
    agent = _agent(tmp_path, rank=2, traces="file", trace_every=1)
    t = Tracing(agent.context)
    try:
        assert t.kind == "file"
        t.export_step(_step(4))
    finally:
        t.shutdown(5.0)
    assert t.dropped == 0
    path = tmp_path / "traces.rank2.jsonl"
    assert t.path == str(path)
    lines = path.read_text().splitlines()
    assert lines
    names, ids = [], set()
    for line in lines:
        assert '"traceId":"' + trace_id_hex(JOB, 4) + '"' in line  # OTLP/JSON: hex ids
        req = parse_otlp_json_line(line)
        for rs in req.resource_spans:
            attrs = {kv.key: kv.value for kv in rs.resource.attributes}
            assert attrs["service.name"].string_value
            for ss in rs.scope_spans:
                for s in ss.spans:
                    names.append(s.name)
                    ids.add(int.from_bytes(s.trace_id, "big"))
    assert sorted(names) == sorted(
        [cat.SPAN_STEP, cat.SPAN_PP_FORWARD, "collective.all_reduce", cat.SPAN_COMPILE]
    )
    assert ids == {trace_id(JOB, 4)}


def test_file_exporter_encodes_a_batch_in_chunks(tmp_path):
    """A batch larger than EXPORT_CHUNK becomes several lines (one GIL hold each), every span kept once."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    from hpar_agent.exporters.otel import EXPORT_CHUNK, OtlpJsonFileExporter

    tracer = TracerProvider().get_tracer("t")
    spans = []
    for i in range(2 * EXPORT_CHUNK + 3):
        sp = tracer.start_span(f"s{i}")
        sp.end()
        spans.append(sp)
    exp = OtlpJsonFileExporter(str(tmp_path / "t.jsonl"))
    assert exp.export(spans) == SpanExportResult.SUCCESS
    exp.shutdown()
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 3
    names = [
        s.name
        for line in lines
        for rs in parse_otlp_json_line(line).resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
    assert sorted(names) == sorted(f"s{i}" for i in range(2 * EXPORT_CHUNK + 3))


def test_auto_without_endpoint_uses_file(tmp_path, tracings, monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    t = Tracing(_agent(tmp_path, traces="auto").context)
    tracings.append(t)
    assert t.kind == "file"


def test_jaeger_query_names_and_tags(tmp_path, tracings):
    """The README's Jaeger queries (service, operations, tags) match what is exported."""
    t, exp = _tracing(tmp_path, tracings, trace_every=1)
    t.export_step(_step(0))
    spans = _spans(t, exp)
    assert {s.resource.attributes["service.name"] for s in spans} == {cat.SERVICE_NAME_DEFAULT}
    ops = {s.name for s in spans}
    assert {cat.SPAN_STEP, cat.SPAN_COLLECTIVE_PREFIX + "all_reduce", cat.SPAN_PP_FORWARD} <= ops
    for s in spans:
        assert set(cat.SPAN_COMMON_ATTRS) <= set(s.attributes)
    coll = next(s for s in spans if s.name.startswith(cat.SPAN_COLLECTIVE_PREFIX))
    assert coll.attributes[cat.ATTR_PG] == "dp"


def test_exemplars_carry_exported_trace_ids(tmp_path):
    """Part 6: step-histogram exemplars in OpenMetrics point at traces that were exported."""
    import torch
    from prometheus_client.openmetrics.exposition import generate_latest

    exp = InMemorySpanExporter()
    agent = hpar_agent.attach(
        metrics_port=-1, run_dir=str(tmp_path), traces="none", trace_every=2, job_id=JOB
    )
    try:
        agent.outputs.tracing = Tracing(agent.context, exp, schedule_delay_millis=60_000)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            model(torch.randn(1, 2)).sum().backward()
            opt.step()
        agent.tick()
        assert agent.tracing.flush()
        exported = {f"{s.context.trace_id:032x}" for s in exp.get_finished_spans()}
        text = generate_latest(agent.registry).decode()
        exemplar_ids = {
            line.split('trace_id="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("hpar_step_duration_seconds_bucket") and "# {" in line
        }
        assert exemplar_ids, text
        assert exemplar_ids <= exported
        assert exemplar_ids <= {trace_id_hex(JOB, s) for s in (0, 2, 4)}
    finally:
        hpar_agent.detach()
        agent.stop()


def test_topology_replace_keeps_common_attrs(tmp_path, tracings):
    """Children keep their own pp stage (interleaved virtual stages) over the rank's default."""
    t, exp = _tracing(tmp_path, tracings, trace_every=1)
    rec = _step(0)
    rec.children[0] = replace(rec.children[0], attributes={cat.ATTR_PP_STAGE: 3, cat.ATTR_MICROBATCH: 1})
    t.export_step(rec)
    fwd = next(s for s in _spans(t, exp) if s.name == cat.SPAN_PP_FORWARD)
    assert fwd.attributes[cat.ATTR_PP_STAGE] == 3 and fwd.attributes[cat.ATTR_RANK] == 0


def test_grpc_missing_falls_back_to_file_with_one_line(tmp_path, tracings, monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    with caplog.at_level("WARNING", logger="hpar_agent"):
        t = Tracing(_agent(tmp_path, traces="auto").context)
    tracings.append(t)
    assert t.kind == "file"
    assert any("hpar-agent[grpc]" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    t2 = Tracing(_agent(tmp_path, traces="otlp").context)
    tracings.append(t2)
    assert t2.kind == "otlp-http"


def test_file_exporter_hands_the_gil_back_between_chunks(tmp_path, monkeypatch):
    """Between chunks the export sleeps (a real sleep: the training thread takes the GIL), never
    after the last one."""
    from opentelemetry.sdk.trace import TracerProvider

    from hpar_agent.exporters import otel

    tracer = TracerProvider().get_tracer("t")
    spans = [tracer.start_span(f"s{i}") for i in range(2 * otel.EXPORT_CHUNK + 1)]
    for sp in spans:
        sp.end()
    sleeps: list[float] = []
    monkeypatch.setattr(otel.time, "sleep", lambda s: sleeps.append(s))
    exp = otel.OtlpJsonFileExporter(str(tmp_path / "t.jsonl"))
    exp.export(spans)
    exp.shutdown()
    assert sleeps == [otel.EXPORT_YIELD_S] * 2
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 3


def test_the_direct_otlp_json_encoder_spells_what_the_sdk_encoder_does(tmp_path):
    """The traces file's encoder (``otlp_json``, ~5x cheaper) against the SDK's protobuf encoder on the
    spans the agent makes: a root span, a span under a remote parent (ranks > 0), children with events,
    an error status and every attribute type; a span it does not spell (a link) falls back to the SDK's."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

    from hpar_agent.exporters import otlp_json
    from hpar_agent.exporters.otel import OtlpJsonFileExporter, sdk_document

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "s", "hpar.rank": 1, "x": 0.5}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("hpar_agent", "1.0")
    remote = SpanContext(0xABC, 0x99, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    step = tracer.start_span(
        "train.step",
        context=trace.set_span_in_context(NonRecordingSpan(remote)),
        attributes={"s": "a", "b": True, "i": -3, "f": 0.25, "l": [1, 2], "t": ("x",), "e": []},
    )
    ctx = trace.set_span_in_context(step)
    for i in range(3):
        child = tracer.start_span(
            "pp.forward", context=ctx, attributes={"hpar.microbatch": i}, start_time=10 + i
        )
        child.add_event("late", {"k": 1}, timestamp=12)
        child.add_event("bare", timestamp=13)
        if i == 1:
            child.set_status(Status(StatusCode.ERROR, "boom"))
        child.end(end_time=20 + i)
    step.end()
    tracer.start_span("root").end()  # rank 0's step: no parent
    spans = mem.get_finished_spans()

    assert otlp_json.encode(spans) == sdk_document(spans)
    linked = tracer.start_span("linked", links=[Link(remote)])
    linked.end()
    assert otlp_json.encode([linked]) is None  # the exporter then takes the SDK's encoder
    exp = OtlpJsonFileExporter(str(tmp_path / "t.jsonl"))
    exp.paced = False
    exp.export([linked, *spans[:2]])
    exp.shutdown()
    (line,) = (tmp_path / "t.jsonl").read_text().splitlines()
    names = [
        s.name for rs in parse_otlp_json_line(line).resource_spans for ss in rs.scope_spans for s in ss.spans
    ]
    assert names == ["linked", spans[0].name, spans[1].name]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd")
def test_a_forked_child_lets_go_of_the_traces_file_without_writing_to_it(tmp_path) -> None:
    """What the fork handler has tracing do in a child (``Tracing.forget_in_child``): the child's copy
    of the traces file's descriptor points at /dev/null, so nothing the child holds reaches the parent's
    file, and nothing is flushed."""
    from hpar_agent.exporters.otel import OtlpJsonFileExporter

    t = Tracing(_agent(tmp_path, traces="file").context)
    inner = t._exporter.inner
    assert isinstance(inner, OtlpJsonFileExporter)
    inner.export([])  # opens the file
    fd = inner._file._fh.fileno()
    assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "traces.rank0.jsonl")
    t.forget_in_child()
    assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull
    t.shutdown(2.0)
    assert (tmp_path / "traces.rank0.jsonl").read_text() == ""
