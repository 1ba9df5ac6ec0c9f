"""Files the agent and its tools open must not block them, and a security setting that is set but empty
or misspelt closes the endpoint (issue 57). A FIFO named as the web config, a certificate, a key or a
CA used to block ``attach()`` (and ``hpar-agent doctor``) until something wrote to it: no step ran.

Every case that could block runs under a timeout, in a subprocess or with ``pytest.mark.timeout``, so
that a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpar_agent.tools import doctor
from testkit.certs import OPENSSL, make_pki
from tests.unit.conftest import train_linear

pytestmark = [
    pytest.mark.skipif(OPENSSL is None, reason="openssl CLI not installed"),
    pytest.mark.timeout(120),
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _fifo(path: Path) -> str:
    os.mkfifo(path)  # no writer: a blocking open waits forever
    return str(path)


def _web(tmp_path: Path, pki, **paths: str) -> str:
    keys = {"cert_file": pki.server.cert, "key_file": pki.server.key, **paths}
    lines = [f"  {k}: {v}" for k, v in keys.items()]
    if "client_ca_file" in keys:
        lines.append("  client_auth_type: RequireAndVerifyClientCert")
    path = tmp_path / "web.yml"
    path.write_text("tls_server_config:\n" + "\n".join(lines) + "\n")
    return str(path)


def _refused(caplog, attach, says: list[str], **kw) -> None:
    """attach() returns, serves nothing, logs one error saying each of ``says``; training goes on."""
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = attach(**kw)
    assert agent.started and agent.metrics_url is None and agent.server is None
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and all(s in errors[0] for s in says), errors
    train_linear(2)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 2


@pytest.mark.parametrize(
    "which", ["web_config", "cert_file", "key_file", "client_ca_file", "tls_cert", "tls_key"]
)
def test_a_fifo_in_place_of_any_security_file_is_named_and_never_blocks(which, attach, tmp_path, pki, caplog):
    fifo = _fifo(tmp_path / f"{which}.pem")
    if which == "web_config":
        kw = {"web_config": fifo}
    elif which in ("tls_cert", "tls_key"):
        kw = {"tls_cert": pki.server.cert, "tls_key": pki.server.key, which: fifo}
    else:
        extra = {"client_ca_file": pki.ca} if which == "client_ca_file" else {}
        kw = {"web_config": _web(tmp_path, pki, **{**extra, which: fifo})}
    _refused(caplog, attach, [fifo, "is a FIFO, not a regular file", "no metrics endpoint"], **kw)


def test_a_socket_in_place_of_the_web_config_is_named(attach, tmp_path, caplog):
    import socket

    path = tmp_path / "web.yml"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        _refused(caplog, attach, [str(path), "is a socket, not a regular file"], web_config=str(path))


@pytest.mark.parametrize("var", ["HPAR_WEB_CONFIG", "HPAR_TLS_CERT", "HPAR_TLS_KEY"])
def test_a_security_setting_set_but_empty_closes_the_endpoint(var, attach, monkeypatch, caplog):
    monkeypatch.setenv(var, "")  # used to serve plain HTTP without authentication
    _refused(caplog, attach, [f"{var} is set but empty"])


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("HPAR_WEB_CONF", "HPAR_WEB_CONFIG"),
        ("HPAR_TLS_CRT", "HPAR_TLS_CERT"),
        ("HPAR_METRICS_ADR", "HPAR_METRICS_ADDR"),
    ],
)
def test_a_misspelt_security_setting_closes_the_endpoint_naming_both(
    typo, meant, attach, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv(typo, str(tmp_path / "web.yml"))  # used to be warned, then plain HTTP on 0.0.0.0
    _refused(caplog, attach, [typo, f"did you mean {meant}?"])
    settings = {c.name: c for c in doctor.run_checks()}["HPAR_* settings"]
    assert f"{typo} (did you mean {meant}?): no such setting (closes the metrics endpoint)" in settings.detail


@pytest.mark.parametrize("addr", ["", "not a host!"])
def test_an_invalid_bind_address_closes_the_endpoint_instead_of_serving_every_interface(
    addr, attach, monkeypatch, caplog
):
    monkeypatch.setenv("HPAR_METRICS_ADDR", addr)  # used to be warned, then served on 0.0.0.0
    _refused(caplog, attach, ["HPAR_METRICS_ADDR=", "serves nothing rather than on every interface"])


def test_doctor_says_a_fifo_web_config_is_a_fifo_and_returns(tmp_path):
    env = {**os.environ, "HPAR_WEB_CONFIG": _fifo(tmp_path / "web.yml")}
    res = subprocess.run(
        [sys.executable, "-m", "hpar_agent", "doctor"], env=env, capture_output=True, text=True, timeout=90
    )
    assert "is a FIFO, not a regular file" in res.stdout + res.stderr, res.stdout + res.stderr


def test_doctor_never_calls_a_security_setting_valid_beside_its_error(monkeypatch, tmp_path):
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: /nonexistent\n")
    monkeypatch.setenv("HPAR_WEB_CONFIG", str(web))
    checks = {c.name: c for c in doctor.run_checks()}
    assert "key_file is missing" in checks["metrics endpoint security"].detail
    assert "HPAR_WEB_CONFIG: valid" not in checks["HPAR_* settings"].detail
    assert "HPAR_WEB_CONFIG: see metrics endpoint security" in checks["HPAR_* settings"].detail


TRAIN = textwrap.dedent(
    """
    import torch
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    print("trained", flush=True)
    """
)


def test_hpar_agent_run_with_fifos_for_the_web_config_and_a_state_file_trains_and_ends(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    _fifo(run_dir / "state.rank1")  # what hpar-agent run reads back at the end of the run
    env = {
        **os.environ,
        "HPAR_WEB_CONFIG": _fifo(tmp_path / "web.yml"),
        "HPAR_METRICS_PORT": "0",
        "HPAR_METRICS_ADDR": "127.0.0.1",
        "HPAR_TRACES": "none",
    }
    cmd = [
        sys.executable,
        "-m",
        "hpar_agent",
        "run",
        "--run-dir",
        str(run_dir),
        "--",
        sys.executable,
        "-c",
        TRAIN,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "trained" in res.stdout, out
    assert "is a FIFO, not a regular file" in out and "no metrics endpoint" in out, out


def test_fifos_named_like_the_run_directorys_files_never_block_attach_or_training(attach, tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    for name in ("events.rank0.jsonl", "traces.rank0.jsonl", "state.rank0"):
        _fifo(run_dir / name)
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = attach(run_dir=str(run_dir), traces="file")
        train_linear(3)
        agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 3
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "events.rank0.jsonl is a FIFO, not a regular file" in said, said
