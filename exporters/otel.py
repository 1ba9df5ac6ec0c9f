"""OpenTelemetry traces: one trace per training step, shared by every rank of the job.

All span creation happens on the agent thread from timestamps the hooks recorded, so the training
thread never touches OTel. Every span is over when it is built, so it is made finished (the SDK's
``ReadableSpan``) and handed to the span processor, not started and ended through a tracer. The
TracerProvider (resource, processor) belongs to the agent: it is never installed as the global
provider, so a user's own OTel setup is left alone.

Trace ids are derived from (job id, step) and rank 0's ``train.step`` span id from (job, step, 0), so
each rank builds its part of the same trace independently: rank 0's step span is the root, the other
ranks' step spans name it as a remote parent, and every child hangs off its own rank's step span.

Drops are counted honestly through public interfaces only: a wrapper processor bounds the spans in
flight (accepted but not yet handed to the exporter) at the queue size, so the SDK's own queue never
overflows silently, and a wrapper exporter counts spans whose export failed. Whatever was accepted but
not confirmed exported when ``shutdown`` gives up is counted as dropped too.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from hpar_agent import catalogue as cat
from hpar_agent._version import __version__
from hpar_agent.exporters import otlp_json
from hpar_agent.safefiles import RotatingFile
from hpar_agent.spans import StepRecord, realize
from hpar_agent.traceids import step_span_id, trace_id

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

DEFAULT_MAX_QUEUE_SIZE = 2048
DEFAULT_EXPORT_TIMEOUT_S = 5.0  # used unless OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT is set
SLOW_FACTOR = 2.0  # a step slower than this x the running median is always traced
SLOW_MIN_HISTORY = 5  # steps needed before "slow" means anything (the first steps compile)
_HISTORY = 64
_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


# ------------------------------------------------------------------------------------------ exporters
#: Spans encoded per GIL hold by the traces-file exporter (~20 µs each with ``otlp_json``, ~100 µs
#: through the SDK's encoder), and the sleep between chunks that gives the GIL back. OTLP exporters
#: encode a batch in one request (the SDK's).
EXPORT_CHUNK = 32
EXPORT_YIELD_S = 0.001


def sdk_document(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The OTLP/JSON ``ExportTraceServiceRequest`` of ``spans`` through the SDK's protobuf encoder and
    ``MessageToDict`` (ids as hex, enums as ints): the reference ``otlp_json`` is checked against."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    doc: dict[str, Any] = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _ids_to_hex(doc)
    return doc


class OtlpJsonFileExporter(SpanExporter):
    """Writes each batch as OTLP/JSON ``ExportTraceServiceRequest`` lines, one per chunk (the format of the
    OTel file exporter spec and the Collector's ``otlpjsonfile`` receiver: ids as hex, enums as ints)."""

    def __init__(
        self,
        path: str,
        max_bytes: int = 0,
        backups: int = 2,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        # Imported here, at attach, not on the first export: importing the encoder and the OTLP
        # protos held the GIL for about 100 ms on the exporter thread, mid-training.
        import google.protobuf.json_format  # noqa: F401
        import opentelemetry.exporter.otlp.proto.common.trace_encoder  # noqa: F401

        self.path = path
        self._file = RotatingFile(path, max_bytes, backups)  # 0600, no symlinks, size-capped
        self.on_error = on_error

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """One line per ``EXPORT_CHUNK`` spans, the GIL handed back between chunks.

        Encoding to OTLP/JSON is pure Python and holds the GIL (512 spans in one go: tens of ms).
        Small chunks with a real sleep between them hand the GIL back on our initiative, so the training
        thread never waits out a whole batch, or the 5 ms switch interval chunk after chunk."""
        lines = []
        for i in range(0, len(spans), EXPORT_CHUNK):
            if i:
                time.sleep(EXPORT_YIELD_S)
            chunk = spans[i : i + EXPORT_CHUNK]
            doc = otlp_json.encode(chunk)
            if doc is None:  # a span the direct encoder does not spell: the SDK's (5x slower)
                doc = sdk_document(chunk)
            lines.append(json.dumps(doc, separators=(",", ":")) + "\n")
        try:
            self._file.write("".join(lines))
        except OSError as exc:  # counted as dropped spans and as an agent error, logged once
            if self.on_error is not None:
                self.on_error(exc)
            else:
                log.warning("hpar_agent: cannot write traces to %s: %s", self.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def drop_in_child(self) -> None:
        """After fork, in the child: release the file's descriptor without flushing the parent's data."""
        self._file.drop_in_child()


def _walk_ids(doc: Any, convert: Any) -> None:
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in _ID_FIELDS and isinstance(value, str):
                doc[key] = convert(value)
            else:
                _walk_ids(value, convert)
    elif isinstance(doc, list):
        for item in doc:
            _walk_ids(item, convert)


def _ids_to_hex(doc: Any) -> None:
    import base64

    _walk_ids(doc, lambda v: base64.b64decode(v).hex())


def parse_otlp_json_line(line: str) -> Any:
    """One line of a traces file back into an ``ExportTraceServiceRequest`` (hex ids -> bytes)."""
    import base64

    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    doc = json.loads(line)
    _walk_ids(doc, lambda v: base64.b64encode(bytes.fromhex(v)).decode())
    return ParseDict(doc, ExportTraceServiceRequest())


class _CountingExporter(SpanExporter):
    """Counts spans handed to the real exporter and how each export ended; never raises."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.handed = 0
        self.ok = 0
        self.failed = 0
        self.closed = False  # after shutdown gave up: late results no longer count (already lost)
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        with self.lock:
            self.handed += n
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            log.warning("hpar_agent: span export failed: %s", exc)
            result = SpanExportResult.FAILURE
        with self.lock:
            if not self.closed:
                if result == SpanExportResult.SUCCESS:
                    self.ok += n
                else:
                    self.failed += n
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _BoundedProcessor(SpanProcessor):
    """Keeps at most ``max_queue`` spans accepted-but-not-handed-to-the-exporter, counting the rest as
    dropped, so the BatchSpanProcessor's own queue (same size) can never drop behind our back."""

    def __init__(
        self, exporter: _CountingExporter, max_queue: int, schedule_delay_millis: float | None
    ) -> None:
        self.exporter = exporter
        self.max_queue = max_queue
        self.offered = 0  # written by the agent thread only
        self.queue_drops = 0
        self.batch = BatchSpanProcessor(
            exporter,
            max_queue_size=max_queue,
            schedule_delay_millis=schedule_delay_millis,
            max_export_batch_size=min(512, max_queue) if max_queue < 512 else None,
        )

    @property
    def in_flight(self) -> int:
        return self.offered - self.exporter.handed

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self.in_flight >= self.max_queue:
            self.queue_drops += 1
            return
        self.offered += 1
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()  # type: ignore[no-untyped-call]  # opentelemetry-sdk: unannotated

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


def _otlp_exporter() -> tuple[SpanExporter, str] | None:
    """The OTLP exporter the standard OTEL_* variables ask for (each class reads its own env)."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or ""
    ).strip().lower() or "http/protobuf"
    timed = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" in os.environ or "OTEL_EXPORTER_OTLP_TIMEOUT" in os.environ
    kwargs: dict[str, Any] = {} if timed else {"timeout": DEFAULT_EXPORT_TIMEOUT_S}
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            log.warning(
                "hpar_agent: OTLP protocol grpc needs `pip install hpar-agent[grpc]`; writing traces to a file"
            )
            return None
        return GrpcExporter(**kwargs), "otlp-grpc"
    if protocol != "http/protobuf":
        log.warning("hpar_agent: OTLP protocol %r is not supported; using http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(**kwargs), "otlp-http"


def _endpoint_configured() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def _attr(value: Any) -> Any:
    """OTel accepts str/bool/int/float (and sequences of them); anything else becomes its str."""
    return value if isinstance(value, str | bool | int | float) else str(value)


def _topology_attributes(topo: Any) -> dict[str, Any]:
    """The hpar.* Resource attributes of a topology (the same facts as ``hpar_rank_info``)."""
    return {
        cat.ATTR_JOB: topo.job_id,
        cat.ATTR_RANK: topo.rank,
        cat.ATTR_PP_STAGE: topo.pp_stage,
        cat.RES_WORLD_SIZE: topo.world_size,
        cat.RES_DP: topo.dp,
        cat.RES_TP: topo.tp,
        cat.RES_PP: topo.pp,
        cat.RES_DP_RANK: topo.dp_rank,
        cat.RES_TP_RANK: topo.tp_rank,
        cat.RES_PP_RANK: topo.pp_rank,
    }


def _instance_id(topo: Any) -> str:
    """``service.instance.id``: ``<job id>-<rank>``, unique among the processes of the job that live at
    one time, and readable (it joins with ``job_id`` and ``rank`` of the metrics), where a random uuid
    would need a lookup; ``process.pid`` tells a restarted rank's process from the one before."""
    return f"{topo.job_id}-{topo.rank}"


# ------------------------------------------------------------------------------------------ tracing
class Tracing:
    """The agent's span pipeline. ``exporter`` overrides the choice made from config/env (tests)."""

    def __init__(
        self,
        ctx: AgentContext,
        exporter: SpanExporter | None = None,
        *,
        max_queue_size: int | None = None,
        schedule_delay_millis: float | None = None,
    ) -> None:
        self.ctx = ctx
        topo = ctx.topology
        self.job_id: str = topo.job_id
        self.rank: int = topo.rank
        self.pp_stage: int = topo.pp_stage
        self.trace_every: int = ctx.config.trace_every
        self.path: str | None = None
        if exporter is not None:
            self.kind = "custom"
        else:
            exporter, self.kind = self._choose_exporter(ctx.config.traces)
        if max_queue_size is None:
            try:
                max_queue_size = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE_SIZE))
            except ValueError:
                max_queue_size = DEFAULT_MAX_QUEUE_SIZE
        self._exporter = _CountingExporter(exporter)
        self._processor = _BoundedProcessor(self._exporter, max(1, max_queue_size), schedule_delay_millis)
        self._ids = RandomIdGenerator()  # the children's span ids (the step spans' are derived)
        self.resource = self._resource(topo)  # what every span carries (``retopologize`` replaces it)
        self.provider = TracerProvider(
            resource=self.resource,
            sampler=ALWAYS_ON,  # steps are sampled here, at step end; the SDK keeps what we create
            shutdown_on_exit=False,  # shutdown() is bounded; an atexit flush could hang exit
        )
        self.provider.add_span_processor(self._processor)
        self._scope = InstrumentationScope("hpar_agent", __version__)
        self._recent: deque[float] = deque(maxlen=_HISTORY)
        self.steps_traced = 0
        self.steps_skipped = 0
        self.spans_created = 0
        self._lost_at_shutdown = 0
        self._closed = False

    def _choose_exporter(self, mode: str) -> tuple[SpanExporter, str]:
        if mode == "otlp" or (mode == "auto" and _endpoint_configured()):
            chosen = _otlp_exporter()
            if chosen is not None:
                return chosen
        run_dir = self.ctx.run_dir
        if not run_dir:
            raise OSError("no usable run directory for the traces file (see the agent's first warning)")
        self.path = os.path.join(run_dir, f"traces.rank{self.rank}.jsonl")
        cfg = self.ctx.config
        record = self.ctx.record_error
        return OtlpJsonFileExporter(
            self.path, getattr(cfg, "log_max_bytes", 0), on_error=lambda exc: record("tracing", exc)
        ), "file"

    @staticmethod
    def _resource(topo: Any) -> Resource:
        """Our identity defaults, overridden by OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, with the
        hpar.* topology always ours (it must match the metrics)."""
        user = OTELResourceDetector().detect()  # the SDK parses OTEL_RESOURCE_ATTRIBUTES/SERVICE_NAME
        defaults: dict[str, Any] = {
            cat.RES_SERVICE_NAME: cat.SERVICE_NAME_DEFAULT,
            cat.RES_SERVICE_INSTANCE_ID: _instance_id(topo),
            cat.RES_HOST_NAME: topo.host,
            cat.RES_PROCESS_PID: os.getpid(),
        }
        defaults.update(
            {attr: os.environ[var] for var, attr in cat.RESOURCE_ENV.items() if os.environ.get(var)}
        )
        return Resource.create({**defaults, **user.attributes, **_topology_attributes(topo)})

    def retopologize(self, topo: Any) -> bool:
        """The agent re-detected its topology: spans built from now on carry it (agent thread; also at
        exit, so no ``Resource.create``: its detectors need a thread pool). False when the rank changed
        and the spans go to a local file named by rank: the caller rebuilds the pipeline."""
        if topo.rank != self.rank and self.kind == "file":
            return False
        new = dict(_topology_attributes(topo))
        if self.resource.attributes.get(cat.RES_SERVICE_INSTANCE_ID) == _instance_id(
            self
        ):  # ours, not the user's
            new[cat.RES_SERVICE_INSTANCE_ID] = _instance_id(topo)
        self.job_id, self.rank, self.pp_stage = topo.job_id, topo.rank, topo.pp_stage
        self.resource = self.resource.merge(Resource(new))
        return True

    # ----------------------------------------------------------------------------- agent thread
    def keep_reason(self, rec: StepRecord) -> str | None:
        """Why this step's trace is kept (sampled | anomalous | slow), or None to create nothing."""
        dur = rec.duration_s
        slow = False
        if len(self._recent) >= SLOW_MIN_HISTORY:
            slow = dur > SLOW_FACTOR * statistics.median(self._recent)
        self._recent.append(dur)
        if rec.anomalous or any(c.anomalous for c in rec.children):
            return "anomalous"
        if slow:
            return "slow"
        if self.trace_every > 0 and rec.step % self.trace_every == 0:
            return "sampled"
        return None

    def export_step(self, rec: StepRecord) -> bool:
        """Build this rank's spans of one completed step (agent thread); True when the step was kept."""
        if self._closed:
            return False
        reason = self.keep_reason(rec)
        if reason is None:
            self.steps_skipped += 1
            return False
        children = [realize(c) for c in rec.children]  # before any span is made: a failure hands over none
        common = {cat.ATTR_RANK: self.rank, cat.ATTR_PP_STAGE: self.pp_stage, cat.ATTR_STEP: rec.step}
        tid = trace_id(self.job_id, rec.step)
        root = SpanContext(tid, step_span_id(self.job_id, rec.step, 0), is_remote=True, trace_flags=_SAMPLED)
        own = SpanContext(
            tid, step_span_id(self.job_id, rec.step, self.rank), is_remote=False, trace_flags=_SAMPLED
        )
        attrs = {**common, **{k: _attr(v) for k, v in rec.attributes.items()}, cat.ATTR_TRACE_REASON: reason}
        step_span = self._span(
            cat.SPAN_STEP, own, None if self.rank == 0 else root, attrs, rec.events, rec.start_ns, rec.end_ns
        )
        spans = []
        for c in children:
            # Real times, no clamping: children are recorded between the step's boundaries, and one
            # that is not (e.g. a compile straddling a boundary) is worth seeing as it was.
            ctx = SpanContext(tid, self._ids.generate_span_id(), is_remote=False, trace_flags=_SAMPLED)
            attrs = {**common, **{k: _attr(v) for k, v in c.attributes.items()}}
            spans.append(self._span(c.name, ctx, own, attrs, c.events, c.start_ns, c.end_ns))
        spans.append(step_span)  # last, as it ended last
        for span in spans:
            self._processor.on_end(span)
        self.spans_created += len(spans)
        self.steps_traced += 1
        return True

    def _span(
        self,
        name: str,
        ctx: SpanContext,
        parent: SpanContext | None,
        attrs: dict[str, Any],
        events: list[tuple[str, int, dict[str, Any]]],
        start_ns: int,
        end_ns: int,
    ) -> ReadableSpan:
        """A finished span, made whole: every span here is over when it is built, and the SDK's
        live-span path (``Tracer.start_span`` then ``end``: context, sampler, locks, attribute
        limits) made ``export_step`` cost about three times the CPU a span."""
        return ReadableSpan(
            name=name,
            context=ctx,
            parent=parent,
            resource=self.resource,
            attributes=attrs,
            events=[Event(n, {k: _attr(v) for k, v in a.items()}, timestamp=ts) for n, ts, a in events],
            start_time=start_ns,
            end_time=max(end_ns, start_ns),
            instrumentation_scope=self._scope,
        )

    # ----------------------------------------------------------------------------- accounting
    @property
    def dropped(self) -> int:
        """Spans lost: queue full, failed exports, and those still unexported when shutdown gave up."""
        return self._processor.queue_drops + self._exporter.failed + self._lost_at_shutdown

    @property
    def in_flight(self) -> int:
        """Spans accepted but not yet handed to the exporter (bounded by the queue size)."""
        return self._processor.in_flight

    @property
    def max_queue_size(self) -> int:
        return self._processor.max_queue

    def flush(self, timeout: float = 5.0) -> bool:
        """Export what is queued now (bounded wait: runs in a helper thread)."""
        return self._bounded(self._processor.force_flush, timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Flush and stop within ``timeout`` seconds whatever the endpoint does; count what is lost."""
        if self._closed:
            return
        self._closed = True
        self._bounded(self.provider.shutdown, timeout)
        exp = self._exporter
        with exp.lock:
            exp.closed = True
            self._lost_at_shutdown = max(0, self._processor.offered - exp.ok - exp.failed)

    def forget_in_child(self) -> None:
        """After fork, in the child: the exporter's thread did not survive it and the child exports
        nothing; a traces file's descriptor is released without flushing the parent's spans."""
        inner = self._exporter.inner
        if isinstance(inner, OtlpJsonFileExporter):
            inner.drop_in_child()

    @staticmethod
    def _bounded(fn: Any, timeout: float) -> bool:
        """Run ``fn`` in a daemon thread and wait at most ``timeout``: a hung export cannot hang us."""
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            except Exception as exc:
                log.warning("hpar_agent: tracing %s failed: %s", getattr(fn, "__name__", "call"), exc)
            finally:
                done.set()

        t0 = time.monotonic()
        threading.Thread(target=run, name="hpar-tracing-flush", daemon=True).start()
        return done.wait(max(0.0, timeout - (time.monotonic() - t0)))

    def summary(self) -> dict[str, Any]:
        return {
            "exporter": self.kind,
            "path": self.path,
            "steps_traced": self.steps_traced,
            "steps_skipped": self.steps_skipped,
            "spans": self.spans_created,
            "spans_dropped": self.dropped,
        }
