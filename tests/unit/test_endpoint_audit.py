"""The endpoint's audit trail and its front process (issue 57): refused clients are counted by reason
and logged at most once a minute with the user and the peer, never the password; a secured endpoint
is served by a process of its own that ends with training."""

from __future__ import annotations

import base64
import logging
import os
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from hpar_agent.exporters.endpoint_audit import LOG_EVERY_S, Audit
from hpar_agent.exporters.secure_front import Front
from testkit.certs import OPENSSL, make_pki

pytestmark = [
    pytest.mark.skipif(OPENSSL is None, reason="openssl CLI not installed"),
    pytest.mark.timeout(180),
]
PASSWORD = "s3cret pass"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def bcrypt_hash():
    import bcrypt

    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


def test_the_audit_logs_at_most_once_a_minute_and_sums_what_it_held_back():
    now = [0.0]
    lines: list[str] = []
    audit = Audit(lines.append, clock=lambda: now[0])
    audit.refused("wrong_password", "prom", "10.0.0.7")
    assert lines == [
        "hpar_agent: metrics endpoint refused 1 client(s) (wrong password 1); the last: user 'prom' from "
        "10.0.0.7 (wrong password)"
    ]
    for i in range(5):
        now[0] += 1
        audit.refused("unknown_user", f"u{i}\n", "10.0.0.8")  # a name with a newline: escaped
        audit.refused("no_credentials", None, "10.0.0.9")
    audit.flush()
    assert len(lines) == 1  # held back
    now[0] = LOG_EVERY_S + 1
    audit.flush()
    assert lines[1] == (
        "hpar_agent: metrics endpoint refused 10 client(s) in the last 61 s (no credentials 5, unknown user 5); "
        "the last: a client at 10.0.0.9 (no credentials)"
    )
    assert audit.failures["unknown_user"] == 5 and audit.failures["wrong_password"] == 1
    audit.refused("unknown_user", "x\n", "h")
    now[0] += LOG_EVERY_S
    audit.flush()
    assert "user 'x\\n' from h" in lines[2]


def _get(url, ctx=None, auth=None):
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    return urllib.request.urlopen(req, timeout=30, context=ctx)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _sample(agent, name, **labels):
    agent.tick()
    return agent.registry.get_sample_value(name, {"rank": "0", "pp_stage": "0", **labels})


def _eventually(check, what: str, wait_s: float = 60.0):
    """The front sends its counts when they change (every 0.5 s at most): wait for them."""
    until = time.monotonic() + wait_s
    while not check():
        assert time.monotonic() < until, what
        time.sleep(0.2)


def test_refused_clients_are_counted_by_reason_and_logged_without_the_password(
    attach, tmp_path, pki, bcrypt_hash, caplog
):
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"basic_auth_users:\n  prom: '{bcrypt_hash}'\n"
    )
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = attach(web_config=str(web))
        assert isinstance(agent.server, Front)  # TLS and bcrypt run in a process of their own
        ctx = ssl.create_default_context(cafile=pki.ca)
        for auth, times in (
            (None, 2),
            (_basic("prom", "wrong " + PASSWORD), 3),
            (_basic("mallory", PASSWORD), 1),
        ):
            for _ in range(times):
                with pytest.raises(urllib.error.HTTPError) as err:
                    _get(agent.metrics_url, ctx, auth)
                assert err.value.code == 401
        with _get(agent.metrics_url, ctx, _basic("prom", PASSWORD)) as resp:
            assert resp.status == 200 and b"hpar_endpoint_auth_failures_total" in resp.read()
        name = "hpar_endpoint_auth_failures_total"
        want = {"no_credentials": 2, "wrong_password": 3, "unknown_user": 1, "no_client_certificate": 0}
        _eventually(
            lambda: all(_sample(agent, name, reason=r) == n for r, n in want.items()), "the refusals counted"
        )
        assert _sample(agent, "hpar_endpoint_connections_evicted_total") == 0
        assert _sample(agent, "hpar_endpoint_connections_timed_out_total") == 0
    said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(said) == 1 and "a client at 127.0.0.1 (no credentials)" in said[0], said
    assert not [r for r in caplog.records if PASSWORD in r.getMessage() or "wrong " in r.getMessage()]


def test_a_client_without_its_certificate_is_counted(attach, tmp_path, pki):
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
    )
    agent = attach(web_config=str(web))
    for pair in (None, pki.rogue_client):
        ctx = ssl.create_default_context(cafile=pki.ca)
        if pair is not None:
            ctx.load_cert_chain(pair.cert, pair.key)
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            _get(agent.metrics_url, ctx).read()
    name = "hpar_endpoint_auth_failures_total"
    _eventually(
        lambda: (
            _sample(agent, name, reason="no_client_certificate") == 1
            and _sample(agent, name, reason="bad_client_certificate") == 1
        ),
        "the refused certificates counted",
    )


FRONT_PID = textwrap.dedent(
    """
    import sys, hpar_agent
    agent = hpar_agent.attach(metrics_port=0, metrics_addr="127.0.0.1", traces="none", run_dir=sys.argv[1],
                              tls_cert=sys.argv[2], tls_key=sys.argv[3])
    print(agent.server.proc.pid, flush=True)
    sys.stdin.read()
    """
)


def test_the_front_ends_when_the_training_process_is_killed(tmp_path, pki):
    proc = subprocess.Popen(
        [sys.executable, "-c", FRONT_PID, str(tmp_path), pki.server.cert, pki.server.key],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        front = int(proc.stdout.readline())
        os.kill(front, 0)  # running
    finally:
        proc.kill()
        proc.wait(30)

    def gone() -> bool:
        try:
            os.kill(front, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{front}/stat") as f:  # a zombie of a reaper that is not ours counts as gone
            return f.read().split(")")[-1].split()[0] == "Z"

    _eventually(gone, "the front outlived its training process")


def test_a_front_that_dies_is_counted_and_named_once(attach, pki, caplog):
    import signal

    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        agent = attach(tls_cert=pki.server.cert, tls_key=pki.server.key)
        assert agent.server.ready.wait(60)
        os.kill(agent.server.proc.pid, signal.SIGKILL)
        labels = {"component": "prometheus"}
        _eventually(
            lambda: _sample(agent, "hpar_agent_errors_total", **labels) == 1, "the lost front counted"
        )
    said = [r.getMessage() for r in caplog.records if "front process ended" in r.getMessage()]
    assert len(said) == 1 and f"exit status {-signal.SIGKILL}" in said[0], said
