"""``attach()`` never waits on peers: a rank attaching long before another gets the job id at once, and
both end with the same id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from testkit.ports import free_port

_RANK = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import torch.distributed as dist
    import hpar_agent

    rank, out = int(os.environ["RANK"]), sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))

    def wait_for(name):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, name)):
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank}: {name} never came")
            time.sleep(0.05)

    def mark(name, text=""):
        with open(os.path.join(out, name + ".tmp"), "w") as fh:
            fh.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

    if rank == 0:
        wait_for("attached1")  # rank 0 (which would write the id) attaches only after rank 1 has
    agent = hpar_agent.attach(metrics_port=-1, traces="none", detectors=False, run_dir=os.path.join(out, f"r{rank}"))
    mark(f"attached{rank}", agent.topology.job_id)
    wait_for(f"attached{1 - rank}")
    hpar_agent.detach()
    mark(f"done{rank}")
    wait_for(f"done{1 - rank}")  # rank 0 hosts the store: keep it until rank 1 is done
    """
)



def test_late_peer_does_not_block_attach_and_ids_agree(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPAR_", "TORCHELASTIC"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ids = [(tmp_path / f"attached{r}").read_text() for r in range(2)]
    assert ids[0] == ids[1] and not ids[0].startswith("local-"), ids
    assert json.loads((tmp_path / "r1" / "summary.rank1.json").read_text())["topology"]["job_id"] == ids[0]
