"""``hpar-agent doctor``: what the agent can rely on here — ok / degraded / missing, with the fix."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from hpar_agent.torch_compat import flight_recorder as fr

OK, DEGRADED, MISSING = "ok", "degraded", "missing"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _torch() -> list[Check]:
    try:
        import torch
    except ImportError:
        return [Check("torch", MISSING, "not importable", "pip install torch>=2.6")]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    out = [
        Check(
            "torch",
            OK if (major, minor) >= (2, 6) else DEGRADED,
            torch.__version__,
            "" if (major, minor) >= (2, 6) else "upgrade to torch >= 2.6",
        )
    ]
    hooks = {
        "optimizer step hook": "torch.optim.optimizer.register_optimizer_step_post_hook",
        "dynamo callbacks": "torch._dynamo.callback_handler.register_start_callback",
        "dynamo compilation metrics": "torch._dynamo.utils.get_compilation_metrics",
        "flight recorder (gloo)": "torch._C._distributed_c10d._dump_fr_trace",
        "flight recorder (nccl)": "torch._C._distributed_c10d._dump_nccl_trace",
        "pipelining": "torch.distributed.pipelining.PipelineStage",
    }
    cuda = torch.cuda.is_available()
    for label, path in hooks.items():
        if "nccl" in label and not cuda:
            out.append(Check(label, OK, "not applicable: no CUDA on this machine"))
            continue
        ok = _resolve(path)
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
    timing = fr.nccl_timing()
    out.append(
        Check(
            "NCCL collective timing",
            OK if timing else DEGRADED,
            f"TORCH_NCCL_ENABLE_TIMING={os.environ.get('TORCH_NCCL_ENABLE_TIMING', '0')}",
            "" if timing else "set TORCH_NCCL_ENABLE_TIMING=1 for NCCL durations (measure step time)",
        )
    )
    return out


def _resolve(path: str) -> bool:
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _nvml() -> list[Check]:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return [Check("NVML", OK, f"{n} GPU(s)")]
    except Exception as exc:
        return [Check("NVML", MISSING, f"{type(exc).__name__}: {exc}", "GPU metrics need an NVIDIA driver")]


def _pyspy() -> list[Check]:
    exe = shutil.which("py-spy")
    if exe is None:
        return [Check("py-spy", MISSING, "not on PATH", "pip install py-spy (hang/leak stack evidence)")]
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
    return [Check("py-spy", OK, f"{exe}; can dump this process")]


def _port(addr: str, port: int) -> list[Check]:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            return [Check("metrics port", DEGRADED, f"{addr}:{port}: {exc.strerror}", "set HPAR_METRICS_PORT")]
    return [Check("metrics port", OK, f"{addr}:{port} is free")]


def _otlp() -> list[Check]:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return [Check("OTLP endpoint", OK, "none set: traces go to OTLP-JSON files in HPAR_RUN_DIR")]
    url = urllib.parse.urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    port = url.port or (443 if url.scheme == "https" else 4318)
    try:
        with socket.create_connection((url.hostname or "localhost", port), timeout=2):
            pass
    except OSError as exc:
        return [Check("OTLP endpoint", DEGRADED, f"{endpoint}: {exc}", "start the collector or fix the endpoint")]
    return [Check("OTLP endpoint", OK, f"{endpoint} reachable")]


def run_checks() -> list[Check]:
    from hpar_agent.config import AgentConfig

    cfg = AgentConfig.load()
    sources: list[Callable[[], list[Check]]] = [
        _torch,
        _nvml,
        _pyspy,
        lambda: _port(cfg.metrics_addr, max(cfg.metrics_port, 0)),
        _otlp,
    ]
    checks: list[Check] = []
    for source in sources:
        try:
            checks += source()
        except Exception as exc:  # a broken check is itself a finding
            checks.append(Check(getattr(source, "__name__", "check"), DEGRADED, repr(exc)))
    return checks


def main() -> int:
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        line = f"{c.status:<9} {c.name:<{width}}  {c.detail}"
        if c.fix:
            line += f"  -> {c.fix}"
        print(line)
    return 0 if all(c.status != MISSING or c.name == "NVML" for c in checks) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
