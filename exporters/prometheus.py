"""The per-rank Prometheus endpoint: binding, the render cache, and what it says about its exposure.

A taken port never crashes training: with fallback on, the next free ports are tried; otherwise the
agent serves nothing and says so once. TLS or authentication asked for but not validly configured
(``endpoint_security``) serves nothing either, never plain HTTP in its place. The exposition is
rendered at most once per ``CACHE_S`` per format, however often it is scraped (rendering holds the
GIL training needs). The HTTP server and its bounds are in ``http_server``; with TLS or passwords it
runs in a process of its own (``secure_front``).
"""

from __future__ import annotations

import errno
import gzip
import logging
import socket
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from hpar_agent.config import AgentConfig
from hpar_agent.exporters.endpoint_security import exposure, load_security
from hpar_agent.exporters.http_server import MetricsServer
from hpar_agent.exporters.secure_front import Front

log = logging.getLogger("hpar_agent")

FALLBACK_TRIES = 32
#: Seconds a rendered exposition is served from cache (well under any scrape interval).
CACHE_S = 1.0
#: Connections the kernel queues while every held one awaits its answer.
BACKLOG = 256
_warned: set[str] = set()


class Exposition:
    """The registry rendered at most once per ``CACHE_S`` per format (text or OpenMetrics, which
    carries the exemplars) and encoding; called from the endpoint's loop only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.renders = 0
        self._cache: dict[tuple[str, bool], tuple[float, bytes]] = {}

    def __call__(self, accept: str, gz: bool) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
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


def _listen(addr: str, port: int) -> socket.socket:
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind past TIME_WAIT after a restart
        sock.bind(sockaddr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def open_endpoint(
    registry: CollectorRegistry,
    config: AgentConfig,
    local_rank: int,
    on_error: Callable[[str], None] | None = None,
) -> tuple[MetricsServer | Front | None, str | None]:
    """Start the HTTP(S) server; return (server, url) or (None, None) when no port could be bound.
    Raises ``WebConfigError`` when TLS or authentication is asked for but not validly configured.

    Plain HTTP is served by a thread of this process; TLS or passwords by the front
    (``secure_front``), a process of its own, so that handshakes and bcrypt never take training's
    CPU or GIL. ``on_error`` gets what goes wrong in the front later."""
    security = load_security(config)
    base = config.metrics_port
    first = 0 if base == 0 else base + local_rank
    tries = 1 if base == 0 or not config.port_fallback else FALLBACK_TRIES
    addr = config.metrics_addr.strip("[]")
    last_error: OSError | None = None
    for i in range(tries):
        port = first + i * (1 if base else 0)
        try:
            sock = _listen(addr, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last_error = exc
            continue
        host, bound = str(sock.getsockname()[0]), int(sock.getsockname()[1])
        try:
            risk = exposure(host, bound, security)
        except ValueError:  # not an IP address we can judge (never seen): say nothing rather than fail
            risk = None
        server: MetricsServer | Front
        if security.tls is not None or security.users:
            settings = {
                "web_config": config.web_config,
                "tls_cert": config.tls_cert,
                "tls_key": config.tls_key,
            }
            server = Front(sock, Exposition(registry), settings, on_error or _log_error)
        else:
            server = MetricsServer(sock, Exposition(registry), security)
            server.start()
        if i:
            log.warning("hpar_agent: metrics port %d is in use; serving on %d instead", first, bound)
        url = f"{'https' if security.tls else 'http'}://{url_host(host)}:{bound}/metrics"
        log.info("hpar_agent: serving metrics at %s (%s)", url, security.describe())
        if risk and risk not in _warned:
            _warned.add(risk)
            log.warning(
                'hpar_agent: %s; set HPAR_WEB_CONFIG (docs/configuration.md, "Securing the endpoint") '
                "or bind HPAR_METRICS_ADDR=127.0.0.1",
                risk,
            )
        return server, url
    log.warning(
        "hpar_agent: metrics port %d is in use (%s) and %s; no metrics endpoint on this rank "
        "(set HPAR_METRICS_PORT to a free base port)",
        first,
        last_error,
        "no free port was found after it" if config.port_fallback else "fallback is off",
    )
    return None, None


def _log_error(text: str) -> None:
    log.error("hpar_agent: %s", text)


def close_endpoint(server: MetricsServer | Front) -> None:
    server.close()
