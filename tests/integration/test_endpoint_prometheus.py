"""The real Prometheus (Debian package) scraping the agent's endpoint secured by ``HPAR_WEB_CONFIG``:
with basic auth (over TLS) and with client certificates it scrapes; without them, or with the wrong
ones, the scrape fails and no sample of the agent reaches Prometheus.

Each job scrapes the same endpoint with different credentials (the scrape configs of
docs/configuration.md, "Securing the endpoint"); about 15 s per test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hpar_agent
from testkit.certs import OPENSSL, PKI, make_pki
from testkit.prom_stack import ALERTMANAGER, PROMETHEUS, PromStack, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(PROMETHEUS is None or ALERTMANAGER is None, reason="prometheus not installed"),
    pytest.mark.skipif(OPENSSL is None, reason="openssl CLI not installed"),
]

PASSWORD = "scrape-secret"


def _jobs(pki: PKI, pw_file: Path, wrong_file: Path) -> dict[str, dict[str, Any]]:
    ca = {"ca_file": pki.ca}
    client = {**ca, "cert_file": pki.client.cert, "key_file": pki.client.key}
    rogue = {**ca, "cert_file": pki.rogue_client.cert, "key_file": pki.rogue_client.key}
    return {
        "basic-auth": {
            "scheme": "https",
            "tls_config": ca,
            "basic_auth": {"username": "prom", "password_file": str(pw_file)},
        },
        "basic-auth-wrong": {
            "scheme": "https",
            "tls_config": ca,
            "basic_auth": {"username": "prom", "password_file": str(wrong_file)},
        },
        "basic-auth-none": {"scheme": "https", "tls_config": ca},
        "mtls": {"scheme": "https", "tls_config": client},
        "mtls-rogue": {"scheme": "https", "tls_config": rogue},
        "mtls-none": {"scheme": "https", "tls_config": ca},
        "plain-http": {"scheme": "http"},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import bcrypt

    work = tmp_path_factory.mktemp("endpoint-prom")
    pki = make_pki(work / "pki")
    pw, wrong = work / "password", work / "wrong"
    pw.write_text(PASSWORD)
    wrong.write_text(PASSWORD + "-not")
    jobs = _jobs(pki, pw, wrong)
    stack = PromStack(work / "prom", list(jobs), scrape_options=jobs)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    yield stack, pki, hashed, work
    stack.close()


def _attach(work: Path, web_config: str) -> Any:
    path = work / "web.yml"
    path.write_text(web_config)
    agent = hpar_agent.attach(
        metrics_port=0,
        metrics_addr="127.0.0.1",
        traces="none",
        run_dir=str(work / "run"),
        web_config=str(path),
    )
    assert agent.metrics_url is not None and agent.metrics_url.startswith("https://")
    return agent


def _scraped(stack: PromStack, jobs: list[str]) -> dict[str, dict[str, Any]]:
    """Each job's target once every one has been scraped at least once."""

    def check() -> dict[str, dict[str, Any]] | None:
        got = {j: stack.targets(j) for j in jobs}
        if all(t and t[0]["health"] in ("up", "down") for t in got.values()):
            return {j: t[0] for j, t in got.items()}
        return None

    return wait_for(check, 60, f"a scrape of {jobs}")


def _check(stack: PromStack, address: str, good: str, bad: dict[str, str]) -> None:
    jobs = [good, *bad]
    for job in jobs:
        stack.set_targets(job, [address])
    try:
        wait_for(
            lambda: stack.query(f'hpar_rank_info{{job="{good}"}}'), 60, f"hpar_rank_info from job {good}"
        )
        targets = _scraped(stack, jobs)
        assert targets[good]["health"] == "up", targets[good]
        for job, why in bad.items():
            assert targets[job]["health"] == "down" and why in targets[job]["lastError"], (job, targets[job])
            assert not stack.query(f'hpar_rank_info{{job="{job}"}}')
            assert stack.query(f'up{{job="{job}"}} == 0')
    finally:
        for job in jobs:
            stack.set_targets(job, [])


def test_prometheus_scrapes_with_basic_auth_and_fails_without(setup):
    stack, pki, hashed, work = setup
    agent = _attach(
        work,
        f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"basic_auth_users:\n  prom: '{hashed}'\n",
    )
    try:
        address = agent.metrics_url.split("//", 1)[1].split("/")[0]
        _check(
            stack,
            address,
            "basic-auth",
            {"basic-auth-wrong": "401", "basic-auth-none": "401", "plain-http": ""},
        )
    finally:
        hpar_agent.detach()


def test_prometheus_scrapes_with_client_certificates_and_fails_without(setup):
    stack, pki, _, work = setup
    agent = _attach(
        work,
        f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n",
    )
    try:
        address = agent.metrics_url.split("//", 1)[1].split("/")[0]
        # the handshake fails: Go reports a closed connection rather than a TLS alert, so no error text is
        # asserted; health down and no sample are what matter
        _check(stack, address, "mtls", {"mtls-rogue": "", "mtls-none": "", "plain-http": ""})
    finally:
        hpar_agent.detach()
