"""What the traces file costs per span on the exporter thread: ``exporters.otlp_json`` against the SDK's
encoder (``encode_spans`` to protobuf, ``MessageToDict``, hex ids), both ending in ``json.dumps``.

Spans of the agent's shape (a ``train.step`` under a remote parent, children with five attributes and
an event), encoded in the exporter's chunks; the two encoders alternate over ``--reps`` rounds and the
median µs per span of each is printed with their ratio.

    python -m benchmarks.otlp_json_encode --spans 512 --reps 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def agent_spans(n: int) -> list[Any]:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    mem = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "hpar", "hpar.rank": 1}))
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("hpar_agent", "1")
    remote = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    step = tracer.start_span("train.step", context=trace.set_span_in_context(NonRecordingSpan(remote)))
    ctx = trace.set_span_in_context(step)
    for i in range(n - 1):
        child = tracer.start_span("pp.forward", context=ctx, start_time=1000 + i, attributes={
            "hpar.rank": 1, "hpar.pp.stage": 1, "hpar.step": i // 16, "hpar.microbatch": i % 8, "cuda.stream": "cpu"})
        child.add_event("hpar.late", {"k": 1}, timestamp=1500 + i)
        child.end(end_time=2000 + i)
    step.end()
    return list(mem.get_finished_spans())


def main() -> int:
    from hpar_agent.exporters import otlp_json
    from hpar_agent.exporters.otel import EXPORT_CHUNK, sdk_document

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    spans = agent_spans(a.spans)
    chunks = [spans[i : i + EXPORT_CHUNK] for i in range(0, len(spans), EXPORT_CHUNK)]
    if any(otlp_json.encode(c) is None for c in chunks):  # it would time the fallback, not the encoder
        raise SystemExit("otlp_json does not spell these spans")

    def direct() -> None:
        for c in chunks:
            json.dumps(otlp_json.encode(c), separators=(",", ":"))

    def sdk() -> None:
        for c in chunks:
            json.dumps(sdk_document(c), separators=(",", ":"))

    times: dict[str, list[float]] = {"direct": [], "sdk": []}
    for rep in range(a.reps):
        for name, fn in ((("direct", direct), ("sdk", sdk)) if rep % 2 == 0 else (("sdk", sdk), ("direct", direct))):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / len(spans) * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(spans)} spans in chunks of {EXPORT_CHUNK}, {a.reps} rounds: direct {med['direct']:.1f} µs/span, "
          f"SDK {med['sdk']:.1f} µs/span, ratio {med['sdk'] / med['direct']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"us_per_span": med, "rounds": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
