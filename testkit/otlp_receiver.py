"""A real OTLP trace receiver for tests: HTTP (POST /v1/traces, protobuf, optional gzip) and gRPC.

No Collector, Jaeger or Tempo can be installed on the project's machines, so spans are checked at the
wire level: both servers decode ``ExportTraceServiceRequest`` from opentelemetry-proto and keep every
span with its resource attributes. ``mode`` switches a receiver to ``slow`` (answers after ``delay``
seconds, past the client's deadline) or ``down`` (listening socket closed: connection refused).
"""

from __future__ import annotations

import abc
import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One decoded span, flattened for assertions."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0 for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=int.from_bytes(s.trace_id, "big"),
                        span_id=int.from_bytes(s.span_id, "big"),
                        parent_span_id=int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else 0,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={kv.key: any_value(kv.value) for kv in s.attributes},
                        resource=resource,
                        events=[
                            (e.name, e.time_unix_nano, {kv.key: any_value(kv.value) for kv in e.attributes})
                            for e in s.events
                        ],
                    )
                )
    return out


class _Receiver(abc.ABC):
    def __init__(self, delay: float = 3.0) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.mode = "up"
        self.delay = delay
        self.port = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def _accept(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = decode(request)
        with self._cond:
            self.requests += 1
            self.spans.extend(spans)
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """Block until at least ``n`` spans arrived (or the timeout); return a copy of all spans."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.spans) >= n, timeout)
            return list(self.spans)

    def set_mode(self, mode: str) -> None:
        assert mode in ("up", "slow", "down")
        if mode == "down" and self.mode != "down":
            self._stop()
        elif mode != "down" and self.mode == "down":
            self._start()
        self.mode = mode

    def _slow(self) -> None:
        if self.mode == "slow":
            time.sleep(self.delay)

    @abc.abstractmethod
    def _start(self) -> None:
        """Bind (the same port again after ``down``) and serve."""

    @abc.abstractmethod
    def _stop(self) -> None:
        """Close the listening socket."""

    def __enter__(self) -> _Receiver:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mode != "down":
            self._stop()


class HttpReceiver(_Receiver):
    """OTLP/HTTP: ``endpoint`` is the full traces URL (for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    @property
    def base_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver._slow()
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(400 if self.path == "/v1/traces" else 404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._accept(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:
                    pass  # the client gave up (slow mode)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcReceiver(_Receiver):
    """OTLP/gRPC (insecure): ``endpoint`` for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        import grpc  # here: the HTTP receiver works where grpcio is not installed
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver._slow()
                receiver._accept(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    def _stop(self) -> None:
        self._server.stop(grace=0)
