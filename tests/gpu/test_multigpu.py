"""The agent on several GPUs over NCCL (any number >= 2): is every series of every rank true?

No run sets ``TORCH_NCCL_ENABLE_TIMING``: collective timing must come from the agent. Each trainer
layout runs under torchrun and every rank is scraped once it passed ``SCRAPE_AT`` steps. Every rank's
``hpar_rank_info`` device is ``cuda:<local rank>``, its allocator and NVML process series are non-zero;
every group with collectives has durations; bus bandwidth stays below the link's; a pipeline's p2p is
``pg="pp"`` send/recv with bytes (no ``coalesced``/``other`` op) and its spans name the peer; and a
clean run raises no alert on any rank. A user's own DDP program (``user_ddp.py``) gets each rank's
allocator series equal to ``torch.cuda.memory_allocated()`` read in that rank, and NVML's process memory
tells the rank holding an extra GiB from the others.

    pytest tests/gpu/test_multigpu.py -k "pp_1f1b or user_ddp"    # a subset that fits a 10-minute call
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.helpers import spans

pytestmark = pytest.mark.gpus(2)

HERE = Path(__file__).resolve().parent
NGPU = max(2, torch.cuda.device_count())
HALF = str(max(1, NGPU // 2))
MODEL = (
    "--compile inductor --dtype bf16 --layers 4 --dim 1024 --heads 8 "
    "--seq-len 512 --global-batch 16 --vocab 8192 --log-every 10 --device cuda"
).split()
STEPS, SCRAPE_AT, TIMEOUT = 300, 200, 240.0
LINK_GBS = float(os.environ.get("HPAR_TEST_LINK_GBS", "450"))  # per-direction NVLink of an H100/H200
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LAYOUTS = {
    "pp_1f1b": ["--dp", HALF, "--pp", "2", "--schedule", "1f1b", "--microbatches", "8"],
    "pp_interleaved": [
        "--dp",
        HALF,
        *"--pp 2 --schedule interleaved-1f1b --stages-per-rank 2 --microbatches 8".split(),
    ],
    "dp_ddp": ["--dp", str(NGPU), "--dp-mode", "ddp"],
    "dp_replicate": ["--dp", str(NGPU), "--dp-mode", "replicate"],
    "tp": ["--dp", HALF, "--tp", "2"],
    "fsdp": ["--dp", str(NGPU), "--dp-mode", "fsdp", "--mp-param-dtype", "bf16", "--mp-reduce-dtype", "bf16"],
    # a checkpoint-like 10 s pause of rank 0 and the last rank starting 10 s late: still no alert
    "pause_late": [
        "--dp",
        str(NGPU),
        *"--dp-mode ddp --pause-at 150 --pause-seconds 10 --start-delay-rank".split(),
        str(NGPU - 1),
        "--start-delay",
        "10",
    ],
}


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def torchrun(target: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NGPU}", *target]
    full = {**os.environ, **NCCL_ENV, "PYTHONUNBUFFERED": "1", **env}
    full.pop("TORCH_NCCL_ENABLE_TIMING", None)  # timing must come from the agent
    return subprocess.Popen(
        cmd, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(proc: subprocess.Popen[Any], deadline: float) -> int:
    try:
        return proc.wait(max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        return -9


def scrape_when(url: str, step: int, proc: subprocess.Popen[Any], deadline: float) -> str | None:
    while time.time() < deadline and proc.poll() is None:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            if any(n == "hpar_steps_total" and v >= step for n, _, v in parse(text)):
                return text
        except OSError:
            pass
        time.sleep(1.0)
    return None


def fired(run: Path) -> list[str]:
    out = []
    for path in sorted(run.glob("events.rank*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("kind") == "alert" and e.get("state") == "firing":
                out.append(f"{e.get('alert')}@{e.get('rank')}:step{e.get('step')}")
    return out


def problems(name: str, args: list[str], run: Path, scrapes: dict[int, list[Any]]) -> list[str]:
    """What is wrong with a trainer layout's scrapes and files (empty: every series is true)."""
    probs = [f"scraped {len(scrapes)}/{NGPU} ranks"] if len(scrapes) < NGPU else []
    busbw, pp_bytes, bad_ops = 0.0, {}, set()
    for r, samples in scrapes.items():
        info = next((lab for n, lab, _ in samples if n == "hpar_rank_info"), {})
        if info.get("device") != f"cuda:{info.get('local_rank', r)}":
            probs.append(f"rank {r}: device {info.get('device')}")
        values = {
            (n, tuple(sorted((k, v) for k, v in lab.items() if k not in ("rank", "pp_stage")))): v
            for n, lab, v in samples
        }
        if not values.get(("hpar_allocator_bytes", (("kind", "allocated"),))):
            probs.append(f"rank {r}: hpar_allocator_bytes allocated is 0 or missing")
        if not values.get(("hpar_gpu_process_memory_bytes", ())):
            probs.append(f"rank {r}: hpar_gpu_process_memory_bytes is 0 or missing")
        timed = {lab["pg"]: v for n, lab, v in samples if n == "hpar_collective_timing_enabled"}
        groups, durations = set(), {}
        for n, lab, v in samples:
            if n == "hpar_collectives_total":
                groups.add(lab["pg"])
                if lab["op"] in ("coalesced", "other"):
                    bad_ops.add(f"{lab['pg']}/{lab['op']}")
            elif n == "hpar_collective_duration_seconds_count":
                durations[lab["pg"]] = durations.get(lab["pg"], 0) + v
            elif n == "hpar_collective_busbw_bytes_per_second":
                busbw = max(busbw, v)
            elif n == "hpar_collective_bytes_total" and lab["pg"] == "pp":
                pp_bytes[lab["op"]] = pp_bytes.get(lab["op"], 0) + v
        probs += [
            f"rank {r}: group {pg} has no durations"
            for pg in sorted(groups)
            if not durations.get(pg) or not timed.get(pg)
        ]
    if busbw > LINK_GBS * 1e9:
        probs.append(f"bus bandwidth {busbw / 1e9:.0f} GB/s above the link's {LINK_GBS:.0f}")
    if "--pp" in args:
        if not (pp_bytes.get("send") and pp_bytes.get("recv")):
            probs.append(f"p2p not pp/send + pp/recv with bytes: {pp_bytes}")
        if bad_ops:
            probs.append(f"ops not decoded: {sorted(bad_ops)}")
        peers = [
            s
            for s in spans(run)
            if s["name"] in ("collective.send", "collective.recv")
            and any(kv["key"] == "collective.peer" for kv in s.get("attributes", []))
        ]
        if not peers:
            probs.append("no collective.send/recv span names its peer")
    return probs + [f"alerts in a clean run: {a}" for a in fired(run)]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_series_of_every_rank_is_true(name: str, tmp_path: Path) -> None:
    args, base = LAYOUTS[name], 19470
    env = {
        "HPAR_RUN_DIR": str(tmp_path),
        "HPAR_JOB_ID": f"gpu-{name}",
        "HPAR_METRICS_PORT": str(base),
        "HPAR_METRICS_PORT_FALLBACK": "0",
        "HPAR_METRICS_ADDR": "127.0.0.1",
        "HPAR_TRACE_EVERY": "5",
    }
    deadline = time.time() + TIMEOUT
    proc = torchrun(
        ["-m", "hpar_trainer", *args, *MODEL, "--steps", str(STEPS), "--out", str(tmp_path / "trainer.json")],
        env,
        tmp_path / "torchrun.log",
    )
    scrapes = {}
    for r in range(NGPU):
        text = scrape_when(f"http://127.0.0.1:{base + r}/metrics", SCRAPE_AT, proc, deadline)
        if text is not None:
            scrapes[r] = parse(text)
    rc = finish(proc, deadline)
    assert rc == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    assert problems(name, args, tmp_path, scrapes) == []


def test_a_users_ddp_program_reads_each_ranks_own_memory(tmp_path: Path) -> None:
    env = {"HPAR_RUN_DIR": str(tmp_path), "HPAR_METRICS_PORT": "19470", "HPAR_METRICS_ADDR": "127.0.0.1"}
    proc = torchrun([str(HERE / "user_ddp.py"), "--out", str(tmp_path)], env, tmp_path / "torchrun.log")
    assert finish(proc, time.time() + TIMEOUT) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    ranks = [json.loads((tmp_path / f"user_ddp.rank{r}.json").read_text()) for r in range(NGPU)]
    for r, d in enumerate(ranks):
        s = d["scrape"]
        agent_alloc = s.get('hpar_allocator_bytes{kind="allocated"}')
        assert agent_alloc == pytest.approx(d["allocated_in_rank"], rel=0.01), (
            r,
            agent_alloc,
            d["allocated_in_rank"],
        )
        assert sum(v for k, v in s.items() if k.startswith("hpar_collective_duration_seconds_count")) > 0, r
    extra = (
        ranks[-1]["scrape"]["hpar_gpu_process_memory_bytes{}"]
        - ranks[0]["scrape"]["hpar_gpu_process_memory_bytes{}"]
    )
    assert extra >= 0.9 * (1 << 30), (
        f"NVML process memory of the last rank over the first: {extra} B, expected ~1 GiB"
    )
    assert fired(tmp_path) == []
