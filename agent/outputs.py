"""Where one agent's results go beside its registry: the run directory, the event log, the metrics
endpoint and tracing. Opened at attach, moved when the rank's topology changes, closed at detach, and
forgotten by a forked child."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpar_agent.config import AgentConfig
from hpar_agent.events import EventLog
from hpar_agent.safefiles import RUNS_DIR, UnsafePathError, default_run_dir, private_dir

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from hpar_agent.context import AgentContext
    from hpar_agent.exporters.otel import Tracing
    from hpar_agent.topology import Topology

log = logging.getLogger("hpar_agent")


class Outputs:
    """The run directory, the event log, the endpoint (``server``, ``metrics_url``) and ``tracing``."""

    def __init__(
        self, config: AgentConfig, record_error: Callable[[str, BaseException], None], errors: Counter[str]
    ) -> None:
        self.config = config
        self.record_error = record_error
        self._errors = errors  # the agent's error counts (a refused endpoint is counted and logged apart)
        self.run_dir = ""
        self.events = EventLog(None, 0)
        self.server: Any = None
        self.metrics_url: str | None = None
        self.tracing: Tracing | None = None

    def open_run_dir(self, job_id: str) -> None:
        """The configured run directory, else ``hpar-runs/<job id>``: private (0700, not a link, ours,
        the parent too); none at all rather than one into a planted link."""
        self.run_dir = self.config.run_dir or os.path.join(RUNS_DIR, job_id)
        try:
            if self.config.run_dir:
                private_dir(self.run_dir, chosen=True)
            else:
                default_run_dir(job_id)
        except OSError as exc:
            self.record_error("agent", exc)
            if isinstance(exc, UnsafePathError):
                self.run_dir = ""  # write no file rather than into a planted link

    def event_log(self, rank: int) -> EventLog:
        """The rank's event log in the run directory (one that writes nothing without one)."""
        if not (self.config.event_log and self.run_dir):
            return EventLog(None, rank)
        try:
            return EventLog(
                os.path.join(self.run_dir, f"events.rank{rank}.jsonl"),
                rank,
                max_bytes=self.config.log_max_bytes,
                on_error=lambda exc: self.record_error("events", exc),
            )
        except OSError as exc:
            self.record_error("events", exc)
            return EventLog(None, rank)

    def start_endpoint(self, registry: CollectorRegistry, local_rank: int) -> None:
        if self.config.metrics_port < 0:
            return
        from hpar_agent.exporters.endpoint_security import WebConfigError
        from hpar_agent.exporters.prometheus import open_endpoint

        try:
            self.server, self.metrics_url = open_endpoint(
                registry, self.config, local_rank, self._endpoint_error
            )
        except WebConfigError as exc:  # security fails closed: no endpoint rather than a weaker one
            self._errors["prometheus"] += 1
            log.error("hpar_agent: no metrics endpoint on this rank: %s (training goes on)", exc)
        except Exception as exc:
            self.record_error("prometheus", exc)

    def _endpoint_error(self, text: str) -> None:
        """What goes wrong in the endpoint's front process later (``exporters.secure_front``)."""
        self._errors["prometheus"] += 1
        log.error("hpar_agent: %s", text)

    def start_tracing(self, ctx: AgentContext) -> None:
        if self.config.traces == "none" or self.config.trace_every == 0:
            return
        try:
            from hpar_agent.exporters.otel import Tracing
        except ImportError as exc:
            self.record_error("tracing", exc)
            return
        try:
            self.tracing = Tracing(ctx)
        except Exception as exc:
            self.record_error("tracing", exc)

    def move(self, old: Topology, new: Topology, ctx: AgentContext, registry: CollectorRegistry) -> None:
        """The rank's topology changed: a new rank writes ``events.rank<R>.jsonl`` (and a local traces
        file ``traces.rank<R>.jsonl``), a new local rank serves on its port; spans built from now on
        carry the new topology."""
        if new.rank != old.rank:
            events, self.events = self.events, self.event_log(new.rank)
            self.events.recent = events.recent  # the records of this process so far, whatever file
            ctx.events = self.events
            self._guard("events", events.close)
        if new.local_rank != old.local_rank and self.server is not None:
            self.close_endpoint()
            self.metrics_url = None
            self.start_endpoint(registry, new.local_rank)
        if self.tracing is not None and not self._guard("tracing", self.tracing.retopologize, new):
            tracing, self.tracing = self.tracing, None  # a new rank's local traces file
            self._guard("tracing", tracing.shutdown, 2.0)
            self.start_tracing(ctx)

    def close_exporters(self, timeout: float) -> None:
        """At detach: the queued spans flushed within ``timeout``, then the endpoint closed (the event
        log stays open for the last records)."""
        if self.tracing is not None:
            self._guard("tracing", self.tracing.shutdown, timeout)
        self.close_endpoint()

    def close_endpoint(self) -> None:
        """Stop serving (``metrics_url`` stays: the summary written at detach says where it served)."""
        server, self.server = self.server, None
        if server is not None:
            from hpar_agent.exporters.prometheus import close_endpoint

            self._guard("prometheus", close_endpoint, server)

    def forget_in_child(self) -> None:
        """After fork, in the child: no server (the child's copy of the listening socket is closed; the
        parent keeps serving), no event log or traces file descriptor, nothing flushed of the parent's."""
        server, self.server = self.server, None
        if server is not None:
            with contextlib.suppress(Exception):
                server.socket.close()
        self.metrics_url = None
        with contextlib.suppress(Exception):
            self.events.drop_in_child()
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            with contextlib.suppress(Exception):
                tracing.forget_in_child()

    def _guard(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.record_error(component, exc)
            return None
