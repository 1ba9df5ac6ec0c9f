"""The per-rank Prometheus endpoint, bounded so that no client can slow training or block exit.

A taken port never crashes training: with fallback on, the next free ports are tried; otherwise the
agent serves nothing and says so once.

What bounds it (prometheus_client's own server has none of these):

- the rendered exposition (text or OpenMetrics, as the scraper asks) is cached for ``CACHE_S``: a
  scrape flood costs one render per interval and format (rendering holds the GIL training needs);
- at most ``MAX_CONNECTIONS`` connections are served at once; one more is closed at once;
- every socket read and write has a ``TIMEOUT_S`` timeout and a connection lives at most
  ``DEADLINE_S`` (enforced by the accepting thread): idle or trickling clients give their slot back;
- at the cap, the oldest connection that has not yet sent its request is closed to make room, so
  idle connections cannot starve a scraper (which sends its request at once);
- responses are paced at most one per ``MIN_INTERVAL_S`` across all connections (a paced request
  sleeps, holding no GIL): a flood cannot spend the training thread's GIL on request handling, since
  each client waits for its answer before it sends again (Prometheus needs one scrape per interval);
- the TLS handshake runs in the connection's own thread with that timeout, never in ``accept()``;
- handler threads are daemons and ``close_endpoint`` does not wait for them.
"""

from __future__ import annotations

import errno
import gzip
import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from hpar_agent.config import AgentConfig

log = logging.getLogger("hpar_agent")

FALLBACK_TRIES = 32
#: Seconds a rendered exposition is served from cache (well under any scrape interval).
CACHE_S = 1.0
#: Connections served at once; more are closed on accept.
MAX_CONNECTIONS = 8
#: Seconds any single read, write or TLS handshake may take.
TIMEOUT_S = 5.0
#: Seconds a connection may live, from accept to the last byte written.
DEADLINE_S = 30.0
#: Least spacing between two responses, over all connections (at most 50 scrapes per second).
MIN_INTERVAL_S = 0.02
#: How long the accepting thread waits for the slot of an evicted idle connection.
EVICT_WAIT_S = 0.5


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = TIMEOUT_S  # StreamRequestHandler applies it to the socket
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive
    server_version = "hpar-agent"
    sys_version = ""

    def parse_request(self) -> bool:
        self.server.mark_busy(self.request)  # a complete request head: no longer evictable
        return super().parse_request()

    def do_GET(self) -> None:
        self.server.pace()
        gz = gzip_accepted(self.headers.get("Accept-Encoding", ""))
        body, content_type = self.server.exposition(self.headers.get("Accept", ""), gz)
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if gz:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

    def _not_allowed(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no per-request logging into the training's log


class MetricsServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a connection cap, per-connection TLS and a render cache."""

    daemon_threads = True
    block_on_close = False  # close_endpoint never waits for a slow client
    request_queue_size = 16

    def __init__(self, addr: tuple[str, int], registry: CollectorRegistry, tls: ssl.SSLContext | None,
                 family: int = socket.AF_INET) -> None:
        self.address_family = family
        super().__init__(addr, _Handler)
        self.socket.set_inheritable(False)
        self.registry = registry
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.renders = 0
        self.refused = 0
        self._conns: dict[Any, list[Any]] = {}  # accepted socket -> [at, no request yet, socket in use]
        self._conns_lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._cache: dict[tuple[str, bool], tuple[float, bytes]] = {}
        self._pace_lock = threading.Lock()
        self._next_slot = 0.0

    def pace(self) -> None:
        """Wait for this request's turn: responses at least ``MIN_INTERVAL_S`` apart. At most
        ``MAX_CONNECTIONS`` wait at once, so no wait exceeds their number of intervals."""
        with self._pace_lock:
            now = time.monotonic()
            turn = max(now, self._next_slot)
            self._next_slot = turn + MIN_INTERVAL_S
        if turn > now:
            time.sleep(turn - now)

    def exposition(self, accept: str, gz: bool) -> tuple[bytes, str]:
        """The registry rendered at most once per ``CACHE_S`` per format (text or OpenMetrics, which
        carries the exemplars), shared by concurrent scrapes; (body, content type)."""
        encoder, content_type = choose_encoder(accept)
        with self._render_lock:
            now = time.monotonic()
            hit = self._cache.get((content_type, gz))
            if hit is not None and now - hit[0] < CACHE_S:
                return hit[1], content_type
            plain = self._cache.get((content_type, False))
            if plain is None or now - plain[0] >= CACHE_S:
                self.renders += 1
                plain = (now, encoder(self.registry))
                self._cache = {k: v for k, v in self._cache.items() if now - v[0] < CACHE_S}
                self._cache[(content_type, False)] = plain
            if gz:
                self._cache[(content_type, True)] = (plain[0], gzip.compress(plain[1], compresslevel=1))
            return self._cache[(content_type, gz)][1], content_type

    def server_bind(self) -> None:
        import socketserver

        socketserver.TCPServer.server_bind(self)  # without HTTPServer's reverse DNS lookup
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def mark_busy(self, sock: Any) -> None:
        with self._conns_lock:
            for entry in self._conns.values():
                if entry[2] is sock:
                    entry[1] = False

    def _kill(self, sock: Any) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # the connection's thread wakes up and ends
        except OSError:
            pass

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if not self.slots.acquire(blocking=False):
            with self._conns_lock:
                idle = [(entry[0], entry[2]) for entry in self._conns.values() if entry[1]]
            if idle:
                self._kill(min(idle, key=lambda x: x[0])[1])
            if not (idle and self.slots.acquire(timeout=EVICT_WAIT_S)):
                self.refused += 1
                return False  # the base class closes the socket
        with self._conns_lock:
            self._conns[request] = [time.monotonic(), True, request]
        return True

    def service_actions(self) -> None:
        """Accepting thread, every poll: end connections past their deadline."""
        cutoff = time.monotonic() - DEADLINE_S
        with self._conns_lock:
            late = [entry[2] for entry in self._conns.values() if entry[0] < cutoff]
        for sock in late:
            self._kill(sock)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except Exception:
            self._forget(request)
            raise

    def _forget(self, request: Any) -> None:
        with self._conns_lock:
            if self._conns.pop(request, None) is not None:
                self.slots.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        raw = request
        try:
            if self.tls is not None:
                request.settimeout(TIMEOUT_S)
                request = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
                with self._conns_lock:
                    if raw in self._conns:
                        self._conns[raw][2] = request
                request.do_handshake()  # here, in the connection's thread, bounded by the timeout
            self.finish_request(request, client_address)
        except Exception:
            pass  # a client that times out, resets or fails the handshake only loses its connection
        finally:
            self.shutdown_request(request)
            self._forget(raw)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


def _tls_context(config: AgentConfig) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


def _family(addr: str) -> int:
    infos = socket.getaddrinfo(addr.strip("[]"), None, type=socket.SOCK_STREAM)
    return int(infos[0][0])


def open_endpoint(registry: CollectorRegistry, config: AgentConfig, local_rank: int) -> tuple[Any, str | None]:
    """Start the HTTP(S) server; return (server, url) or (None, None) when no port could be bound."""
    tls = _tls_context(config)  # a bad certificate raises: never fall back to plain http silently
    base = config.metrics_port
    first = 0 if base == 0 else base + local_rank
    tries = 1 if base == 0 or not config.port_fallback else FALLBACK_TRIES
    addr = config.metrics_addr.strip("[]")
    family = _family(addr)
    last_error: OSError | None = None
    for i in range(tries):
        port = first + i * (1 if base else 0)
        try:
            server = MetricsServer((addr, port), registry, tls, family)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last_error = exc
            continue
        thread = threading.Thread(target=server.serve_forever, name="hpar-metrics", daemon=True)
        thread.start()
        host, bound = str(server.server_address[0]), int(server.server_address[1])
        if i:
            log.warning("hpar_agent: metrics port %d is in use; serving on %d instead", first, bound)
        scheme = "https" if tls else "http"
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        if ":" in shown and not shown.startswith("["):
            shown = f"[{shown}]"
        url = f"{scheme}://{shown}:{bound}/metrics"
        log.info("hpar_agent: serving metrics at %s", url)
        return server, url
    log.warning(
        "hpar_agent: metrics port %d is in use (%s) and %s; no metrics endpoint on this rank "
        "(set HPAR_METRICS_PORT to a free base port)",
        first,
        last_error,
        "no free port was found after it" if config.port_fallback else "fallback is off",
    )
    return None, None


def close_endpoint(server: Any) -> None:
    server.shutdown()
    server.server_close()
