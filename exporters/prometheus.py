"""The per-rank Prometheus endpoint: prometheus_client's server on base port + local rank.

A taken port never crashes training: with fallback on, the next free ports are tried; otherwise the
agent serves nothing and says so once.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from hpar_agent.config import AgentConfig

log = logging.getLogger("hpar_agent")

FALLBACK_TRIES = 32


def open_endpoint(registry: CollectorRegistry, config: AgentConfig, local_rank: int) -> tuple[Any, str | None]:
    """Start the HTTP(S) server; return (server, url) or (None, None) when no port could be bound."""
    base = config.metrics_port
    first = 0 if base == 0 else base + local_rank
    tries = 1 if base == 0 or not config.port_fallback else FALLBACK_TRIES
    last_error: OSError | None = None
    for i in range(tries):
        port = first + i * (1 if base else 0)
        try:
            server, _thread = start_http_server(
                port,
                addr=config.metrics_addr,
                registry=registry,
                certfile=config.tls_cert,
                keyfile=config.tls_key,
            )
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last_error = exc
            continue
        host, bound = str(server.server_address[0]), int(server.server_address[1])
        if i:
            log.warning("hpar_agent: metrics port %d is in use; serving on %d instead", first, bound)
        scheme = "https" if config.tls_cert else "http"
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
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
