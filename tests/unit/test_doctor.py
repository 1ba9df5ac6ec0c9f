"""hpar-agent doctor reports what is there, what is degraded and how to fix it."""

from __future__ import annotations

import os
import socket

from hpar_agent.affinity import cpu_list
from hpar_agent.tools import doctor
from tests.unit.test_affinity import AffinityNvml


def _by_name(checks):
    return {c.name: c for c in checks}


def test_doctor_sees_torch_hooks_and_pyspy():
    checks = _by_name(doctor.run_checks())
    assert checks["torch"].status == doctor.OK
    assert checks["optimizer step hook"].status == doctor.OK
    assert checks["py-spy"].status == doctor.OK  # installed as a dependency; root can dump itself
    assert "NVML" in checks


def test_doctor_flags_a_taken_port_with_a_fix(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("HPAR_METRICS_ADDR", "127.0.0.1")
        monkeypatch.setenv("HPAR_METRICS_PORT", str(s.getsockname()[1]))
        check = _by_name(doctor.run_checks())["metrics port"]
    assert check.status == doctor.DEGRADED and "HPAR_METRICS_PORT" in check.fix


def test_doctor_flags_unreachable_otlp(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        check = _by_name(doctor.run_checks())["OTLP endpoint"]
    assert check.status == doctor.DEGRADED


def test_doctor_flags_pyspy_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(doctor.shutil, "which", lambda _name: None)
    monkeypatch.setattr(doctor.sys, "executable", str(tmp_path / "python"))  # no py-spy beside it either
    check = _by_name(doctor.run_checks())["py-spy"]
    assert check.status == doctor.MISSING and "pip install py-spy" in check.fix


BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {blocked!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Block())
from hpar_agent.tools.cli import main
sys.exit(main(["doctor", "--json"]))
"""


def _doctor_json(*blocked: str) -> tuple[int, dict, str]:
    """``hpar-agent doctor --json`` in a fresh interpreter where ``blocked`` modules cannot be imported."""
    import json
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=list(blocked))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res.returncode, json.loads(res.stdout), res.stderr


def test_doctor_json_passes_on_this_install():
    rc, doc, _ = _doctor_json()
    names = {c["name"] for c in doc["checks"] if c["required"]}
    assert rc == 0 and doc["ok"] is True and doc["missing"] == []
    assert {
        "torch",
        "numpy",
        "torch <-> numpy",
        "prometheus_client",
        "opentelemetry sdk",
        "otlp http exporter",
        "pynvml",
        "plotly",
        "torch.distributed.pipelining",
        "py-spy",
    } <= names
    assert set(NOT_IMPORTS.values()) <= names


def test_doctor_fails_when_numpy_is_missing():
    """The issue's case: torch imports without numpy, pipelining then fails on every rank."""
    rc, doc, err = _doctor_json("numpy")
    assert rc == 1 and doc["ok"] is False, err
    assert {"numpy", "torch <-> numpy"} <= set(doc["missing"])
    fix = {c["name"]: c["fix"] for c in doc["checks"]}
    assert fix["numpy"] == "pip install numpy"


def test_a_command_whose_package_is_missing_says_which():
    """compare needs numpy: without it, it names the package (exit 2) and the CLI itself still parses."""
    import subprocess
    import sys

    code = BLOCK.format(blocked=["numpy"]).replace('["doctor", "--json"]', '["compare", "a", "b"]')
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "needs numpy" in res.stderr and "Traceback" not in res.stderr


def test_doctor_reports_missing_torch_without_a_traceback():
    rc, doc, err = _doctor_json("torch")
    assert rc == 1 and "torch" in doc["missing"] and "Traceback" not in err


def test_doctor_optional_grpc_exporter_is_a_warning():
    rc, doc, _ = _doctor_json("opentelemetry.exporter.otlp.proto.grpc")
    grpc = next(c for c in doc["checks"] if c["name"] == "otlp grpc exporter")
    assert rc == 0 and grpc["status"] == doctor.DEGRADED and "hpar-agent[grpc]" in grpc["fix"]


#: Dependencies doctor checks by a dedicated check rather than an import row: distribution -> check name.
NOT_IMPORTS = {"py-spy": "py-spy", "torch": "torch"}


def _owner_of(module: str, dists: list[str]) -> str | None:
    """The distribution in ``dists`` whose RECORD lists ``module``'s file."""
    import importlib
    import importlib.metadata as md
    from pathlib import Path, PurePath

    file = Path(importlib.import_module(module).__file__ or "").resolve()
    for dist in dists:
        d = md.distribution(dist)
        root = Path(str(d.locate_file(""))).resolve()
        if root in file.parents and PurePath(file.relative_to(root)) in {PurePath(f) for f in d.files or ()}:
            return dist
    return None


def test_every_dependency_has_a_doctor_row():
    """Each distribution in pyproject's ``[project] dependencies`` is checked by doctor: a required import
    row whose module that distribution installs, or its dedicated check (a lost dependency is reported)."""
    import re
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib", reason="stdlib from Python 3.11")

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    dists = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in deps]
    covered = {_owner_of(module, dists) for _, module, _, _ in doctor.REQUIRED_IMPORTS} | set(NOT_IMPORTS)
    assert [d for d in dists if d not in covered] == []
    assert {"opentelemetry-api", "opentelemetry-exporter-otlp-proto-common"} <= covered


def test_doctor_reports_the_binding() -> None:
    mine = os.sched_getaffinity(0)
    bad = doctor._numa(AffinityNvml({max(mine) + 64}, 1))[0]
    assert bad.status == doctor.DEGRADED and "none shared" in bad.detail and "numactl" in bad.fix
    good = doctor._numa(AffinityNvml(set(mine), 0))[0]
    assert good.status == doctor.OK and f"GPU ideal CPUs {cpu_list(mine)}" in good.detail
    assert any(c.name == "NUMA binding" for c in doctor.run_checks())


def test_doctor_reads_the_settings_as_attach_does() -> None:
    """Each HPAR_* variable is checked through its setting's declaration: a bad value names what it
    should be and the default used instead; a removed or unknown name is said to be ignored."""
    env = {
        "HPAR_INTERVAL": "0",
        "HPAR_DP": "x",
        "HPAR_INTERVALL": "2",
        "HPAR_FR_READER": "inline",
        "HPAR_TRACES": "file",
        "PATH": "/bin",
    }
    (bad,) = doctor._settings(env)
    assert bad.status == doctor.DEGRADED and bad.fix
    assert "HPAR_INTERVAL='0': interval must be a finite number of seconds in 0.05..3600" in bad.detail
    assert "(the default 1.0 is used)" in bad.detail and "HPAR_DP='x'" in bad.detail
    assert "HPAR_INTERVALL (did you mean HPAR_INTERVAL?): no such setting" in bad.detail
    assert "HPAR_FR_READER: removed" in bad.detail and "HPAR_TRACES" not in bad.detail
    (good,) = doctor._settings({"HPAR_TRACES": "file", "HPAR_DP": "", "HPAR_AUTOATTACH": "1"})
    assert good.status == doctor.OK and good.detail == "HPAR_TRACES, HPAR_DP: valid"
    assert doctor._settings({})[0].detail == "none set: the defaults"
    assert "HPAR_* settings" in {c.name for c in doctor.run_checks()}


def test_doctor_shows_the_detector_thresholds_in_effect() -> None:
    env = {"HPAR_THRESHOLDS": "Straggler.max_lag_ratio=0.3,Hang.timeout_s=120"}
    (row,) = doctor._thresholds(env)
    assert row.status == doctor.OK
    assert row.detail.startswith(
        "Straggler.max_lag_ratio=0.3 (default 0.25); Hang.timeout_s=120 (default 60)"
    )
    (bad,) = doctor._settings({"HPAR_THRESHOLDS": "Straggler.max_lag_rati=0.3"})
    assert bad.status == doctor.DEGRADED and "did you mean Straggler.max_lag_ratio?" in bad.detail
    assert doctor._thresholds({})[0].detail.startswith("the defaults")
