"""Slow and many clients against a scrape. Before, 8 sockets that sent a request line and then one
header byte every 2 s took every slot of the endpoint: a scrape got an empty reply, or waited 30 s,
for as long as they kept going.

Each attack runs in its own process (``testkit.hostile_clients``; its threads must not share the
endpoint's GIL), every attacker reconnects whenever it is closed, and the attack lasts ``ATTACK_S``,
far longer than the test: when the defence fails, the scrapes are refused or wait until their 30 s
timeout, and nothing else makes them slower. Each case takes 10-20 s.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
import urllib.request

import pytest

import hpar_agent
from hpar_agent.exporters import http_server
from testkit.certs import OPENSSL, make_pki

ATTACK_S = 120
#: What a scrape may wait while the attack goes on (issue 49).
ANSWER_S = 6.0


@pytest.fixture
def endpoint(monkeypatch, tmp_path):
    """attach() on a free loopback port; with ``tls=True`` over HTTPS (the attackers stall handshakes)."""

    def start(tls: bool) -> tuple[object, ssl.SSLContext | None]:
        kw = {}
        ctx = None
        if tls:
            if OPENSSL is None:
                pytest.skip("openssl CLI not installed")
            pki = make_pki(tmp_path / "pki")
            kw = {"tls_cert": pki.server.cert, "tls_key": pki.server.key}
            ctx = ssl.create_default_context(cafile=pki.ca)
        agent = hpar_agent.attach(
            metrics_port=0, metrics_addr="127.0.0.1", traces="none", run_dir=str(tmp_path), **kw
        )
        return agent, ctx

    yield start
    hpar_agent.detach()


def _attack(port: int, mode: str, n: int) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "testkit.hostile_clients",
        "--port",
        str(port),
        "--mode",
        mode,
        "-n",
        str(n),
        "--duration",
        str(ATTACK_S),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize(
    ("mode", "n", "tls"),
    [
        ("dribble", 8, False),  # the attack
        ("dribble", 200, False),  # more dribblers than the endpoint holds connections
        ("idle", 200, True),  # TLS handshakes that never start
        ("flood", 200, False),  # 200 clients scraping in a loop
    ],
)
def test_a_scrape_is_answered_within_6_s_while_clients_attack(endpoint, mode, n, tls):
    agent, ctx = endpoint(tls)
    server = agent.server
    port = int(agent.metrics_url.rsplit(":", 1)[1].split("/")[0])
    attack = _attack(port, mode, n)
    try:
        time.sleep(1.0)  # every attacker connected and, for dribblers, mid-head
        waits = []
        until = (
            time.monotonic() + http_server.HEAD_DEADLINE_S + 2
        )  # past one head deadline: cut ones are back
        while not waits or time.monotonic() < until:
            t0 = time.monotonic()
            with urllib.request.urlopen(agent.metrics_url, timeout=30, context=ctx) as resp:
                assert b"hpar_rank_info" in resp.read()
            waits.append(time.monotonic() - t0)
            time.sleep(1.0)
        assert attack.poll() is None  # the attack went on the whole time
    finally:
        attack.kill()
        attack.wait(10)
    assert max(waits) < ANSWER_S, waits
    if mode == "dribble" and n <= http_server.MAX_CONNECTIONS:
        assert server.timed_out >= n  # each dribbler was cut at the head deadline at least once
    elif mode == "flood":
        assert server.answered > 5 * len(waits)  # the flood was being served too
    else:
        assert server.evicted >= n - http_server.MAX_CONNECTIONS  # slow ones made room for the scrapes
