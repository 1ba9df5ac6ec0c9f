"""The training thread's cost of one parameter sample (ReplicaDivergence's checksum capture, every
``every_steps`` steps; the tp gradient-sync samples take the same path), on tensor-parallel DTensor
parameters as the reference trainer's ``--tp`` runs hold them.

Two arms on the same parameters, interleaved: ``ChecksumSampler.capture`` as it is (``samples.strided``:
one ``as_strided`` view of each local tensor, one cast of the concatenation) and the path it replaced
(``detach`` of the DTensor, ``to_local``, ``reshape``, two slices and a cast per parameter), written out
here as the reference. World size 1 over gloo: a DTensor's dispatch costs what it costs on any mesh.

    python -m benchmarks.sample_cost --params 40 --reps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist


def _replaced_path(plan: list[tuple[str, Any, str]], per_param: int) -> Any:
    """The sample as it was taken before ``samples.strided``: five dispatches a parameter after detach."""
    parts = []
    with torch.no_grad():
        for _name, p, _ in plan:
            t = p.detach()
            t = t.to_local() if hasattr(t, "to_local") else t
            flat = t.reshape(-1)
            parts.append(flat[:: max(1, flat.numel() // per_param)][:per_param].float())
        return torch.cat(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=40, help="DTensor parameters (64 x 64, Shard(0))")
    ap.add_argument("--reps", type=int, default=200, help="captures per arm, interleaved in rounds of 10")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpar_agent.detectors.cluster import ChecksumSampler

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model = torch.nn.Module()
    for i in range(a.params):
        model.register_parameter(f"w{i}", torch.nn.Parameter(distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])))
    sampler = ChecksumSampler()
    sampler.capture(model, 0)  # the plan, once
    plan = sampler.plan or []
    now = sampler.buffer.drain()[0][3]
    assert torch.equal(now, _replaced_path(plan, sampler.per_param)), "the two paths must take the same sample"
    times: dict[str, list[float]] = {"capture": [], "replaced": []}
    for r in range(a.reps // 10):
        for arm in (("capture", "replaced") if r % 2 == 0 else ("replaced", "capture")):
            t0 = time.perf_counter()
            for _ in range(10):
                if arm == "capture":
                    sampler.capture(model, 1)
                else:
                    _replaced_path(plan, sampler.per_param)
            times[arm].append((time.perf_counter() - t0) / 10 * 1e6)
            sampler.buffer.drain()
    med = {arm: statistics.median(v) for arm, v in times.items()}
    print(f"{a.params} DTensor parameters, torch {torch.__version__}: capture {med['capture']:.1f} µs, "
          f"the replaced path {med['replaced']:.1f} µs (x{med['replaced'] / med['capture']:.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": a.params, "torch": torch.__version__, "median_us": med, "rounds_us": times}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
