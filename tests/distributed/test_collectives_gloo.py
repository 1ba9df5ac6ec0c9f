"""4 gloo ranks, DeviceMesh (dp=2, tp=2): the agent's collective series match the flight recorder.

Each rank runs explicit all_reduce/all_gather on the dp, tp and default groups plus pipelining-style
p2p through ``torch.distributed.pipelining.schedules._batch_p2p`` (what every schedule calls), scrapes
its own /metrics over HTTP, and dumps the FR; the parent compares them.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import schedules

import hpar_agent
from hpar_agent.torch_compat import flight_recorder as fr
from hpar_agent.torch_compat.fr_decode import op_label, pg_label
from testkit.ports import free_port

pytestmark = pytest.mark.distributed

WORLD = 4
ROUNDS = 3


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t_attach = time.time_ns()
    agent = hpar_agent.attach(
        mesh=mesh,
        metrics_port=0,
        metrics_addr="127.0.0.1",
        traces="none",
        run_dir=out_dir,
        job_id="gloo-test",
        fr_interval=0.001,  # the tick below reads the FR in full (the default reads once per 5 s slot)
    )
    try:
        x = torch.ones(64)
        for _ in range(ROUNDS):
            dist.all_reduce(x, group=mesh["dp"].get_group())
            parts = [torch.zeros(64) for _ in range(2)]
            dist.all_gather(parts, x, group=mesh["tp"].get_group())
            dist.all_reduce(x)
            if rank in (0, 1):  # stage 0 -> stage 1 activations, as a schedule would send them
                op = dist.isend if rank == 0 else dist.irecv
                ops = [dist.P2POp(op, torch.zeros(32), 1 - rank) for _ in range(2)]
                schedules._wait_batch_p2p(schedules._batch_p2p(ops))
            agent.step()
        agent.tick()
        with urllib.request.urlopen(agent.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        scraped = []
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("hpar_collective"):
                    scraped.append([s.name, s.labels, s.value])
        data = fr.dump("gloo")
        entries = [
            [list(e["process_group"]), e["profiling_name"], e["input_sizes"]]
            for e in data["entries"]
            if e["time_created_ns"] >= t_attach
        ]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump({"scraped": scraped, "fr": entries}, fh)
        dist.barrier()
    finally:
        hpar_agent.detach()
        dist.destroy_process_group()


def test_collective_series_agree_with_flight_recorder(tmp_path):
    # fork: the children inherit the parent's imports (torch.distributed.pipelining alone takes ~20 s
    # per process on a loaded host); no CUDA and no process group exist in the parent.
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="fork")
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        total = {(s[1]["pg"], s[1]["op"]): s[2] for s in res["scraped"] if s[0] == "hpar_collectives_total"}
        for _, labels, _ in res["scraped"]:
            assert labels["rank"] == str(rank) and labels["pp_stage"] == "0"
        # what the FR recorded for the same window, mapped the way the agent must map it
        expect: dict[tuple[str, str], float] = {}
        for (name, desc), prof, _ in res["fr"]:
            key = (pg_label(name, desc), op_label(prof))
            expect[key] = expect.get(key, 0) + 1
        assert expect == {
            ("dp", "all_reduce"): ROUNDS,
            ("tp", "all_gather"): ROUNDS,
            ("default_pg", "all_reduce"): ROUNDS,
        }
        fr_view = {k: v for k, v in total.items() if k[0] != "pp"}
        assert fr_view == expect, (rank, total)
        nbytes = {
            (s[1]["pg"], s[1]["op"]): s[2] for s in res["scraped"] if s[0] == "hpar_collective_bytes_total"
        }
        assert nbytes[("dp", "all_reduce")] == ROUNDS * 64 * 4
        if rank in (0, 1):  # p2p is invisible to the gloo FR: counted and timed by the wrapper
            op = "send" if rank == 0 else "recv"
            assert total[("pp", op)] == 2 * ROUNDS
            assert nbytes[("pp", op)] == 2 * ROUNDS * 32 * 4
            count = [
                s[2]
                for s in res["scraped"]
                if s[0] == "hpar_collective_duration_seconds_count"
                and s[1]["op"] == op
                and s[1]["stream"] == "cpu"
            ]
            assert count == [2 * ROUNDS]
        else:
            assert not any(k[0] == "pp" for k in total)
        completed = {s[1]["pg"]: s[2] for s in res["scraped"] if s[0] == "hpar_collective_last_completed_seq"}
        assert completed["dp"] >= ROUNDS and completed["tp"] >= ROUNDS
        assert not any(s[0] == "hpar_collective_unobserved_total" for s in res["scraped"])
