"""Training step time while 200 clients scrape a secured endpoint in a loop (issue 57).

A process trains a small MLP on CPU (one intra-op thread, steps of 1-2 ms) with the agent attached
and its endpoint secured by a web config; another process runs ``--clients`` threads that each
connect over TLS, GET /metrics and close, in a loop (with ``tls+auth`` they send no credentials and
get 401). Windows without and with the flood alternate (``--rounds`` of each, ``--seconds`` long,
the first ``SETTLE_S`` of each left out); the training step's p50/p90/p99 are printed side by side,
with a legitimate scrape's latency (valid credentials, one a second, during the flood) and the share
of a core the endpoint's threads ran in the training process during the flood (read through each
thread's own CPU clock: what the endpoint took from training, however loaded the machine is).

Servers (``--servers``): ``front`` (the agent as shipped: TLS and bcrypt in a process of its own)
and ``inprocess`` (the same bounded server on a thread of the training process, as before the front:
for comparison only).

    python -m benchmarks.endpoint_flood --rounds 3 --seconds 6 --clients 200
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import finish, results, title

SETTLE_S = 0.5
PASSWORD = "bench pass"


# ------------------------------------------------------------------------------------ the trainer
def train(a: argparse.Namespace) -> None:
    """The training process: attach, print the URL, step until stdin closes, write the step times."""
    import torch

    import hpar_agent

    torch.set_num_threads(1)
    port = 0 if a.server == "front" else -1  # -1: no endpoint of the agent's own; the one below
    agent = hpar_agent.attach(
        metrics_port=port, metrics_addr="127.0.0.1", traces="none", run_dir=a.run_dir, web_config=a.web
    )
    url = agent.metrics_url
    if a.server == "inprocess":  # the server on a thread of this process, as before the front
        from hpar_agent.config import AgentConfig
        from hpar_agent.exporters.endpoint_security import load_security
        from hpar_agent.exporters.http_server import MetricsServer
        from hpar_agent.exporters.prometheus import Exposition, _listen

        sock = _listen("127.0.0.1", 0)
        server = MetricsServer(sock, Exposition(agent.registry), load_security(AgentConfig(web_config=a.web)))
        server.start()
        url = f"https://127.0.0.1:{server.address[1]}/metrics"
    print(url, flush=True)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    steps: list[tuple[float, float]] = []
    cpu: list[tuple[float, float]] = []  # (time, CPU seconds of the endpoint's threads in this process)

    def sample() -> None:
        while not stop.wait(0.25):
            cpu.append((time.time(), _endpoint_cpu()))

    threading.Thread(target=sample, daemon=True).start()
    while not stop.is_set():
        t0 = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        steps.append((time.time(), time.perf_counter() - t0))
    Path(a.out).write_text(json.dumps({"steps": steps, "cpu": cpu}))
    hpar_agent.detach()


def _endpoint_cpu() -> float:
    """CPU seconds the endpoint's threads of this process ran (``hpar-metrics*``: the server's loop and
    bcrypt worker in-process, the feed thread with the front), each through its own CPU clock."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith("hpar-metrics") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # ended meanwhile
                pass
    return total


# ------------------------------------------------------------------------------------ the flood
def _flood(port: int, ca: str, clients: int, seconds: float) -> subprocess.Popen[str]:
    """``testkit.hostile_clients`` flooding over TLS, once every client is under way."""
    cmd = [sys.executable, "-m", "testkit.hostile_clients", "--port", str(port), "--mode", "flood"]
    cmd += ["-n", str(clients), "--duration", str(seconds), "--ca", ca]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _scrape(url: str, ca: str, auth: str | None) -> float:
    ctx = ssl.create_default_context(cafile=ca)
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=60, context=ctx) as resp:
        assert b"hpar_rank_info" in resp.read()
    return time.monotonic() - t0


def _pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def run_case(
    a: argparse.Namespace, tmp: Path, pki: Any, web: str, server: str, auth: str | None
) -> dict[str, Any]:
    out = tmp / f"steps-{server}-{Path(web).stem}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.endpoint_flood",
        "train",
        "--web",
        web,
        "--server",
        server,
        "--out",
        str(out),
        "--run-dir",
        str(tmp / "run"),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    url = proc.stdout.readline().strip()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    _scrape(url, pki.ca, auth)  # the endpoint answers
    time.sleep(2.0)  # warm-up steps
    windows: list[tuple[str, float, float]] = []
    legit: list[float] = []
    served = failed = 0
    flood_s = 0.0
    for _ in range(a.rounds):
        for arm in ("quiet", "flood"):
            flood = _flood(port, pki.ca, a.clients, a.seconds) if arm == "flood" else None
            t0 = time.time()
            while time.time() - t0 < a.seconds:
                if flood is not None:
                    try:
                        legit.append(_scrape(url, pki.ca, auth))
                    except OSError as exc:  # refused or cut: a failed scrape, counted
                        print(f"legitimate scrape failed: {exc!r}", file=sys.stderr)
                        failed += 1
                time.sleep(1.0)
            windows.append((arm, t0 + SETTLE_S, time.time()))
            if flood is not None:
                said, _ = flood.communicate(timeout=120)  # the clients stop at the window's end
                counts = json.loads(said.strip().splitlines()[-1])
                served += counts["answers"] + counts["denied"]
                flood_s += time.time() - t0
    proc.stdin.close()
    proc.wait(120)
    data = json.loads(out.read_text())
    steps, cpu = data["steps"], data["cpu"]
    by_arm: dict[str, list[float]] = {"quiet": [], "flood": []}
    cpu_s = {"quiet": 0.0, "flood": 0.0}
    wall_s = {"quiet": 0.0, "flood": 0.0}
    for arm, lo, hi in windows:
        by_arm[arm] += [s for t, s in steps if lo <= t <= hi]
        inside = [c for t, c in cpu if lo <= t <= hi]
        inside_t = [t for t, _ in cpu if lo <= t <= hi]
        if len(inside) > 1:
            cpu_s[arm] += inside[-1] - inside[0]
            wall_s[arm] += inside_t[-1] - inside_t[0]
    row: dict[str, Any] = {
        "server": server,
        "config": Path(web).stem,
        "flood_answers_per_s": served / flood_s,
    }
    for arm, xs in by_arm.items():
        row[arm] = {
            "n": len(xs),
            "p50_ms": _pct(xs, 50) * 1e3,
            "p90_ms": _pct(xs, 90) * 1e3,
            "p99_ms": _pct(xs, 99) * 1e3,
        }
    row["p90_ratio"] = row["flood"]["p90_ms"] / row["quiet"]["p90_ms"]
    # the endpoint's threads' share of a core in the training process, flooded: what it took from training
    row["endpoint_cpu_share"] = {arm: cpu_s[arm] / wall_s[arm] if wall_s[arm] else 0.0 for arm in cpu_s}
    row["legit_scrape_s"] = {
        "median": statistics.median(legit) if legit else float("nan"),
        "max": max(legit, default=float("nan")),
        "n": len(legit),
        "failed": failed,
    }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    t = sub.add_parser("train")
    t.add_argument("--web", required=True)
    t.add_argument("--server", choices=("front", "inprocess"), default="front")
    t.add_argument("--out", required=True)
    t.add_argument("--run-dir", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--servers", default="front,inprocess")
    ap.add_argument("--configs", default="tls,tls+auth")
    ap.add_argument("--pki", help="a directory of testkit.certs.make_pki's files (made there when empty)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.cmd == "train":
        train(a)
        return 0
    import bcrypt

    from testkit.certs import PKI, Pair, make_pki

    usable = len(os.sched_getaffinity(0))  # taskset -c 0,1 ...: a 2-core host on a larger one
    r = results(
        "endpoint_flood", "cpu", argv, clients=a.clients, rounds=a.rounds, seconds=a.seconds, cpus=usable
    )
    tmp = Path(tempfile.mkdtemp(prefix="hpar-endpoint-flood-"))
    d = Path(a.pki).resolve() if a.pki else tmp / "pki"
    if (d / "server.key").exists():  # made before (where there is no openssl CLI)
        server = Pair(str(d / "server.pem"), str(d / "server.key"))
        pki = PKI(str(d / "ca.pem"), server, server, server)
    else:
        pki = make_pki(d)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    tls = f"tls_server_config:\n  cert_file: {pki.server.cert}\n  key_file: {pki.server.key}\n"
    texts = {"tls": tls, "tls+auth": tls + f"basic_auth_users:\n  prom: '{hashed}'\n"}
    good = "Basic " + base64.b64encode(f"prom:{PASSWORD}".encode()).decode()
    rows = []
    for config in a.configs.split(","):
        web = tmp / f"{config.replace('+', '-')}.yml"
        web.write_text(texts[config])
        for server in a.servers.split(","):
            rows.append(run_case(a, tmp, pki, str(web), server, good if "auth" in config else None))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    r["rows"] = rows
    finish(r, a.json)
    print(title(r, f"training step under {a.clients} TLS scrapers in a loop, on {usable} usable cores"))
    print(
        f"{'config':10} {'server':10} {'p90 quiet':>10} {'p90 flood':>10} {'ratio':>6} {'p99 quiet':>10} "
        f"{'p99 flood':>10} {'scrape med':>10} {'scrape max':>10} {'failed':>6} {'flood ans/s':>11} {'endpoint CPU':>12}"
    )
    for row in rows:
        q, f = row["quiet"], row["flood"]
        print(
            f"{row['config']:10} {row['server']:10} {q['p90_ms']:8.2f}ms {f['p90_ms']:8.2f}ms {row['p90_ratio']:5.2f}x "
            f"{q['p99_ms']:8.2f}ms {f['p99_ms']:8.2f}ms {row['legit_scrape_s']['median']:9.2f}s "
            f"{row['legit_scrape_s']['max']:9.2f}s {row['legit_scrape_s']['failed']:6d} "
            f"{row['flood_answers_per_s']:11.0f} {row['endpoint_cpu_share']['flood'] * 100:11.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
