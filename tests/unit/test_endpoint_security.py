"""The endpoint's TLS and authentication (``exporters.endpoint_security``, ``exporters.basic_auth``):
asked for but not fully and validly configured serves nothing, logs one error and training goes on;
a valid web configuration (the exporter-toolkit format, as ``promtool check web-config`` reads it)
enforces basic auth and client certificates for real."""

from __future__ import annotations

import base64
import logging
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import hpar_agent
from hpar_agent.exporters.endpoint_security import Security, WebConfigError, exposure, load_security
from hpar_agent.tools import doctor
from testkit.certs import OPENSSL, make_pki
from tests.unit.conftest import train_linear

PROMTOOL = shutil.which("promtool")
PASSWORD = "s3cret pass"

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def encrypted_key(pki, tmp_path_factory):
    out = tmp_path_factory.mktemp("enc") / "server-encrypted.key"
    subprocess.run(
        [OPENSSL, "pkey", "-in", pki.server.key, "-aes256", "-passout", "pass:x", "-out", str(out)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(out)


@pytest.fixture(scope="module")
def bcrypt_hash():
    import bcrypt

    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


def _web_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return str(path)


def _tls(pki, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n{extra}"


def _promtool_accepts(path: str) -> bool:
    res = subprocess.run([PROMTOOL, "check", "web-config", path], capture_output=True, text=True, timeout=60)
    return res.returncode == 0


# name -> (web config text with {cert} {key} {ca} {hash}, what the error says, promtool accepts it too)
BAD_CONFIGS = {
    "cert without key": ("tls_server_config:\n  cert_file: {cert}\n", "key_file is missing", False),
    "missing cert file": (
        "tls_server_config:\n  cert_file: /nonexistent/c.pem\n  key_file: {key}\n",
        "cannot be read",
        False,
    ),
    "encrypted key": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {enc_key}\n",
        "is encrypted",
        False,
    ),
    "cert and key that do not match": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {client_key}\n",
        "do not load",
        False,
    ),
    "bad bcrypt hash": ("basic_auth_users:\n  prom: not-a-hash\n", "not a bcrypt hash", False),
    "unknown client_auth_type": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireSomething\n",
        "unknown client_auth_type",
        False,
    ),
    "unknown key": (
        "basic_auth_users:\n  prom: '{hash}'\nbasic_auth_user:\n  x: '{hash}'\n",
        "unknown key basic_auth_user",
        False,
    ),
    "client CA without a client auth policy": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_ca_file: {ca}\n",
        "checks no client certificate",
        False,
    ),
    "unknown min_version": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS14\n",
        "unknown min_version",
        False,
    ),
    "duplicate key": (
        "basic_auth_users:\n  prom: '{hash}'\nbasic_auth_users:\n  other: '{hash}'\n",
        "appears twice",
        False,
    ),
    "not YAML": ("basic_auth_users: [\n", "not valid YAML", False),
    # stricter than the toolkit: these would serve less than the file suggests
    "empty file": ("", "is empty", True),
    "empty tls_server_config": (
        "tls_server_config: {{}}\nbasic_auth_users:\n  prom: '{hash}'\n",
        "is empty",
        True,
    ),
    "empty basic_auth_users": ("basic_auth_users: {{}}\n", "is empty", True),
    "verified client certificates without a CA": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAndVerifyClientCert\n",
        "needs client_ca_file",
        True,
    ),
    "any client certificate, unverified": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAnyClientCert\n"
        "  client_ca_file: {ca}\n",
        "authenticates no one",
        True,
    ),
    "a toolkit key hpar-agent does not implement": (
        "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
        "cipher_suites is not supported",
        None,
    ),
}


def _fill(text: str, pki, hashed: str, enc_key: str) -> str:
    return text.format(
        cert=pki.server.cert,
        key=pki.server.key,
        client_key=pki.client.key,
        ca=pki.ca,
        hash=hashed,
        enc_key=enc_key,
    )


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_web_config_serves_nothing_logs_one_error_and_training_goes_on(
    case, attach, tmp_path, pki, bcrypt_hash, encrypted_key, caplog
):
    text, says, promtool_accepts = BAD_CONFIGS[case]
    path = _web_config(tmp_path, _fill(text, pki, bcrypt_hash, encrypted_key))
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = attach(web_config=path)  # never raises
    assert agent.metrics_url is None and agent.server is None
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and says in errors[0].getMessage(), [r.getMessage() for r in errors]
    assert "no metrics endpoint" in errors[0].getMessage()
    train_linear(2)
    agent.tick()
    labels = {"rank": "0", "pp_stage": "0"}
    assert agent.registry.get_sample_value("hpar_steps_total", labels) == 2
    assert (
        agent.registry.get_sample_value("hpar_agent_errors_total", {**labels, "component": "prometheus"}) == 1
    )
    if PROMTOOL and promtool_accepts is not None:
        # the same file through Prometheus' own validator: refused by both, or accepted by promtool where
        # hpar-agent is stricter on purpose (docs/configuration.md lists those)
        assert _promtool_accepts(path) is promtool_accepts


@pytest.mark.parametrize(
    "env",
    [
        {"HPAR_TLS_CERT": "{cert}"},  # without the key: used to serve plain HTTP after a warning
        {"HPAR_TLS_KEY": "{key}"},
        {"HPAR_TLS_CERT": "/nonexistent/cert.pem", "HPAR_TLS_KEY": "{key}"},
        {"HPAR_WEB_CONFIG": "/nonexistent/web.yml"},
        {"HPAR_WEB_CONFIG": "{web}", "HPAR_TLS_CERT": "{cert}", "HPAR_TLS_KEY": "{key}"},
    ],
)
def test_half_configured_tls_from_the_environment_serves_nothing(env, monkeypatch, tmp_path, pki, caplog):
    web = _web_config(tmp_path, _tls(pki))
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(cert=pki.server.cert, key=pki.server.key, web=web))
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = hpar_agent.attach(
            metrics_port=0, metrics_addr="127.0.0.1", traces="none", run_dir=str(tmp_path)
        )
    try:
        assert agent.started and agent.metrics_url is None
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "no metrics endpoint" in errors[0], errors
        assert not any("plain" in r.getMessage() or "without TLS" in r.getMessage() for r in caplog.records)
    finally:
        hpar_agent.detach()


def test_explicit_half_pair_does_not_raise(attach, pki):
    agent = attach(tls_cert=pki.server.cert)
    assert agent.started and agent.metrics_url is None


@pytest.mark.parametrize(
    "extra",
    [
        "",
        "  min_version: TLS13\n",
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {ca}\n",
        "  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {ca}\n",
    ],
)
def test_good_web_configs_load_and_promtool_agrees(extra, tmp_path, pki, bcrypt_hash):
    path = _web_config(
        tmp_path, _tls(pki, extra.format(ca=pki.ca)) + f"basic_auth_users:\n  prom: '{bcrypt_hash}'\n"
    )
    security = load_security(hpar_agent.AgentConfig(web_config=path))
    assert security.tls is not None and set(security.users) == {"prom"}
    if PROMTOOL:
        assert _promtool_accepts(path)


def test_relative_paths_are_the_config_files(tmp_path, pki):
    d = tmp_path / "conf"
    d.mkdir()
    for src, name in ((pki.server.cert, "s.pem"), (pki.server.key, "s.key"), (pki.ca, "ca.pem")):
        shutil.copy(src, d / name)
    path = _web_config(
        d,
        "tls_server_config:\n  cert_file: s.pem\n  key_file: s.key\n"
        "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n",
    )
    assert load_security(hpar_agent.AgentConfig(web_config=path)).client_certs == "required"


def _get(url: str, ctx: ssl.SSLContext | None = None, auth: str | None = None, method: str = "GET"):
    headers = {"Authorization": auth} if auth else {}
    req = urllib.request.Request(url, headers=headers, method=method)
    return urllib.request.urlopen(req, timeout=10, context=ctx)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth_refuses_missing_and_wrong_credentials(attach, tmp_path, bcrypt_hash):
    agent = attach(web_config=_web_config(tmp_path, f"basic_auth_users:\n  prom: '{bcrypt_hash}'\n"))
    url = agent.metrics_url
    for auth in (
        None,
        _basic("prom", "wrong"),
        _basic("nobody", PASSWORD),
        "Basic !!!",
        "Bearer abc",
        _basic("prom", PASSWORD + "x"),
        _basic("prom", ""),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(url, auth=auth)
        assert err.value.code == 401, auth
        assert err.value.headers["WWW-Authenticate"].startswith("Basic")
        assert b"hpar_" not in err.value.read()
    for _ in range(2):  # the second one from the remembered password
        with _get(url, auth=_basic("prom", PASSWORD)) as resp:
            assert resp.status == 200 and b"hpar_rank_info" in resp.read()
    with pytest.raises(urllib.error.HTTPError) as err:  # remembered good password, other user: still bcrypt
        _get(url, auth=_basic("other", PASSWORD))
    assert err.value.code == 401
    with _get(url, auth=_basic("prom", PASSWORD), method="HEAD") as resp:
        assert resp.status == 200 and resp.read() == b""
    with pytest.raises(urllib.error.HTTPError) as err:  # HEAD unauthenticated: 401, and no body either
        _get(url, method="HEAD")
    assert err.value.code == 401 and err.value.read() == b""
    with pytest.raises(urllib.error.HTTPError) as err:  # authenticated, wrong method
        _get(url, auth=_basic("prom", PASSWORD), method="DELETE")
    assert err.value.code == 405


def test_client_certificates_are_required_and_verified(attach, tmp_path, pki):
    agent = attach(
        web_config=_web_config(
            tmp_path,
            _tls(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"),
        )
    )
    assert agent.metrics_url.startswith("https://127.0.0.1:")

    def ctx(pair=None) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=pki.ca)
        if pair is not None:
            c.load_cert_chain(pair.cert, pair.key)
        return c

    with _get(agent.metrics_url, ctx(pki.client)) as resp:
        assert b"hpar_rank_info" in resp.read()
    for refused in (ctx(), ctx(pki.rogue_client)):  # no certificate; one signed by another CA
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _get(agent.metrics_url, refused).read()
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP on the TLS port gets nothing
        urllib.request.urlopen(agent.metrics_url.replace("https", "http"), timeout=10).read()


def test_optional_client_certificates_are_verified_when_given(attach, tmp_path, pki):
    agent = attach(
        web_config=_web_config(
            tmp_path, _tls(pki, f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki.ca}\n")
        )
    )
    plain = ssl.create_default_context(cafile=pki.ca)
    with _get(agent.metrics_url, plain) as resp:
        assert resp.status == 200
    rogue = ssl.create_default_context(cafile=pki.ca)
    rogue.load_cert_chain(pki.rogue_client.cert, pki.rogue_client.key)
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        _get(agent.metrics_url, rogue).read()


def test_min_version_is_enforced(attach, tmp_path, pki):
    agent = attach(web_config=_web_config(tmp_path, _tls(pki, "  min_version: TLS13\n")))
    old = ssl.create_default_context(cafile=pki.ca)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        _get(agent.metrics_url, old).read()
    with _get(agent.metrics_url, ssl.create_default_context(cafile=pki.ca)) as resp:
        assert resp.status == 200


# --------------------------------------------------------------------------------- honest exposure
def test_exposure_names_what_the_network_gets():
    basic = Security(users={"prom": b"$2b$04$" + b"x" * 53})  # never checked here
    mtls = Security(tls=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), client_certs="required")
    assert exposure("127.0.0.1", 9470, Security()) is None and exposure("::1", 9470, Security()) is None
    assert "anyone" in exposure("0.0.0.0", 9470, Security()) and "clear text" in exposure(
        "0.0.0.0", 9470, Security()
    )
    assert "[::]:9470 (all interfaces)" in exposure("::", 9470, Security())
    assert "10.0.0.5:9470 (10.0.0.5)" in exposure("10.0.0.5", 9470, Security())
    assert "passwords in clear text" in exposure("0.0.0.0", 9470, basic)
    assert exposure("0.0.0.0", 9470, mtls) is None
    tls_only = Security(tls=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    assert "over TLS and without authentication" in exposure("0.0.0.0", 9470, tls_only)


def test_the_agent_shows_the_address_it_binds_and_warns_once(attach, caplog):
    with caplog.at_level(logging.INFO, logger="hpar_agent"):
        agent = attach(metrics_addr="0.0.0.0")
    assert agent.metrics_url.startswith("http://0.0.0.0:")  # not 127.0.0.1: every interface is served
    port = agent.metrics_url.rsplit(":", 1)[1].split("/")[0]
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "anyone" in r.getMessage()
    ]
    assert len(warnings) == 1 and f"0.0.0.0:{port}" in warnings[0] and "HPAR_WEB_CONFIG" in warnings[0]


def test_loopback_gets_no_warning(attach, caplog):
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        attach(metrics_addr="127.0.0.1")
    assert not [r for r in caplog.records if "anyone" in r.getMessage()]


def test_doctor_reports_exposure_and_a_broken_web_config(monkeypatch, tmp_path, pki, bcrypt_hash):
    def check():
        return {c.name: c for c in doctor.run_checks()}["metrics endpoint security"]

    monkeypatch.setenv("HPAR_METRICS_ADDR", "0.0.0.0")
    assert check().status == doctor.DEGRADED and "anyone" in check().detail
    monkeypatch.setenv(
        "HPAR_WEB_CONFIG", _web_config(tmp_path, "tls_server_config:\n  cert_file: /nonexistent\n")
    )
    bad = check()
    assert bad.status == doctor.MISSING and bad.required and "key_file is missing" in bad.detail
    good = _tls(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n")
    monkeypatch.setenv("HPAR_WEB_CONFIG", _web_config(tmp_path, good))
    assert check().status == doctor.OK and "client certificates required" in check().detail
    monkeypatch.delenv("HPAR_WEB_CONFIG")
    monkeypatch.setenv("HPAR_METRICS_ADDR", "127.0.0.1")
    assert check().status == doctor.OK


def test_load_security_without_settings_is_plain_http():
    assert load_security(hpar_agent.AgentConfig()) == Security()
    with pytest.raises(WebConfigError, match="not both"):
        load_security(hpar_agent.AgentConfig(web_config="w.yml", tls_cert="c", tls_key="k"))
