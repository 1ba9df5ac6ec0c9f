"""OTLP/JSON of finished spans, written directly from the SDK's ``ReadableSpan``.

The traces file holds ``ExportTraceServiceRequest`` documents in OTLP/JSON (ids as hex, enums as
ints). The SDK's own path, ``encode_spans`` to protobuf then ``json_format.MessageToDict``, costs about
100 µs a span in pure Python on the exporter thread, with the GIL held; OpenTelemetry
Python ships no OTLP/JSON encoder. This one builds the same document from the span's fields in a few
µs, for the spans the agent makes (attributes of str, bool, int, float and their sequences; events;
status; remote parents). Anything else (links, dropped counts, non-finite floats, other value types)
returns None and the caller takes the SDK's path; ``tests/unit/test_otel.py`` checks both paths
give the same protobuf message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

#: ``SpanFlags``: the span says whether its parent is remote (0x100), and it is (0x200).
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


class _Unsupported(Exception):
    """A span this encoder does not spell: the caller uses the SDK's encoder."""


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Unsupported("non-finite float")
        return {"doubleValue": v}
    if isinstance(v, (list, tuple)):
        return {"arrayValue": {"values": [_value(x) for x in v]} if v else {}}
    raise _Unsupported(type(v).__name__)


def _attributes(attrs: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in (attrs or {}).items()]


def _span(s: ReadableSpan) -> dict[str, Any]:
    ctx = s.get_span_context()
    if ctx is None or s.links or s.dropped_attributes or s.dropped_events or s.dropped_links:
        raise _Unsupported("links or dropped counts")
    out: dict[str, Any] = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    if ctx.trace_state:
        out["traceState"] = ctx.trace_state.to_header()
    parent = s.parent
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out["name"] = s.name
    out["kind"] = s.kind.value + 1  # SpanKind.INTERNAL (0) is SPAN_KIND_INTERNAL (1)
    out["startTimeUnixNano"] = str(s.start_time)
    out["endTimeUnixNano"] = str(s.end_time)
    if s.attributes:
        out["attributes"] = _attributes(s.attributes)
    if s.events:
        events = []
        for e in s.events:
            if e.dropped_attributes:
                raise _Unsupported("dropped event attributes")
            ev: dict[str, Any] = {"timeUnixNano": str(e.timestamp), "name": e.name}
            if e.attributes:
                ev["attributes"] = _attributes(e.attributes)
            events.append(ev)
        out["events"] = events
    status: dict[str, Any] = {}
    if s.status.status_code.value:
        status["code"] = s.status.status_code.value
    if s.status.description:
        status["message"] = s.status.description
    out["status"] = status
    out["flags"] = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    return out


def encode(spans: Sequence[ReadableSpan]) -> dict[str, Any] | None:
    """The ``ExportTraceServiceRequest`` of ``spans`` as OTLP/JSON, grouped by resource and scope as
    the SDK groups them; None when a span needs the SDK's encoder."""
    try:
        by_resource: dict[int, tuple[Any, dict[int, tuple[Any, list[dict[str, Any]]]]]] = {}
        for s in spans:
            res = s.resource
            scopes = by_resource.setdefault(id(res), (res, {}))[1]
            scope = s.instrumentation_scope
            scopes.setdefault(id(scope), (scope, []))[1].append(_span(s))
        out = []
        for res, scopes in by_resource.values():
            scope_spans = []
            for scope, encoded in scopes.values():
                entry: dict[str, Any] = {}
                if scope is not None:
                    if getattr(scope, "attributes", None):
                        raise _Unsupported("scope attributes")
                    entry["scope"] = {
                        k: v for k, v in (("name", scope.name), ("version", scope.version)) if v
                    }
                entry["spans"] = encoded
                if scope is not None and scope.schema_url:
                    entry["schemaUrl"] = scope.schema_url
                scope_spans.append(entry)
            rs: dict[str, Any] = {
                "resource": {"attributes": _attributes(res.attributes)} if res.attributes else {},
                "scopeSpans": scope_spans,
            }
            if res.schema_url:
                rs["schemaUrl"] = res.schema_url
            out.append(rs)
        return {"resourceSpans": out}
    except _Unsupported:
        return None
