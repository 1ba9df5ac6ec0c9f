"""The reader process's CPU per full flight-recorder read: a whole gloo ring dumped through torch's
worker server (the JSON the reader gets), then decoded and run through the ledger as the reader does.

Two arms, interleaved, at three cursor positions (every entry new, half new, none new): the dump parsed
whole, and parsed from the ledger's cursor on (``fr_server.decode``'s ``first_id``, what the reader
does). Both must give the same update (counts, cursor, kept entries). Also the worker server's own CPU
per dump (its threads' ``schedstat``, Linux), which the training process pays beside the agent thread.
World size 1 over gloo; the ring holds ``TORCH_FR_BUFFER_SIZE`` entries (torch's default 2,000).

    python -m benchmarks.reader_decode --reps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.rank_timeline import thread_cpu
from hpar_agent.collectors.fr_ledger import Ledger
from hpar_agent.torch_compat import fr_server


def server_cpu_ns() -> int:
    """CPU ns so far of torch's worker-server threads in this process (``rank_timeline``'s accounting)."""
    return thread_cpu(threading.get_native_id()).get("worker server", 0)


def one_read(body: bytes, handler: str, cursor: int, from_cursor: bool) -> tuple[float, Any]:
    """CPU ms of one read's decoding and ledger pass, and its update."""
    t0 = time.process_time()
    led = Ledger(attach_ns=0, cursors={"gloo": cursor})
    data = fr_server.decode(handler, body, led.wanted_from("gloo") if from_cursor else None)
    upd = led.process("gloo", data, nccl_timing=False, now_ns=time.time_ns())
    return (time.process_time() - t0) * 1e3, upd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collectives", type=int, default=3000, help="all-reduces run before the dumps")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(8)
    for _ in range(a.collectives):
        dist.all_reduce(x)
    server = fr_server.DumpServer(["gloo"])
    try:
        handler, query = server.handlers["gloo"]
        fr_server.post(server.path, handler, query)  # warm
        c0, dumps = server_cpu_ns(), 10
        for _ in range(dumps):
            body = fr_server.post(server.path, handler, query)
        dump_ms = (server_cpu_ns() - c0) / dumps / 1e6
    finally:
        server.close()
        dist.destroy_process_group()
    ids = [e["record_id"] for e in fr_server.decode(handler, body)["entries"]]
    out: dict[str, Any] = {"entries": len(ids), "json_bytes": len(body), "server_cpu_ms_per_dump": dump_ms,
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "reads": {}}
    print(f"{len(ids)} entries, {len(body)} bytes of JSON; torch's worker server: {dump_ms:.1f} ms of CPU a dump")
    for label, cursor in (("all new", ids[0]), ("half new", ids[len(ids) // 2]), ("none new", ids[-1] + 1)):
        times: dict[bool, list[float]] = {False: [], True: []}
        ups: dict[bool, Any] = {}
        for rep in range(a.reps):
            for arm in (False, True) if rep % 2 == 0 else (True, False):
                ms, ups[arm] = one_read(body, handler, cursor, arm)
                times[arm].append(ms)
        same = all(getattr(ups[False], k) == getattr(ups[True], k) for k in ("counts", "cursor", "kept", "unobserved"))
        whole, tail = statistics.median(times[False]), statistics.median(times[True])
        out["reads"][label] = {"whole_ms": whole, "from_cursor_ms": tail, "same_update": same}
        print(f"  {label:9}: parsed whole {whole:6.1f} ms, from the cursor {tail:6.1f} ms of the reader's CPU; "
              f"same update: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["same_update"] for r in out["reads"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
