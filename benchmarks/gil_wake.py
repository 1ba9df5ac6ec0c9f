"""How late a thread that wakes at a chosen instant gets the GIL back, against what the training thread runs.

The agent's paced passes (``hpar_agent.gil``) sleep to shared instants of the wall clock so that every
rank's slice of the GIL falls at the same time (a synchronous job stalls with its slowest rank). A
slice starts when the agent thread has the GIL again: at once when the training thread is inside a
torch op (ops release the GIL), up to the interpreter's switch interval (5 ms) when it runs pure Python.
Each line is one workload on a second thread; the figure is the wake latency of a 10 ms sleep on this
thread beyond its 10 ms, with ``--switch-ms`` also with the switch interval lowered while it sleeps.

    python -m benchmarks.gil_wake --seconds 1.5 --switch-ms 0.1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch


def wake_latency_ms(work: Callable[[], None], seconds: float, switch_ms: float = 0.0) -> list[float]:
    """Sorted wake latencies (ms) of 10 ms sleeps while ``work`` runs in a loop on another thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    default = sys.getswitchinterval()
    lats = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if switch_ms:
                sys.setswitchinterval(switch_ms / 1e3)
            t0 = time.perf_counter()
            time.sleep(0.01)
            lats.append((time.perf_counter() - t0 - 0.01) * 1e3)
            sys.setswitchinterval(default)
    finally:
        sys.setswitchinterval(default)
        stop.set()
        t.join()
    return sorted(lats)


def workloads() -> dict[str, Callable[[], None]]:
    """Idle, pure Python, eager ops, and DTensor ops on a one-rank gloo mesh."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29573")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    da, db = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()])

    def python() -> None:
        total = 0
        for i in range(1000):
            total += i

    return {
        "idle": lambda: time.sleep(0.001),
        "python": python,
        "eager ops": lambda: [torch.mm(x, w) for _ in range(100)] and None,
        "dtensor ops": lambda: [torch.mm(da, db).relu() for _ in range(20)] and None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.5, help="per workload and setting")
    ap.add_argument("--switch-ms", type=float, default=0.0, help="also with this switch interval while sleeping")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, switch interval {sys.getswitchinterval() * 1e3:g} ms")
    for name, work in workloads().items():
        for sw in (0.0, a.switch_ms) if a.switch_ms else (0.0,):
            lats = wake_latency_ms(work, a.seconds, sw)
            label = f"{name}, switch {sw:g} ms" if sw else name
            print(f"{label:28} wake latency ms: median {statistics.median(lats):.3f} "
                  f"p90 {lats[int(0.9 * len(lats))]:.3f} max {lats[-1]:.3f} ({len(lats)} sleeps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
