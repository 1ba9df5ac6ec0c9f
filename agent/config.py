"""AgentConfig: one typed, keyword-only configuration.

Precedence is explicit argument > ``HPAR_*`` environment variable > default. A field of a passed
``AgentConfig`` that differs from its default counts as explicit, as does every ``attach(**overrides)``
keyword. A bad environment value is logged once and replaced by the default (training must go on); a
bad explicit value raises ``ValueError`` at attach, where the user can fix it. The endpoint's security
files (``web_config``, ``tls_cert``, ``tls_key``) are the endpoint's to check: a problem there serves no
endpoint and never raises (``hpar_agent.exporters.endpoint_security``).
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpar_agent.catalogue import ENV_VARS, TOOL_ENV_VARS
from hpar_agent.thresholds import ANATOMY_DEFAULTS, COMPONENT_THRESHOLDS, DETECTOR_DEFAULTS

log = logging.getLogger("hpar_agent")

#: What a boolean ``HPAR_*`` variable reads as true (lower-cased, stripped).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE = {"0", "false", "no", "off", ""}
TRACE_MODES = ("auto", "otlp", "file", "none")
#: Sane bounds of the poll intervals: below 50 ms the agent thread competes with training for the GIL,
#: above an hour nothing is observed; ``inf`` would overflow the thread's wait.
INTERVAL_RANGE = (0.05, 3600.0)
FR_INTERVAL_MAX = 86400.0
#: Threshold keys of the DetectorsComponent itself (besides ``<Alert>.<param>`` of each detector).
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")
#: A job id names a directory: no separators, no "..", bounded.
_JOB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+-]{0,127}$")
#: Settings that no longer exist (field -> env var): a job that still sets one runs, told once.
REMOVED: dict[str, str] = {
    "fr_complete": "HPAR_FR_COMPLETE",
    "fr_fill": "HPAR_FR_FILL",
    "work_in_waits": "HPAR_WORK_IN_WAITS",
    "fr_reader": "HPAR_FR_READER",
    "helper_sched": "HPAR_HELPER_SCHED",
    "log_backups": "HPAR_LOG_BACKUPS",
}


@dataclass(kw_only=True)
class AgentConfig:
    """Agent settings; every field but ``thresholds`` has an ``HPAR_*`` variable (docs/configuration.md)."""

    disable: bool = False
    """Install nothing: attach() returns an inert agent."""
    metrics_port: int = 9470
    """Base port of the Prometheus endpoint (a rank serves on base + local_rank); 0 ephemeral; -1 none."""
    metrics_addr: str = "0.0.0.0"
    """Bind address of the Prometheus endpoint."""
    port_fallback: bool = True
    """When the port is taken, use the next free port instead of serving nothing."""
    web_config: str | None = None
    """Web configuration file in the Prometheus exporter-toolkit format: TLS, client certificates,
    basic auth. Asked for but invalid: the endpoint serves nothing (checked at attach, never raised)."""
    tls_cert: str | None = None
    """PEM certificate: serve HTTPS (the shorthand of ``web_config`` for TLS alone). Needs ``tls_key``."""
    tls_key: str | None = None
    """PEM private key for ``tls_cert``."""
    run_dir: str = ""
    """Event log, evidence and local traces; empty means ``./hpar-runs/<job_id>``."""
    job_id: str = ""
    """Shared by all ranks; empty means torchrun's run id, else generated and shared via the store."""
    interval: float = 1.0
    """Seconds between agent-thread polls (aligned to the wall clock on every rank)."""
    fr_interval: float = 5.0
    """Seconds between full flight-recorder reads (a stuck op reads earlier); entries the ring
    overwrote in between are counted in ``hpar_collective_unobserved_total``."""
    trace_every: int = 10
    """Keep every Nth step's trace (slow/anomalous steps always); 0 disables tracing."""
    traces: str = "auto"
    """auto | otlp | file | none. auto: OTLP when an OTEL endpoint is set, else OTLP-JSON files."""
    event_log: bool = True
    """Write the per-rank JSONL event log into the run directory."""
    detail_rate: float = 10.0
    """Steps a second that get the per-step detail (phase anatomy, pipeline chunk times, p2p timing).
    A faster loop gets it on every k-th step (a divisor or multiple of ``trace_every``, so kept traces
    stay detailed): the hooks and the agent's work per second stay bounded. Step times, counts and
    bytes still cover every step. 0: every step."""
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
    log_max_bytes: int = 64 << 20
    """Size at which the event log and the traces file rotate, keeping two rotated files (0: never)."""

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
        _warn_unknown(environ)
        for name, env_name in REMOVED.items():
            if env_name in environ or name in (overrides or {}):
                _warn_once(env_name, f"hpar_agent: the setting {env_name} / {name}= was removed; ignored")
        overrides = {k: v for k, v in (overrides or {}).items() if k not in REMOVED}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown hpar_agent option(s): {', '.join(sorted(unknown))}")
        defaults = cls()
        explicit: dict[str, Any] = {}
        if config is not None:
            explicit.update(
                {n: getattr(config, n) for n in names if getattr(config, n) != getattr(defaults, n)}
            )
        explicit.update(overrides)
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
            if low in TRUE_WORDS:
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
        problems = _field_problems(field_name, value)
        if problems:
            raise ValueError("; ".join(problems))
    except (ValueError, TypeError) as exc:
        _warn_once(name, f"hpar_agent: ignoring {name}={raw!r} ({exc}); using the default {default!r}")
        return _INVALID
    return value


def _warn_unknown(environ: Mapping[str, str]) -> None:
    """One line per process for ``HPAR_*`` names nothing reads (a typo would otherwise be silently
    ignored), each with the closest setting."""
    known = {v.name for v in ENV_VARS + TOOL_ENV_VARS} | set(REMOVED.values())
    settings = {v.name.removeprefix("HPAR_"): v.name for v in ENV_VARS}
    unknown = []
    for name in sorted(n for n in environ if n.upper().startswith("HPAR_") and n not in known):
        # matched without the shared prefix, which alone makes any two names look alike
        close = difflib.get_close_matches(name.upper()[len("HPAR_"):], settings, n=1)
        unknown.append(f"{name} (did you mean {settings[close[0]]}?)" if close else name)
    if unknown:
        _warn_once("unknown", "hpar_agent: ignoring unknown environment variable(s): " + ", ".join(unknown))


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def _types(name: str) -> tuple[tuple[type, ...], bool]:
    """(accepted types, optional) of a field, from its annotation."""
    ann = str({f.name: f.type for f in dataclasses.fields(AgentConfig)}[name])
    optional = "None" in ann
    if ann.startswith("dict"):
        return (dict,), optional
    for word, types in (("bool", (bool,)), ("int", (int,)), ("float", (int, float)), ("str", (str,))):
        if ann.startswith(word):
            return types, optional
    return (object,), optional


def _field_problems(name: str, value: Any) -> list[str]:
    """What is wrong with one field's value alone (type first, then range)."""
    types, optional = _types(name)
    if value is None and optional:
        return []
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        want = " or ".join(t.__name__ for t in types) + (" or None" if optional else "")
        return [f"{name} must be {want}, got {type(value).__name__} {value!r}"]
    v: Any = value
    out: list[str] = []
    if name == "metrics_port" and not -1 <= v <= 65535:
        out.append(f"metrics_port must be -1..65535, got {v}")
    elif name == "interval":
        lo, hi = INTERVAL_RANGE
        if not (math.isfinite(v) and lo <= v <= hi):
            out.append(f"interval must be a finite number of seconds in {lo:g}..{hi:g}, got {v}")
    elif name == "fr_interval" and not (math.isfinite(v) and 0 < v <= FR_INTERVAL_MAX):
        # reads happen on ticks: a tiny value means "read in full on every tick", never a busy loop
        out.append(f"fr_interval must be a finite number of seconds in (0, {FR_INTERVAL_MAX:g}], got {v}")
    elif name == "metrics_addr" and not _valid_host(v):
        out.append(f"metrics_addr must be an IP address or a host name, got {v!r}")
    elif name == "job_id" and v and not _JOB_ID.match(v):
        out.append(f"job_id must be 1-128 characters of letters, digits and ._:@+- (not starting with . or -), got {v!r}")
    elif name == "trace_every" and v < 0:
        out.append(f"trace_every must be >= 0, got {v}")
    elif name == "traces" and v not in TRACE_MODES:
        out.append(f"traces must be one of {TRACE_MODES}, got {v!r}")
    elif name == "detail_rate" and not (math.isfinite(v) and v >= 0):
        out.append(f"detail_rate must be a finite number of steps a second >= 0 (0: every step), got {v}")
    elif name == "buffer_size" and not 1 <= v <= 1 << 24:
        out.append(f"buffer_size must be 1..{1 << 24}, got {v}")
    elif name in ("dp", "tp", "pp") and not 1 <= v <= 1 << 20:
        out.append(f"{name} must be >= 1, got {v}")
    elif name == "pp_stage" and not 0 <= v < 1 << 20:
        out.append(f"pp_stage must be >= 0, got {v}")
    elif name == "log_max_bytes" and not (v == 0 or v >= 1024):
        out.append(f"log_max_bytes must be 0 (no cap) or >= 1024, got {v}")
    elif name == "thresholds":
        out += threshold_problems(v)
    return out


def _valid_host(v: str) -> bool:
    try:
        ipaddress.ip_address(v.strip("[]"))
        return True
    except ValueError:
        return bool(_HOSTNAME.match(v))


def threshold_problems(thresholds: Mapping[Any, Any]) -> list[str]:
    """Each key must name a detector of the catalogue and one of its parameters (``<Alert>.<param>``,
    ``detectors.<param>`` for the component, ``anatomy.<param>`` for the step anatomy's verdict; the
    table is ``hpar_agent.thresholds``), each value a finite non-negative number: a typo must
    not be ignored, and a bad value must not turn the detectors off at install."""
    if not thresholds:
        return []
    params = {alert: set(defaults) for alert, defaults in DETECTOR_DEFAULTS.items()}
    params["detectors"] = set(COMPONENT_THRESHOLDS)
    params["anatomy"] = set(ANATOMY_DEFAULTS)
    out = []
    for key, value in thresholds.items():
        alert, _, param = key.partition(".") if isinstance(key, str) else ("", "", "")
        if alert not in params or param.split(".")[0] not in params[alert]:
            known = sorted(params.get(alert, ())) if alert in params else sorted(params)
            out.append(f"unknown threshold {key!r} (known {'params' if alert in params else 'detectors'}: "
                       f"{', '.join(known)})")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(f"threshold {key} must be a number, got {type(value).__name__} {value!r}")
        elif not (math.isfinite(value) and value >= 0):
            out.append(f"threshold {key} must be finite and >= 0, got {value}")
    return out


def _problems(c: AgentConfig) -> list[str]:
    out = []
    for f in dataclasses.fields(c):
        out += _field_problems(f.name, getattr(c, f.name))
    if c.pp is not None and c.pp_stage is not None and isinstance(c.pp, int) and isinstance(c.pp_stage, int) \
            and c.pp_stage >= c.pp:
        out.append(f"pp_stage must be < pp ({c.pp}), got {c.pp_stage}")
    return out
