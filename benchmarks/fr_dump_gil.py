"""How much of a full flight-recorder read holds the GIL: the in-process dump against torch's worker server.

A full read is the agent's longest hold of the GIL on a multi-rank CPU run (``rank_timeline``). This
fills the recorder with ``--entries`` gloo all-reduces (world size 1), runs a Python thread that counts
as fast as it can, and for each way of reading reports the read's wall time and the counter's rate
during it relative to its rate alone: 1.0 means the read left the GIL free, 0 that it held it.

  in-process     ``_dump_fr_trace`` (pickle, what the agent calls), then ``pickle.loads``
  in-process-json ``_dump_fr_trace_json``, then ``json.loads``
  worker-server  ``POST /handler/fr_trace_json`` to a ``_WorkerServer`` on a unix socket in this
                 process: torch builds the dump on its server thread; then ``json.loads`` here

    python -m benchmarks.fr_dump_gil --entries 2000 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpar_agent.torch_compat.fr_server import post


def measure(read: Callable[[], Any], reps: int) -> dict[str, float]:
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    time.sleep(0.05)
    walls, shares = [], []
    try:
        for _ in range(reps):
            c0, t0 = count[0], time.perf_counter()
            time.sleep(0.02)
            alone = (count[0] - c0) / (time.perf_counter() - t0)
            c0, t0 = count[0], time.perf_counter()
            entries = read()
            wall = time.perf_counter() - t0
            walls.append(wall * 1e3)
            shares.append((count[0] - c0) / wall / alone)
    finally:
        stop.set()
        t.join()
    return {"wall_ms_median": statistics.median(walls), "spinner_share_median": statistics.median(shares),
            "entries": float(entries)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=2000, help="all-reduces recorded first (the ring keeps 2,000 by default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch._C._distributed_c10d as c10d

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(16)
    for _ in range(a.entries):
        dist.all_reduce(x)
    ways: dict[str, Callable[[], Any]] = {
        "in-process": lambda: len(pickle.loads(c10d._dump_fr_trace(
            includeCollectives=True, includeStackTraces=False, onlyActive=False))["entries"]),
        "in-process-json": lambda: len(json.loads(c10d._dump_fr_trace_json(
            includeCollectives=True, onlyActive=False))["entries"]),
    }
    sock = os.path.join(tempfile.mkdtemp(prefix="hpar-fr-"), "w.sock")
    server = c10d._WorkerServer(sock) if hasattr(c10d, "_WorkerServer") else None
    if server is not None:
        ways["worker-server"] = lambda: len(json.loads(post(sock, "fr_trace_json"))["entries"])
    result: dict[str, Any] = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    try:
        for name, read in ways.items():
            read()  # the first read pays one-time costs (and a collection of the new objects)
            r = result[name] = measure(read, a.reps)
            print(f"{name:16} {r['wall_ms_median']:7.1f} ms per read, the other thread ran at "
                  f"{r['spinner_share_median']:.2f} of its rate, {r['entries']:.0f} entries", flush=True)
    finally:
        if server is not None:
            server.shutdown()
        dist.destroy_process_group()
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
