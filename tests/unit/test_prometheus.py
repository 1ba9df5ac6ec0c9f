"""The Prometheus endpoint (``exporters.prometheus``, ``exporters.http_server``): port fallback, TLS,
methods, and hostile clients (idle connections that neither block scrapes nor exit, a connection cap
and a render cache). Slow and many clients against a scrape: test_endpoint_clients.py."""

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
from hpar_agent.exporters import http_server
from hpar_agent.exporters import prometheus as prom
from testkit.certs import self_signed
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
    pair = self_signed(tmp_path)
    cert, key = pair.cert, pair.key
    agent = attach(tls_cert=str(cert), tls_key=str(key))
    assert agent.metrics_url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    body = urllib.request.urlopen(agent.metrics_url, timeout=5, context=ctx).read().decode()
    assert "hpar_rank_info" in body


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    pair = self_signed(tmp_path_factory.mktemp("tls"))
    return pair.cert, pair.key


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
    idle = [
        socket.create_connection(("127.0.0.1", _port(agent.metrics_url))) for _ in range(3)
    ]  # no handshake
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
    threads0, fds0 = set(threading.enumerate()), _fds()  # earlier tests' threads may end meanwhile
    n = 3 * http_server.MAX_CONNECTIONS
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        body = (
            urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
        )  # a scraper still gets in
        assert "hpar_rank_info" in body
        assert agent.server.evicted > 0  # idle ones made room for it
        assert set(threading.enumerate()) <= threads0  # connections cost no thread
        # our n client sockets + at most the cap (and the one being accepted) server-side
        assert _fds() - fds0 <= n + http_server.MAX_CONNECTIONS + 2
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
    renders = agent.server.render.renders
    assert renders <= elapsed / prom.CACHE_S + 2, (renders, len(scrapes), elapsed)
    assert len(scrapes) > renders  # most scrapes were served from the cache
    # paced: responses at least MIN_INTERVAL_S apart whatever the number of clients
    assert len(scrapes) <= elapsed / http_server.MIN_INTERVAL_S + 1, (len(scrapes), elapsed)
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


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
    return out


def test_get_and_head_are_answered_every_other_method_gets_405(agent_env):
    """As docs/configuration.md says: GET and HEAD on any path; any other method a clean 405 with
    ``Allow``, TRACE and unknown methods included; a request that is not HTTP/1.x a 400."""
    agent = hpar_agent.attach()
    port = _port(agent.metrics_url)
    get = _raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head = _raw(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert get.startswith(b"HTTP/1.1 200 ") and b"hpar_rank_info" in get
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # headers only
    length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
    assert length and int(length[0].split(b":")[1]) > 0  # the GET body's length
    for method in (
        b"POST",
        b"PUT",
        b"DELETE",
        b"PATCH",
        b"OPTIONS",
        b"TRACE",
        b"CONNECT",
        b"PROPFIND",
        b"BREW",
    ):
        out = _raw(port, method + b" /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
        assert out.startswith(b"HTTP/1.1 405 "), (method, out[:80])
        assert b"\r\nAllow: GET, HEAD\r\n" in out and b"hpar_" not in out
    for bad in (b"GET /metrics\r\n\r\n", b"\x16\x03\x01 garbage\r\n\r\n", b"G=T / HTTP/1.1\r\n\r\n"):
        assert _raw(port, bad).startswith(b"HTTP/1.1 400 ")


def test_a_trickling_client_is_cut_at_the_head_deadline(agent_env, monkeypatch):
    """Bytes that keep coming never trip a read timeout; the deadline on the whole head still ends it."""
    monkeypatch.setattr(http_server, "HEAD_DEADLINE_S", 1.0)
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
