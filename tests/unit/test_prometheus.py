"""The Prometheus endpoint (``exporters.prometheus``): port fallback, TLS, and hostile clients (the
handshake off the accepting thread, idle connections that neither block scrapes nor exit, a connection
cap and a render cache)."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import hpar_agent
from hpar_agent import AgentConfig
from hpar_agent.exporters import prometheus as prom
from tests.unit.conftest import train_linear


def test_port_in_use_falls_back_to_next_port(attach):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = attach(metrics_port=port)
        assert agent.metrics_url is not None
        assert f":{port}/" not in agent.metrics_url
        assert b"hpar_steps_total" in urllib.request.urlopen(agent.metrics_url, timeout=5).read()


def test_port_in_use_without_fallback_serves_nothing_and_training_goes_on(attach, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="hpar_agent"):
            agent = attach(metrics_port=port, port_fallback=False)
        assert agent.metrics_url is None
        assert "in use" in caplog.text
        train_linear(2)
        agent.tick()
        assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 2


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls_endpoint_serves_https(attach, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    agent = attach(tls_cert=str(cert), tls_key=str(key))
    assert agent.metrics_url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    body = urllib.request.urlopen(agent.metrics_url, timeout=5, context=ctx).read().decode()
    assert "hpar_rank_info" in body
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        AgentConfig(tls_cert=str(cert))


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return str(crt), str(key)


@pytest.fixture
def agent_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HPAR_METRICS_PORT", "0")
    monkeypatch.setenv("HPAR_METRICS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HPAR_TRACES", "none")
    monkeypatch.setenv("HPAR_RUN_DIR", str(tmp_path))
    yield monkeypatch
    hpar_agent.detach()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def test_tls_from_environment_serves_https_despite_idle_clients(agent_env, cert):
    agent_env.setenv("HPAR_TLS_CERT", cert[0])
    agent_env.setenv("HPAR_TLS_KEY", cert[1])
    agent = hpar_agent.attach()
    assert agent.metrics_url is not None and agent.metrics_url.startswith("https://"), agent.metrics_url
    idle = [socket.create_connection(("127.0.0.1", _port(agent.metrics_url))) for _ in range(3)]  # no handshake
    try:
        ctx = ssl.create_default_context(cafile=cert[0])
        body = urllib.request.urlopen(agent.metrics_url, timeout=10, context=ctx).read().decode()
        assert "hpar_rank_info" in body
    finally:
        for s in idle:
            s.close()


@needs_openssl
def test_idle_tls_client_does_not_block_process_exit(cert, tmp_path):
    code = textwrap.dedent(
        f"""
        import socket, hpar_agent
        a = hpar_agent.attach(metrics_port=0, metrics_addr="127.0.0.1", traces="none", run_dir={str(tmp_path)!r},
                              tls_cert={cert[0]!r}, tls_key={cert[1]!r})
        port = int(a.metrics_url.rsplit(":", 1)[1].split("/")[0])
        held = socket.create_connection(("127.0.0.1", port))  # never sends a byte, never closes
        print("attached", flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPAR_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and "attached" in out.stdout, out.stderr


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_half_open_connections_beyond_the_cap_hold_no_threads_or_fds(agent_env):
    agent = hpar_agent.attach()
    port = _port(agent.metrics_url)
    threads0, fds0 = threading.active_count(), _fds()
    n = 6 * prom.MAX_CONNECTIONS
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        body = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()  # a scraper still gets in
        assert "hpar_rank_info" in body
        time.sleep(0.2)  # let the server finish closing the refused ones
        assert threading.active_count() - threads0 <= prom.MAX_CONNECTIONS
        assert _fds() - fds0 <= n + prom.MAX_CONNECTIONS  # our n client sockets + at most the cap server-side
    finally:
        for s in held:
            s.close()


def test_flood_costs_one_render_per_cache_interval(agent_env):
    """N clients scrape as fast as they can while a training loop (optimizer hook, agent attached) runs:
    renders stay bounded by the elapsed time over the cache interval, not by the number of scrapes."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = hpar_agent.attach(model)
    url, stop, scrapes = agent.metrics_url, threading.Event(), []

    def scraper():
        while not stop.is_set():
            try:
                urllib.request.urlopen(url, timeout=10).read()
                scrapes.append(1)
            except OSError:
                pass

    threads = [threading.Thread(target=scraper) for _ in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    steps = 0
    while (steps < 50 or len(scrapes) < 100) and steps < 100_000:
        model(torch.randn(32, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    stop.set()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    renders = agent.server.renders
    assert renders <= elapsed / prom.CACHE_S + 2, (renders, len(scrapes), elapsed)
    assert len(scrapes) > renders  # most scrapes were served from the cache
    # paced: responses at least MIN_INTERVAL_S apart whatever the number of clients
    assert len(scrapes) <= elapsed / prom.MIN_INTERVAL_S + prom.MAX_CONNECTIONS + 1, (len(scrapes), elapsed)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == steps


def test_scrapers_get_the_format_and_encoding_they_ask_for(agent_env):
    """Prometheus asks for OpenMetrics (the exemplars need it) and gzip; the cache keeps formats apart."""
    import gzip

    agent = hpar_agent.attach()
    om = "application/openmetrics-text; version=1.0.0"
    req = urllib.request.Request(agent.metrics_url, headers={"Accept": om, "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.headers["Content-Encoding"] == "gzip"
        body = gzip.decompress(resp.read()).decode()
    assert body.rstrip().endswith("# EOF") and "hpar_rank_info" in body
    with urllib.request.urlopen(agent.metrics_url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        assert "# EOF" not in resp.read().decode()
    post = urllib.request.Request(agent.metrics_url, data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(post, timeout=10)
    assert err.value.code == 405


def test_a_trickling_client_is_cut_at_the_connection_deadline(agent_env, monkeypatch):
    """Bytes that keep coming never trip a read timeout; the per-connection deadline still ends it."""
    monkeypatch.setattr(prom, "DEADLINE_S", 1.0)
    agent = hpar_agent.attach()
    sock = socket.create_connection(("127.0.0.1", _port(agent.metrics_url)))
    sock.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
    closed = False
    try:
        for _ in range(200):  # up to ~60 s of trickling, one header byte at a time
            try:
                sock.sendall(b"a")
                sock.settimeout(0.3)
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
    finally:
        sock.close()
    assert closed
