"""Reads at the ring's turnover on a real backend: every collective counted and timed, none lost.

The agent attached with its defaults (full reads in the reader process where the host allows, a wake
between passes for each turnover read, ``HPAR_FR_FILL``), one rank over NCCL (``--device cuda``) or gloo,
a small flight-recorder ring (``--ring``) and a steady stream of small all-reduces (``--rate`` a second
for ``--seconds``, ``--pause`` seconds after the group is made), so the ring turns over every
``ring / rate`` seconds, well inside a pass. Then the
agent's own summary: all-reduces counted against those issued, timed ones (NCCL), entries the ring
overwrote unread (``unobserved``: must be none; and how many by the end of each second, to tell a
late first read from a steady loop's), full reads by reason, and agent errors.

    python -m benchmarks.fr_turnover --device cuda --json fr-turnover.json
    python -m benchmarks.fr_turnover --device cpu --rate 600 --seconds 10   # gloo
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run(device: str, ring: int, rate: float, seconds: float, batch: int, pause: float) -> dict[str, Any]:
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(ring)  # read when the group is created, below
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import torch
    import torch.distributed as dist

    import hpar_agent

    run_dir = tempfile.mkdtemp(prefix="hpar-turnover-")
    agent = hpar_agent.attach(metrics_port=-1, traces="none", run_dir=run_dir)  # before the group, as users do
    coll = agent.component("collectives") if agent is not None else None
    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=dev if cuda else None)  # fmt: skip
    x = torch.ones(1024, device=dev)
    time.sleep(pause)  # between the group and the loop: a model built and compiled
    issued, t0, lost_at, mark = 0, time.monotonic(), [], 1.0
    while (now := time.monotonic()) - t0 < seconds:
        if now - t0 >= mark:  # when entries went unread: at the start, or in the steady loop
            lost_at.append(sum(coll.unobserved.values()) if coll is not None else None)
            mark += 1.0
        ahead = issued - (now - t0) * rate  # collectives issued beyond the steady rate
        if ahead > 0:
            time.sleep(ahead / rate)
            continue
        for _ in range(batch):
            dist.all_reduce(x)
        issued += batch
        if cuda:
            torch.cuda.synchronize()  # a step's end
    wall = time.monotonic() - t0
    time.sleep(1.5)  # the watchdog stamps the last entries' durations
    hpar_agent.detach()  # the final read
    dist.destroy_process_group()
    summary = json.loads(Path(run_dir, "summary.rank0.json").read_text())
    coll = summary["components"]["collectives"]
    counted = sum(n for key, n in coll["ops"].items() if key.endswith("/all_reduce"))
    timed = sum(r["timed"] for r in coll["table"] if r["op"] == "all_reduce")
    res = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "ring": ring, "rate_per_s": round(issued / wall, 1), "seconds": round(wall, 1), "issued": issued,
        "counted": counted, "timed": timed, "unobserved": coll["unobserved"],
        "full_reads_by": coll["full_reads_by"], "reader": coll["reader"], "errors": summary.get("errors"),
        "turnovers": round(issued / ring, 1), "unobserved_by_second": lost_at,
    }  # fmt: skip
    res["ok"] = counted == issued and not any(coll["unobserved"].values()) and not summary.get("errors")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--ring", type=int, default=1000, help="TORCH_FR_BUFFER_SIZE")
    ap.add_argument("--rate", type=float, default=2000.0, help="all-reduces a second")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=20, help="all-reduces between the pacing checks (a 'step')")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds between the group's creation and the loop (0: at full rate at once)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = run(a.device, a.ring, a.rate, a.seconds, a.batch, a.pause)
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
