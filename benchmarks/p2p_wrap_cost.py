"""What the pipeline's p2p wrappers cost the training thread per call, measured side by side.

``torch_compat.p2p.P2PWrapper`` wraps the schedules' ``_batch_p2p`` / ``_wait_batch_p2p``: on gloo it is
the only source of pipeline traffic, and py-spy put its frames at about half of the agent's share of a
4-rank CPU job's training thread (BENCHMARKS.md, "Eleventh session"). This times one batch-and-wait of
``--ops`` real ``dist.P2POp`` objects (a world-size-1 gloo group; the helpers themselves are stand-ins
that return finished Works, so only the wrappers' own work differs) bare and wrapped, in interleaved
blocks (draining the records every ``--drain`` calls, as the agent thread does once a pass), and prints
the median of the wrapped-minus-bare differences per call.

    python -m benchmarks.p2p_wrap_cost --ops 2 --calls 20000 --blocks 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpar_agent.buffer import BoundedBuffer
from hpar_agent.torch_compat.p2p import P2PWrapper


class _Work:
    """A finished Work, as the schedule's wait finds a send that completed long ago."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _helpers(n_ops: int) -> tuple[Any, Any]:
    works = [_Work() for _ in range(n_ops)]

    def batch_p2p(ops: Any, desc: str | None = None) -> list[_Work]:
        return list(works)

    def wait_batch_p2p(work: list[_Work]) -> None:
        for w in work:
            w.wait()

    return batch_p2p, wait_batch_p2p


def _time(batch: Any, wait: Any, ops: list[Any], calls: int, drain: int, buf: BoundedBuffer[Any]) -> float:
    """Per call; the buffer is drained every ``drain`` calls, as the agent thread drains it once a pass."""
    t0 = time.perf_counter_ns()
    for i in range(calls):
        wait(batch(ops))
        if i % drain == 0:
            buf.drain()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=2, help="P2POps a batch")
    ap.add_argument("--calls", type=int, default=20000, help="batch-and-wait calls a block")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--drain", type=int, default=250,
                    help="calls between drains (the agent's pass: ~1 s of the 4-rank CPU job's ~11 batches a step)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        ops = [dist.P2POp(dist.isend if i % 2 == 0 else dist.irecv, torch.zeros(64, 32), 0, group)
               for i in range(a.ops)]  # fmt: skip
        buf: BoundedBuffer[tuple[Any, ...]] = BoundedBuffer("p2p", 1 << 30)
        wrapper = P2PWrapper(buf.put, lambda exc: None)
        wrapper.active = True
        bare = _helpers(a.ops)
        wrapped = (wrapper.wrap_batch(bare[0]), wrapper.wrap_wait(bare[1]))
        diffs = []
        for _ in range(a.blocks):
            t_bare = _time(*bare, ops, a.calls, a.drain, buf)
            t_wrapped = _time(*wrapped, ops, a.calls, a.drain, buf)
            diffs.append(t_wrapped - t_bare)
    finally:
        dist.destroy_process_group()
    res = {"ops": a.ops, "calls": a.calls, "blocks": a.blocks, "drain": a.drain, "torch": torch.__version__,
           "overhead_us_median": statistics.median(diffs), "overhead_us": diffs}  # fmt: skip
    print(f"p2p wrappers, {a.ops} ops a batch: {res['overhead_us_median']:.2f} µs a batch-and-wait over the bare "
          f"helpers (median of {a.blocks} blocks; min {min(diffs):.2f}, max {max(diffs):.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
