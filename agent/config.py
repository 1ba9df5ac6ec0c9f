"""AgentConfig: one typed, keyword-only configuration.

Precedence is explicit argument > ``HPAR_*`` environment variable > default. A field of a passed
``AgentConfig`` that differs from its default counts as explicit, as does every ``attach(**overrides)``
keyword. A bad environment value is logged once and replaced by the default (training must go on); a
bad explicit value raises ``ValueError`` at attach, where the user can fix it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpar_agent.catalogue import ENV_VARS

log = logging.getLogger("hpar_agent")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
TRACE_MODES = ("auto", "otlp", "file", "none")


@dataclass(kw_only=True)
class AgentConfig:
    """Agent settings. Every field has an ``HPAR_*`` variable (see the catalogue and the README)."""

    disable: bool = False
    """Install nothing: attach() returns an inert agent."""
    metrics_port: int = 9470
    """Base port of the Prometheus endpoint (a rank serves on base + local_rank); 0 ephemeral; -1 none."""
    metrics_addr: str = "0.0.0.0"
    """Bind address of the Prometheus endpoint."""
    port_fallback: bool = True
    """When the port is taken, use the next free port instead of serving nothing."""
    tls_cert: str | None = None
    """PEM certificate: serve HTTPS. Needs ``tls_key``."""
    tls_key: str | None = None
    """PEM private key for ``tls_cert``."""
    run_dir: str = ""
    """Event log, evidence and local traces; empty means ``./hpar-runs/<job_id>``."""
    job_id: str = ""
    """Shared by all ranks; empty means torchrun's run id, else generated and shared via the store."""
    interval: float = 1.0
    """Seconds between agent-thread polls (aligned to the wall clock on every rank)."""
    fr_interval: float = 5.0
    """Seconds between full flight-recorder reads (hangs and a filling ring read earlier)."""
    trace_every: int = 10
    """Keep every Nth step's trace (slow/anomalous steps always); 0 disables tracing."""
    traces: str = "auto"
    """auto | otlp | file | none. auto: OTLP when an OTEL endpoint is set, else OTLP-JSON files."""
    event_log: bool = True
    """Write the per-rank JSONL event log into the run directory."""
    buffer_size: int = 65536
    """Capacity of each hook buffer; overflow is dropped and counted."""
    nccl_timing: bool = True
    """Time NCCL collectives (CUDA events per op): switched on for every NCCL group, existing or new."""
    detectors: bool = True
    """Run the in-process detectors."""
    evidence: bool = True
    """Collect evidence files when an alert fires."""
    dp: int | None = None
    """Data-parallel degree override (normally read from the mesh or model)."""
    tp: int | None = None
    """Tensor-parallel degree override."""
    pp: int | None = None
    """Pipeline-parallel degree override."""
    pp_stage: int | None = None
    """This rank's pipeline stage override."""
    thresholds: dict[str, float] = field(default_factory=dict)
    """Detector threshold overrides, ``{"<Alert>.<param>": value}`` (see detector docs)."""

    def __post_init__(self) -> None:
        problems = list(_problems(self))
        if problems:
            raise ValueError("invalid hpar_agent config: " + "; ".join(problems))

    @classmethod
    def load(
        cls,
        config: AgentConfig | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> AgentConfig:
        """Merge explicit values (``config`` fields that differ from defaults, then ``overrides``)
        over the environment over defaults."""
        environ = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides or {}) - names
        if unknown:
            raise ValueError(f"unknown hpar_agent option(s): {', '.join(sorted(unknown))}")
        defaults = cls()
        explicit: dict[str, Any] = {}
        if config is not None:
            explicit.update(
                {n: getattr(config, n) for n in names if getattr(config, n) != getattr(defaults, n)}
            )
        explicit.update(overrides or {})
        values: dict[str, Any] = {}
        for var in ENV_VARS:
            if var.field in explicit or var.name not in environ:
                continue
            parsed = _parse_env(var.name, environ[var.name], defaults, var.field)
            if parsed is not _INVALID:
                values[var.field] = parsed
        values.update(explicit)
        return cls(**values)


_INVALID = object()
_warned: set[str] = set()


def _parse_env(name: str, raw: str, defaults: AgentConfig, field_name: str) -> Any:
    default = getattr(defaults, field_name)
    ftype = {f.name: f.type for f in dataclasses.fields(AgentConfig)}[field_name]
    text = raw.strip()
    try:
        if "bool" in str(ftype):
            low = text.lower()
            if low in _TRUE:
                value: Any = True
            elif low in _FALSE:
                value = False
            else:
                raise ValueError("expected 1/0/true/false")
        elif "int" in str(ftype):
            value = None if text == "" and "None" in str(ftype) else int(text)
        elif "float" in str(ftype):
            value = float(text)
        else:
            value = text
        dataclasses.replace(defaults, **{field_name: value})  # __post_init__ validates the value
    except (ValueError, TypeError) as exc:
        if name not in _warned:
            _warned.add(name)
            log.warning("hpar_agent: ignoring %s=%r (%s); using the default %r", name, raw, exc, default)
        return _INVALID
    return value


def _problems(c: AgentConfig) -> list[str]:
    out = []
    if not -1 <= c.metrics_port <= 65535:
        out.append(f"metrics_port must be -1..65535, got {c.metrics_port}")
    if not c.interval > 0:
        out.append(f"interval must be > 0 seconds, got {c.interval}")
    if not c.fr_interval > 0:
        out.append(f"fr_interval must be > 0 seconds, got {c.fr_interval}")
    if c.trace_every < 0:
        out.append(f"trace_every must be >= 0, got {c.trace_every}")
    if c.traces not in TRACE_MODES:
        out.append(f"traces must be one of {TRACE_MODES}, got {c.traces!r}")
    if c.buffer_size < 1:
        out.append(f"buffer_size must be >= 1, got {c.buffer_size}")
    if bool(c.tls_cert) != bool(c.tls_key):
        out.append("tls_cert and tls_key must be given together")
    for name in ("dp", "tp", "pp"):
        v = getattr(c, name)
        if v is not None and v < 1:
            out.append(f"{name} must be >= 1, got {v}")
    if c.pp_stage is not None and c.pp_stage < 0:
        out.append(f"pp_stage must be >= 0, got {c.pp_stage}")
    return out
