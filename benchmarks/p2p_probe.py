"""What the NCCL flight recorder records for ``batch_isend_irecv`` (the pipelining schedules' p2p), raw.

Timing is switched on through the agent's own path (``ProcessGroup._enable_collectives_timing`` after
init, no TORCH_NCCL_ENABLE_TIMING), then a few batches run and rank 0 writes the raw entries' fields
the agent decodes to ``<out>/p2p_fr.json``: the evidence for how p2p entries and their ``coalesced``
entry are labelled and timed.

    torchrun --nproc-per-node 2 benchmarks/p2p_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from hpar_agent.torch_compat import flight_recorder as fr

FIELDS = (
    "record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name",
    "is_p2p", "input_sizes", "input_dtypes", "output_sizes", "state", "duration_ms", "retired",
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.pop("TORCH_NCCL_ENABLE_TIMING", None)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    timed = [fr.enable_timing(pg) for pg in fr.process_groups()]
    peer = (rank + 1) % world
    src = (rank - 1) % world
    send = torch.ones(1 << 20, device="cuda")
    recv = torch.empty(1 << 20, device="cuda")
    for _ in range(3):
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, src)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    dist.all_reduce(send)
    torch.cuda.synchronize()
    time.sleep(1.0)  # the watchdog retires entries with their durations
    if rank == 0:
        data = fr.dump("nccl")
        entries = [{k: e.get(k) for k in FIELDS} for e in data.get("entries", [])]
        with open(os.path.join(args.out, "p2p_fr.json"), "w") as fh:
            json.dump(
                {"timing_enabled": timed, "entries": entries, "pg_status": data.get("pg_status")},
                fh,
                indent=1,
                default=str,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
