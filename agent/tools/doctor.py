"""``hpar-agent doctor``: what the agent can rely on here — ok / degraded / missing, with the fix.

A ``missing`` required check (an import the agent or the trainer needs at run time) makes the command
exit 1, so a broken install fails before a run does; ``--json`` prints the same for scripts.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat import probe

OK, DEGRADED, MISSING = "ok", "degraded", "missing"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    #: A required check that is ``missing`` fails the command (runs would fail or lose telemetry).
    required: bool = False


#: Imports the agent (a) and the reference trainer (t) make at run time: (label, module, why, fix).
REQUIRED_IMPORTS = [
    ("numpy", "numpy", "torch.distributed.pipelining (t) converts through numpy", "pip install numpy"),
    ("prometheus_client", "prometheus_client", "metrics endpoint (a)", "pip install prometheus-client"),
    ("opentelemetry api", "opentelemetry.trace", "spans (a)", "pip install opentelemetry-api"),
    ("opentelemetry sdk", "opentelemetry.sdk.trace", "spans (a)", "pip install opentelemetry-sdk"),
    (
        "otlp http exporter",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "span export (a)",
        "pip install opentelemetry-exporter-otlp-proto-http",
    ),
    (
        "otlp span encoder",
        "opentelemetry.exporter.otlp.proto.common.trace_encoder",
        "trace files (a)",
        "pip install opentelemetry-exporter-otlp-proto-common",
    ),
    (
        "otlp json files",
        "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
        "trace files (a)",
        "pip install opentelemetry-proto",
    ),
    ("protobuf json_format", "google.protobuf.json_format", "trace files (a)", "pip install protobuf"),
    ("pynvml", "pynvml", "GPU metrics (a)", "pip install nvidia-ml-py"),
    ("plotly", "plotly", "the run report (hpar-agent report)", "pip install plotly"),
    ("pyyaml", "yaml", "HPAR_WEB_CONFIG (a)", "pip install pyyaml"),
    ("bcrypt", "bcrypt", "basic auth of the metrics endpoint (a)", "pip install bcrypt"),
    ("jsonschema", "jsonschema", "reading summaries (report, compare, diagnose)", "pip install jsonschema"),
    (
        "torch.distributed.pipelining",
        "torch.distributed.pipelining",
        "pipeline stages (a, t)",
        "install a torch build with distributed support",
    ),
    (
        "torch.distributed.tensor",
        "torch.distributed.tensor.parallel",
        "tensor parallel (t)",
        "install a torch build with distributed support",
    ),
]
#: Optional imports: missing ones are ``degraded`` with the way to add them.
OPTIONAL_IMPORTS = [
    (
        "otlp grpc exporter",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
        "pip install 'hpar-agent[grpc]'",
    )
]


def _imports() -> list[Check]:
    out = []
    for table, required in ((REQUIRED_IMPORTS, True), (OPTIONAL_IMPORTS, False)):
        for label, module, why, fix in table:
            try:
                importlib.import_module(module)
            except Exception as exc:  # ImportError, or a broken install raising anything else
                status = MISSING if required else DEGRADED
                out.append(
                    Check(label, status, f"{module}: {type(exc).__name__}: {exc}"[:200], fix, required)
                )
                continue
            version = getattr(importlib.import_module(module.split(".")[0]), "__version__", "")
            out.append(Check(label, OK, f"{module} {version}".strip() + f" ({why})", required=required))
    return out


def _torch_numpy() -> list[Check]:
    """torch without numpy imports fine and fails at the first tensor.numpy() in pipelining."""
    try:
        import torch

        torch.zeros(1).numpy()
    except ImportError:
        return []  # torch itself is reported missing by _torch
    except Exception as exc:
        return [Check("torch <-> numpy", MISSING, f"{type(exc).__name__}: {exc}", "pip install numpy", True)]
    return [Check("torch <-> numpy", OK, "tensor.numpy() works", required=True)]


def _torch() -> list[Check]:
    try:
        import torch
    except ImportError:
        return [Check("torch", MISSING, "not importable", "pip install torch>=2.6", True)]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    out = [
        Check(
            "torch",
            OK if (major, minor) >= (2, 6) else DEGRADED,
            torch.__version__,
            "" if (major, minor) >= (2, 6) else "upgrade to torch >= 2.6",
            True,
        )
    ]
    cuda = torch.cuda.is_available()
    for label, path in probe.HOOKS.items():
        if "nccl" in label and not cuda:
            out.append(Check(label, OK, "not applicable: no CUDA on this machine"))
            continue
        ok = probe.resolves(path)
        fix = "" if ok else "telemetry from this hook is unavailable on this torch build"
        out.append(Check(label, OK if ok else DEGRADED, path, fix))
    size = fr.ring_entries()
    out.append(
        Check(
            "flight recorder buffer",
            DEGRADED if size == 0 else OK,
            f"TORCH_FR_BUFFER_SIZE={'default' if size is None else size}",
            "unset TORCH_FR_BUFFER_SIZE=0 to see collectives" if size == 0 else "",
        )
    )
    if not cuda:
        return out
    from hpar_agent.config import AgentConfig

    env_on = fr.nccl_timing()
    agent_on = AgentConfig.load().nccl_timing
    api = fr.can_enable_timing()
    if env_on:
        state, detail, fix = OK, "TORCH_NCCL_ENABLE_TIMING=1: every NCCL group is timed", ""
    elif agent_on and api:
        state, detail, fix = OK, "the agent switches timing on for every NCCL group (HPAR_NCCL_TIMING)", ""
    elif agent_on:
        state, detail = DEGRADED, "this torch has no ProcessGroup._enable_collectives_timing"
        fix = "set TORCH_NCCL_ENABLE_TIMING=1 before init_process_group"
    else:
        state, detail = DEGRADED, "HPAR_NCCL_TIMING=0 and TORCH_NCCL_ENABLE_TIMING unset: no NCCL durations"
        fix = "unset HPAR_NCCL_TIMING or set TORCH_NCCL_ENABLE_TIMING=1 before init_process_group"
    out.append(Check("NCCL collective timing", state, detail, fix))
    return out


def _nvml() -> list[Check]:
    try:
        import pynvml
    except ImportError:
        return []  # reported by _imports
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return [Check("NVML", OK, f"{n} GPU(s)")]
    except Exception as exc:
        return [Check("NVML", DEGRADED, f"{type(exc).__name__}: {exc}", "GPU metrics need an NVIDIA driver")]


def _numa(nvml: object = None) -> list[Check]:
    """This process's CPUs and NUMA nodes against NVML's ideal CPUs for the GPU of ``LOCAL_RANK``."""
    from hpar_agent.affinity import cpu_list, read_binding

    nv, handle = nvml, None
    try:
        if nv is None:
            import pynvml

            nv = pynvml
        nv.nvmlInit()  # type: ignore[attr-defined]
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(int(os.environ.get("LOCAL_RANK", "0")))  # type: ignore[attr-defined]
            b = read_binding(nv, handle)
        finally:
            nv.nvmlShutdown()  # type: ignore[attr-defined]
    except Exception:
        b = read_binding()
    here = f"CPUs {cpu_list(b.cpus)} (NUMA node {','.join(map(str, b.numa)) or '?'})"
    if not b.gpu_cpus:
        return [Check("NUMA binding", OK, f"{here}; GPU affinity unknown (no NVML or no GPU)")]
    gpu = f"GPU ideal CPUs {cpu_list(b.gpu_cpus)} (node {'?' if b.gpu_numa is None else b.gpu_numa})"
    if b.misbound:
        return [
            Check(
                "NUMA binding",
                DEGRADED,
                f"{here}; {gpu}: none shared",
                "bind each rank to its GPU's node: numactl --cpunodebind=N --membind=N",
            )
        ]
    return [Check("NUMA binding", OK, f"{here}; {gpu}")]


def _pyspy() -> list[Check]:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # a venv's bin/ not on PATH
    exe = shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)
    if exe is None:
        return [
            Check("py-spy", MISSING, "not on PATH", "pip install py-spy (hang/leak stack evidence)", True)
        ]
    try:
        res = subprocess.run(
            [exe, "dump", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [Check("py-spy", DEGRADED, str(exc), "check ptrace permission")]
    if res.returncode != 0:
        return [
            Check(
                "py-spy",
                DEGRADED,
                (res.stderr.strip().splitlines() or ["failed"])[-1][:120],
                "allow ptrace: run as root, or add SYS_PTRACE (containers)",
            )
        ]
    return [Check("py-spy", OK, f"{exe}; can dump this process", required=True)]


def _settings(environ: Mapping[str, str] | None = None) -> list[Check]:
    """The ``HPAR_*`` variables read through each setting's declaration, as attach reads them: a bad
    value falls back to its default and an unknown name is ignored, each with one warning; here each
    is named with what it should be. The endpoint's security settings are judged with their files
    (``_endpoint_security``), never called valid here."""
    from hpar_agent.config import REMOVED, SETTINGS, near_misses, unknown_names
    from hpar_agent.exporters.endpoint_security import NEAR_MISS_ENV, SECURITY_ENV

    env = os.environ if environ is None else environ
    problems, used, secured = [], [], []
    for s in SETTINGS:
        if s.env in SECURITY_ENV.values() and s.env in env:
            secured.append(s.env)
        elif s.env and s.env in env:
            used.append(s.env)
            try:
                s.read(env[s.env])
            except (ValueError, TypeError) as exc:
                problems.append(f"{s.env}={env[s.env]!r}: {exc} (the default {s.default!r} is used)")
    problems += [f"{name}: removed (ignored)" for name in REMOVED.values() if name in env]
    closing = {name for name, _ in near_misses(env, NEAR_MISS_ENV)}
    problems += [
        f"{name}: no such setting ({'closes the metrics endpoint' if name.split()[0] in closing else 'ignored'})"
        for name in unknown_names(env)
    ]
    seen = [f"{', '.join(used)}: valid"] if used else []
    seen += [f"{', '.join(secured)}: see metrics endpoint security"] if secured else []
    if problems:
        fix = "fix or unset them (docs/configuration.md, HPAR_* variables)"
        return [Check("HPAR_* settings", DEGRADED, "; ".join(problems), fix)]
    return [Check("HPAR_* settings", OK, "; ".join(seen) if seen else "none set: the defaults")]


def _thresholds(environ: Mapping[str, str] | None = None) -> list[Check]:
    """The detector parameters ``HPAR_THRESHOLDS`` sets, each with its default: what the detectors
    of a job started here will use (a bad value is the ``HPAR_* settings`` row's)."""
    from hpar_agent.config import parse_thresholds, threshold_problems
    from hpar_agent.thresholds import ANATOMY_DEFAULTS, COMPONENT_DEFAULTS, DETECTOR_DEFAULTS

    text = (os.environ if environ is None else environ).get("HPAR_THRESHOLDS", "")
    try:
        got = parse_thresholds(text)
    except ValueError:
        got = {}
    if not got or threshold_problems(got):
        return [Check("detector thresholds", OK, "the defaults (docs/alerts.md, thresholds)")]
    defaults = {
        **{f"{a}.{p}": v for a, params in DETECTOR_DEFAULTS.items() for p, v in params.items()},
        **{f"detectors.{p}": v for p, v in COMPONENT_DEFAULTS.items()},
        **{f"anatomy.{p}": v for p, v in ANATOMY_DEFAULTS.items()},
    }
    shown = [
        f"{k}={v:g} (default {defaults[k]:g})" if k in defaults else f"{k}={v:g}" for k, v in got.items()
    ]
    return [Check("detector thresholds", OK, "; ".join(shown) + "; the others: the defaults")]


def _port(addr: str, port: int) -> list[Check]:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            return [
                Check("metrics port", DEGRADED, f"{addr}:{port}: {exc.strerror}", "set HPAR_METRICS_PORT")
            ]
    return [Check("metrics port", OK, f"{addr}:{port} is free")]


def _endpoint_security(cfg) -> list[Check]:
    """What the endpoint would enforce, checked as attach checks it: a broken web config serves nothing."""
    from hpar_agent.exporters.endpoint_security import WebConfigError, exposure, load_security

    name = "metrics endpoint security"
    if cfg.metrics_port < 0:
        return [Check(name, OK, "no endpoint (HPAR_METRICS_PORT=-1)")]
    try:
        security = load_security(cfg)
    except WebConfigError as exc:
        return [
            Check(
                name,
                MISSING,
                f"no endpoint would be served: {exc}",
                "fix the file or the variables (docs/configuration.md, Securing the endpoint)",
                True,
            )
        ]
    try:
        host = socket.getaddrinfo(cfg.metrics_addr.strip("[]"), None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        return [
            Check(
                name, DEGRADED, f"HPAR_METRICS_ADDR={cfg.metrics_addr}: {exc}", "set an address of this host"
            )
        ]
    risk = exposure(host, max(cfg.metrics_port, 0), security)
    if risk:
        return [
            Check(
                name,
                DEGRADED,
                risk,
                "set HPAR_WEB_CONFIG (basic auth or client certificates, with TLS) "
                "or HPAR_METRICS_ADDR=127.0.0.1",
            )
        ]
    return [Check(name, OK, f"{security.describe()}; bound to {cfg.metrics_addr}")]


def _otlp() -> list[Check]:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return [Check("OTLP endpoint", OK, "none set: traces go to OTLP-JSON files in HPAR_RUN_DIR")]
    url = urllib.parse.urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    port = url.port or (443 if url.scheme == "https" else 4318)
    try:
        with socket.create_connection((url.hostname or "localhost", port), timeout=2):
            pass
    except OSError as exc:
        return [
            Check("OTLP endpoint", DEGRADED, f"{endpoint}: {exc}", "start the collector or fix the endpoint")
        ]
    return [Check("OTLP endpoint", OK, f"{endpoint} reachable")]


def run_checks() -> list[Check]:
    from hpar_agent.config import AgentConfig

    cfg = AgentConfig.load()
    sources: list[Callable[[], list[Check]]] = [
        _torch,
        _imports,
        _torch_numpy,
        _nvml,
        _numa,
        _pyspy,
        _settings,
        _thresholds,
        lambda: _port(cfg.metrics_addr, max(cfg.metrics_port, 0)),
        lambda: _endpoint_security(cfg),
        _otlp,
    ]
    checks: list[Check] = []
    for source in sources:
        try:
            checks += source()
        except Exception as exc:  # a broken check is itself a finding
            checks.append(Check(getattr(source, "__name__", "check"), DEGRADED, repr(exc)))
    return checks


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.required and c.status == MISSING]


def main(as_json: bool = False) -> int:
    """Print the checks (a table, or one JSON object); exit 1 when a required one is missing."""
    checks = run_checks()
    bad = failed(checks)
    if as_json:
        from hpar_agent._version import __version__

        doc = {
            "ok": not bad,
            "version": __version__,
            "python": sys.executable,
            "missing": [c.name for c in bad],
            "checks": [dataclasses.asdict(c) for c in checks],
        }
        print(json.dumps(doc, indent=2))
        return 1 if bad else 0
    width = max(len(c.name) for c in checks)
    for c in checks:
        line = f"{c.status:<9} {c.name:<{width}}  {c.detail}"
        if c.fix:
            line += f"  -> {c.fix}"
        print(line)
    if bad:
        print(f"doctor: required but missing: {', '.join(c.name for c in bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
