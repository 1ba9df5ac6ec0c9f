"""AgentConfig: one typed, keyword-only configuration, and the one declaration of every setting.

Each field is declared with ``setting()``: its default, its ``HPAR_*`` variable, its bounds (a test and
the words that say it) and its help. The loader below, the catalogue's ``ENV_VARS``, the table in
docs/configuration.md (``scripts/gen_docs.py``) and ``hpar-agent doctor`` all read that declaration,
through ``SETTINGS``. The other ``HPAR_*`` names the loader knows are here too: the ones the tools set
(``TOOL_ENV_VARS``) and the removed settings (``REMOVED``).

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
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, overload

from hpar_agent.thresholds import ANATOMY_DEFAULTS, COMPONENT_THRESHOLDS, DETECTOR_DEFAULTS, param_bounds

log = logging.getLogger("hpar_agent")

#: What a boolean ``HPAR_*`` variable reads as true (lower-cased, stripped).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE = {"0", "false", "no", "off", ""}
_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)
#: A job id names a directory: no separators, no "..", bounded.
_JOB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+-]{0,127}$")
_T = TypeVar("_T")


class Bounds(NamedTuple):
    """What a value of the right type must also be: ``valid`` tests it, ``want`` says it in words (the
    error message and the docs)."""

    valid: Callable[[Any], bool]
    want: str


def between(lo: int, hi: int) -> Bounds:
    """An integer from ``lo`` to ``hi``, both included."""
    return Bounds(lambda v: lo <= v <= hi, f"{lo}..{hi}")


def valid_host(v: str) -> bool:
    try:
        ipaddress.ip_address(v.strip("[]"))
        return True
    except ValueError:
        return bool(_HOSTNAME.match(v))


@dataclass(frozen=True)
class Setting:
    """One setting. ``setting()`` declares ``env``, ``help`` and ``bounds`` on the field; ``name``,
    ``kind``, ``optional`` and ``default`` come from the field itself (``SETTINGS``)."""

    env: str
    """Its ``HPAR_*`` variable ("" for a setting only code can set)."""
    help: str
    bounds: Bounds | None = None
    name: str = ""
    """The ``AgentConfig`` field, which is also the ``attach()`` keyword."""
    kind: type = object
    """The field's type without ``None``: bool, int, float, str or dict."""
    optional: bool = False
    """``None`` is a valid value."""
    default: Any = None

    @property
    def want(self) -> str:
        """What a valid value is, in words."""
        if self.bounds is not None:
            return self.bounds.want
        return {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "text",
            dict: "`<Alert>.<param>=value,...`",
        }.get(self.kind, "")

    def read(self, raw: str) -> Any:
        """The value of the variable's text; ``ValueError`` says what is wrong with it."""
        text = raw.strip()
        value: Any = text
        if self.kind is bool:
            if text.lower() not in TRUE_WORDS | _FALSE:
                raise ValueError("expected 1/0/true/false")
            value = text.lower() in TRUE_WORDS
        elif self.kind is int:
            value = None if text == "" and self.optional else int(text)
        elif self.kind is float:
            value = float(text)
        elif self.kind is dict:
            value = parse_thresholds(text)
        problems = self.problems(value) + (threshold_problems(value) if self.kind is dict else [])
        if problems:
            raise ValueError("; ".join(problems))
        return value

    def problems(self, value: Any) -> list[str]:
        """What is wrong with a value of this setting alone: its type first, then its bounds."""
        if value is None and self.optional:
            return []
        accepted: tuple[type, ...] = (int, float) if self.kind is float else (self.kind,)
        if not isinstance(value, accepted) or (isinstance(value, bool) and self.kind is not bool):
            want = " or ".join(t.__name__ for t in accepted) + (" or None" if self.optional else "")
            return [f"{self.name} must be {want}, got {type(value).__name__} {value!r}"]
        if self.bounds is not None and not self.bounds.valid(value):
            return [f"{self.name} must be {self.bounds.want}, got {value!r}"]
        return []


_SETTING = "hpar_setting"  # the key of a field's declaration in its metadata


@overload
def setting(default: _T, *, env: str = "", bounds: Bounds | None = None, help: str) -> _T: ...
@overload
def setting(
    *, default_factory: Callable[[], _T], env: str = "", bounds: Bounds | None = None, help: str
) -> _T: ...
def setting(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    env: str = "",
    bounds: Bounds | None = None,
    help: str,
) -> Any:
    """Declare an ``AgentConfig`` field: its default, ``HPAR_*`` variable, bounds and help."""
    meta = {_SETTING: Setting(env, help, bounds)}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class AgentConfig:
    """Agent settings, each with its ``HPAR_*`` variable (docs/configuration.md)."""

    disable: bool = setting(
        False, env="HPAR_DISABLE", help="Install nothing: attach() returns an inert agent."
    )
    metrics_port: int = setting(
        9470,
        env="HPAR_METRICS_PORT",
        bounds=between(-1, 65535),
        help="Base port of the Prometheus endpoint; a rank serves on base + local_rank (0: ephemeral, -1: no "
        "endpoint).",
    )
    metrics_addr: str = setting(
        "0.0.0.0",
        env="HPAR_METRICS_ADDR",
        bounds=Bounds(valid_host, "an IP address or a host name"),
        help="Bind address of the Prometheus endpoint.",
    )
    port_fallback: bool = setting(
        True,
        env="HPAR_METRICS_PORT_FALLBACK",
        help="When the port is taken, try the next free ports (true) or serve no endpoint (false).",
    )
    web_config: str | None = setting(
        None,
        env="HPAR_WEB_CONFIG",
        help="Web configuration file of the endpoint in the Prometheus exporter-toolkit format (TLS, client "
        "certificates, basic auth; what `promtool check web-config` checks). Asked for but invalid: no "
        "endpoint, one error, training goes on.",
    )
    tls_cert: str | None = setting(
        None,
        env="HPAR_TLS_CERT",
        help="PEM certificate file: serve /metrics over HTTPS (needs HPAR_TLS_KEY; shorthand for a web config "
        "with TLS alone).",
    )
    tls_key: str | None = setting(None, env="HPAR_TLS_KEY", help="PEM private key file for HPAR_TLS_CERT.")
    run_dir: str = setting(
        "",
        env="HPAR_RUN_DIR",
        help="Directory for the event log, evidence files and local traces (unset: `./hpar-runs/<job_id>`).",
    )
    job_id: str = setting(
        "",
        env="HPAR_JOB_ID",
        bounds=Bounds(
            lambda v: not v or bool(_JOB_ID.match(v)),
            "1-128 characters of letters, digits and ._:@+- (not starting with . or -)",
        ),
        help="Job identifier shared by all ranks (default: torchrun's run id, else generated); it names the "
        "run directory.",
    )
    interval: float = setting(
        1.0,
        env="HPAR_INTERVAL",
        # below 50 ms the agent thread competes with training for the GIL; inf would overflow its wait
        bounds=Bounds(
            lambda v: math.isfinite(v) and 0.05 <= v <= 3600, "a finite number of seconds in 0.05..3600"
        ),
        help="Seconds between agent-thread polls, at the same wall-clock instants on every rank.",
    )
    fr_interval: float = setting(
        5.0,
        env="HPAR_FR_INTERVAL",
        # reads happen on ticks: a tiny value means "read in full on every tick", never a busy loop
        bounds=Bounds(
            lambda v: math.isfinite(v) and 0 < v <= 86400, "a finite number of seconds in (0, 86400]"
        ),
        help="Seconds between full flight-recorder reads (a stuck op reads earlier); entries the ring "
        "overwrote in between are counted in hpar_collective_unobserved_total.",
    )
    trace_every: int = setting(
        10,
        env="HPAR_TRACE_EVERY",
        bounds=Bounds(lambda v: v >= 0, ">= 0"),
        help="Keep the trace of every Nth step (slow or anomalous steps are always kept; 0: no traces).",
    )
    traces: str = setting(
        "auto",
        env="HPAR_TRACES",
        bounds=Bounds(
            lambda v: v in ("auto", "otlp", "file", "none"), "one of ('auto', 'otlp', 'file', 'none')"
        ),
        help="Where spans go: auto (OTLP when OTEL_EXPORTER_OTLP_*ENDPOINT is set, else a local file), otlp, "
        "file, none.",
    )
    event_log: bool = setting(True, env="HPAR_EVENT_LOG", help="Write the per-rank JSONL event log.")
    detail_rate: float = setting(
        10.0,
        env="HPAR_DETAIL_RATE",
        bounds=Bounds(
            lambda v: math.isfinite(v) and v >= 0, "a finite number of steps a second >= 0 (0: every step)"
        ),
        help="Steps a second that get the per-step detail (phase anatomy, pipeline chunk times, p2p timing); "
        "a faster loop gets it on every k-th step, a divisor or multiple of trace_every so that kept traces "
        "stay detailed (0: every step). Step times, counts and bytes cover every step.",
    )
    buffer_size: int = setting(
        65536,
        env="HPAR_BUFFER_SIZE",
        bounds=between(1, 1 << 24),
        help="Capacity of each hook buffer; events beyond it are dropped and counted.",
    )
    nccl_timing: bool = setting(
        True,
        env="HPAR_NCCL_TIMING",
        help="Time NCCL collectives (latency, busbw, spans): switched on for every NCCL group at attach and as "
        "groups appear (false: leave TORCH_NCCL_ENABLE_TIMING to the user).",
    )
    detectors: bool = setting(True, env="HPAR_DETECTORS", help="Run the in-process detectors.")
    evidence: bool = setting(
        True,
        env="HPAR_EVIDENCE",
        help="Collect evidence (py-spy stacks, allocator snapshots, FR dumps) when an alert fires.",
    )
    dp: int | None = setting(
        None,
        env="HPAR_DP",
        bounds=between(1, 1 << 20),
        help="Override the data-parallel degree when it cannot be read from a mesh or model.",
    )
    tp: int | None = setting(
        None, env="HPAR_TP", bounds=between(1, 1 << 20), help="Override the tensor-parallel degree."
    )
    pp: int | None = setting(
        None, env="HPAR_PP", bounds=between(1, 1 << 20), help="Override the pipeline-parallel degree."
    )
    pp_stage: int | None = setting(
        None,
        env="HPAR_PP_STAGE",
        bounds=between(0, (1 << 20) - 1),
        help="Override this rank's pipeline stage (below pp).",
    )
    thresholds: dict[str, float] = setting(  # noqa: RUF009 (setting() returns a dataclasses.field)
        default_factory=dict,
        env="HPAR_THRESHOLDS",
        help="Detector parameter overrides: `Straggler.max_lag_ratio=0.3,Hang.timeout_s=120` (in code "
        '{"<Alert>.<param>": value}); every parameter, its default, type and bounds are in docs/alerts.md '
        "(thresholds); `detectors.<param>` and `anatomy.<param>` set the detectors component's and the step "
        "anatomy's.",
    )
    log_max_bytes: int = setting(
        64 << 20,
        env="HPAR_LOG_MAX_BYTES",
        bounds=Bounds(lambda v: v == 0 or v >= 1024, "0 (no cap) or >= 1024"),
        help="Size in bytes at which the event log and the traces file rotate, keeping two rotated files each "
        "(0: never); a string value in an event is cut at 16 KiB, a record at 64 KiB.",
    )

    def __post_init__(self) -> None:
        problems = _problems(self)
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
        unknown = set(overrides) - {s.name for s in SETTINGS}
        if unknown:
            raise ValueError(f"unknown hpar_agent option(s): {', '.join(sorted(unknown))}")
        explicit: dict[str, Any] = {}
        if config is not None:
            explicit.update(
                {s.name: getattr(config, s.name) for s in SETTINGS if getattr(config, s.name) != s.default}
            )
        explicit.update(overrides)
        values: dict[str, Any] = {}
        for s in SETTINGS:
            if s.env and s.name not in explicit and s.env in environ:
                try:
                    values[s.name] = s.read(environ[s.env])
                except (ValueError, TypeError) as exc:
                    message = f"ignoring {s.env}={environ[s.env]!r} ({exc}); using the default {s.default!r}"
                    _warn_once(s.env, "hpar_agent: " + message)
        values.update(explicit)
        return cls(**values)


def _declared(cls: type[Any]) -> tuple[Setting, ...]:
    """The declaration of each field of ``cls``, completed with the field's name, type and default."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(_SETTING)
        if not isinstance(declared, Setting):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
        kind, optional = hints[f.name], False
        if isinstance(kind, types.UnionType):
            rest = [a for a in typing.get_args(kind) if a is not type(None)]
            kind, optional = rest[0], len(rest) < len(typing.get_args(kind))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = typing.get_origin(kind) or kind  # dict[str, float] -> dict
        out.append(dataclasses.replace(declared, name=f.name, kind=kind, optional=optional, default=default))
    return tuple(out)


#: Every setting, in the order of ``AgentConfig``'s fields.
SETTINGS: tuple[Setting, ...] = _declared(AgentConfig)


@dataclass(frozen=True)
class EnvVar:
    """An ``HPAR_*`` variable that is not a setting: a tool sets it in the processes it starts."""

    env: str
    help: str


ENV_AUTOATTACH = "HPAR_AUTOATTACH"
ENV_DIAGNOSE_RUN = "HPAR_DIAGNOSE_RUN"
TOOL_ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        ENV_AUTOATTACH,
        "Set to 1 by `hpar-agent run` in the command it starts: zero-code mode attaches the agent in every "
        "process of the job that trains (not a setting).",
    ),
    EnvVar(
        ENV_DIAGNOSE_RUN,
        "Set by `hpar-agent diagnose` in every process it starts, so that it can stop them all (not a setting).",
    ),
)
#: Settings that no longer exist (field -> env var): a job that still sets one runs, told once.
REMOVED: dict[str, str] = {
    "fr_complete": "HPAR_FR_COMPLETE",
    "fr_fill": "HPAR_FR_FILL",
    "work_in_waits": "HPAR_WORK_IN_WAITS",
    "fr_reader": "HPAR_FR_READER",
    "helper_sched": "HPAR_HELPER_SCHED",
    "log_backups": "HPAR_LOG_BACKUPS",
}

_warned: set[str] = set()


def unknown_names(environ: Mapping[str, str]) -> list[str]:
    """The ``HPAR_*`` names in ``environ`` that nothing reads (a typo would otherwise be silently ignored),
    each with the closest setting: ``"HPAR_INTERVALL (did you mean HPAR_INTERVAL?)"``."""
    return [f"{name} (did you mean {close}?)" if close else name for name, close in _unknown(environ)]


def near_misses(environ: Mapping[str, str], names: Collection[str]) -> list[tuple[str, str]]:
    """(unknown name, setting) for each unknown ``HPAR_*`` name in ``environ`` whose did-you-mean
    match is one of ``names``: a misspelt security setting must not leave the endpoint open."""
    return [(name, close) for name, close in _unknown(environ) if close in names]


def _unknown(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    settings = {s.env.removeprefix("HPAR_"): s.env for s in SETTINGS if s.env}
    known = set(settings.values()) | {v.env for v in TOOL_ENV_VARS} | set(REMOVED.values())
    out = []
    for name in sorted(n for n in environ if n.upper().startswith("HPAR_") and n not in known):
        # matched without the shared prefix, which alone makes any two names look alike
        close = difflib.get_close_matches(name.upper()[len("HPAR_") :], settings, n=1)
        out.append((name, settings[close[0]] if close else ""))
    return out


def _warn_unknown(environ: Mapping[str, str]) -> None:
    unknown = unknown_names(environ)
    if unknown:
        _warn_once("unknown", "hpar_agent: ignoring unknown environment variable(s): " + ", ".join(unknown))


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def parse_thresholds(text: str) -> dict[str, float]:
    """``HPAR_THRESHOLDS``' text, ``<Alert>.<param>=value`` pairs separated by commas, as a dict; a
    pair without ``=`` or a value that is not a number raises ``ValueError`` naming it."""
    out: dict[str, float] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected <Alert>.<param>=value, got {pair!r}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{key.strip()} must be a number, got {value.strip()!r}") from None
    return out


def threshold_problems(thresholds: Mapping[Any, Any]) -> list[str]:
    """Each key must name a detector of the catalogue and one of its parameters (``<Alert>.<param>``,
    ``detectors.<param>`` for the component, ``anatomy.<param>`` for the step anatomy's verdict; the
    table is ``hpar_agent.thresholds``; an unknown one is named with the closest real one), each value
    a finite number within the parameter's bounds, a whole number where it counts something
    (``thresholds.param_bounds``): a typo must not be ignored, and a bad value must not turn the
    detectors off at install."""
    if not thresholds:
        return []
    params = {alert: set(defaults) for alert, defaults in DETECTOR_DEFAULTS.items()}
    params["detectors"] = set(COMPONENT_THRESHOLDS)
    params["anatomy"] = set(ANATOMY_DEFAULTS)
    every = [f"{alert}.{p}" for alert, names in params.items() for p in sorted(names)]
    out = []
    for key, value in thresholds.items():
        alert, _, param = key.partition(".") if isinstance(key, str) else ("", "", "")
        if alert not in params or param.split(".")[0] not in params[alert]:
            close = difflib.get_close_matches(str(key), every, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else "the parameters are in docs/alerts.md"
            out.append(f"unknown threshold {key!r} ({hint})")
            continue
        whole, lo, hi = param_bounds(param)
        kind = "a whole number" if whole else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(f"threshold {key} must be {kind}, got {type(value).__name__} {value!r}")
        elif not (math.isfinite(value) and lo <= value <= hi) or (whole and not float(value).is_integer()):
            upto = f"..{hi:g}" if math.isfinite(hi) else " or more"
            out.append(f"threshold {key} must be {kind} {lo:g}{upto}, got {value}")
    return out


def _problems(c: AgentConfig) -> list[str]:
    """Each setting's own problems, then what no one setting's bounds can say: the threshold keys, and
    ``pp_stage`` below ``pp``."""
    out = [p for s in SETTINGS for p in s.problems(getattr(c, s.name))]
    if isinstance(c.thresholds, dict):
        out += threshold_problems(c.thresholds)
    if isinstance(c.pp, int) and isinstance(c.pp_stage, int) and c.pp_stage >= c.pp:
        out.append(f"pp_stage must be < pp ({c.pp}), got {c.pp_stage}")
    return out
