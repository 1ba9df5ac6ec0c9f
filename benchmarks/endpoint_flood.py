"""Step time of a training-like loop while clients flood the agent's /metrics endpoint.

One process trains (a CPU matmul MLP, SGD: the agent's global optimizer hook sees every step) with the
agent attached, its endpoint on 127.0.0.1. A separate flooder process runs ``--clients`` threads that
scrape as fast as they can. Arms, interleaved in rotating order per round so machine drift hits all:

  quiet    no flood
  agent    the flood scrapes the agent's endpoint
  control  the same flood scrapes a static HTTP server in the flooder process: the cost of the
           flood's own CPU on this machine, without the agent doing any work for it

Printed per arm: median step time over rounds; ratios agent/quiet and agent/control (per round, then
the median), the scrapes served and the renders the agent did. On a machine with fewer cores than
clients + 1 the control arm is the fair baseline.

    python -m benchmarks.endpoint_flood --rounds 6 --seconds 3 --clients 8
"""

from __future__ import annotations

import argparse
import http.server
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any


def _flooder(urls: Any, arm: Any, go: Any, done: Any, counter: Any, clients: int) -> None:
    """Child process: a static server for the control arm, and ``clients`` scraping threads."""
    body = b"# static\n" * 2000

    class Static(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Static)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    urls["control"] = f"http://127.0.0.1:{srv.server_address[1]}/metrics"

    def client() -> None:
        while not done.is_set():
            if not go.wait(0.05):
                continue
            url = urls.get(arm.value.decode() if isinstance(arm.value, bytes) else arm.value)
            if not url:
                continue
            try:
                urllib.request.urlopen(url, timeout=10).read()
                with counter.get_lock():
                    counter.value += 1
            except OSError:
                pass

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    done.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0, help="per arm and round")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()

    import torch

    import hpar_agent

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                torch.nn.Linear(args.width, args.width))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, args.width)
    agent = hpar_agent.attach(model, metrics_port=0, metrics_addr="127.0.0.1", traces="none",
                              run_dir=os.path.join("hpar-runs", "endpoint-flood"))  # fmt: skip
    if agent.metrics_url is None:
        print("no metrics endpoint", file=sys.stderr)
        return 1

    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    urls = mgr.dict({"agent": agent.metrics_url, "quiet": ""})
    arm = ctx.Array("c", 16)
    go, done, counter = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_flooder, args=(urls, arm, go, done, counter, args.clients), daemon=True)
    proc.start()
    while "control" not in urls:
        time.sleep(0.05)

    def run_arm(name: str) -> tuple[float, int]:
        arm.value = name.encode()
        before = counter.value
        go.set()
        time.sleep(0.3)  # the flood is under way
        times = []
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        go.clear()
        time.sleep(0.3)
        return statistics.median(times), counter.value - before

    run_arm("quiet")  # warm-up
    arms = ["quiet", "agent", "control"]
    med: dict[str, list[float]] = {a: [] for a in arms}
    scrapes: dict[str, int] = dict.fromkeys(arms, 0)
    renders0 = agent.server.renders
    for r in range(args.rounds):
        for name in arms[r % 3:] + arms[: r % 3]:
            m, n = run_arm(name)
            med[name].append(m)
            scrapes[name] += n
    renders = agent.server.renders - renders0
    done.set()
    proc.join(10)
    hpar_agent.detach()

    for name in arms:
        print(f"{name:8s} median step {statistics.median(med[name]) * 1e3:.3f} ms  scrapes {scrapes[name]}")
    vs_quiet = [a / q for a, q in zip(med["agent"], med["quiet"], strict=True)]
    vs_control = [a / c for a, c in zip(med["agent"], med["control"], strict=True)]
    print(f"agent/quiet   median ratio {statistics.median(vs_quiet):.4f}  (min {min(vs_quiet):.4f} max {max(vs_quiet):.4f})")
    print(f"agent/control median ratio {statistics.median(vs_control):.4f}  (min {min(vs_control):.4f} max {max(vs_control):.4f})")
    print(f"agent renders during the agent arm: {renders} for {scrapes['agent']} scrapes; cores: {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
