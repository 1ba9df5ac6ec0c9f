"""hpar-agent doctor reports what is there, what is degraded and how to fix it."""

from __future__ import annotations

import socket

from hpar_agent import doctor


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


def test_doctor_flags_pyspy_missing(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda _name: None)
    check = _by_name(doctor.run_checks())["py-spy"]
    assert check.status == doctor.MISSING and "pip install py-spy" in check.fix
