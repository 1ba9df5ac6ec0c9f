"""Multi-GPU validation over NCCL: is every series of every rank true? (any number of GPUs >= 2)

Parts, each one torchrun job that fits a 10-minute device call with the others of its call:
  pp-1f1b, pp-interleaved  the trainer, pp2 (x dp N/2), inductor, bf16: p2p labelled pg="pp" op send/recv
                           with bytes and durations, the bubble ratio next to its theoretical value
  dp-ddp                   the trainer, dpN with DDP: the dp all-reduces timed
  dp-replicate             the trainer, dpN with composable replicate
  tp                       the trainer, tp2 (x dp N/2): the tp collectives timed
  fsdp                     the trainer, FSDP2 over dpN, bf16 params and reduce: dp_shard all_gather and
                           reduce_scatter timed, no alert (an agreed low-precision reduction)
  pause-late               dpN DDP with a 10 s checkpoint-like pause and the last rank starting 10 s late
  user-ddp                 benchmarks/user_ddp.py, a user's program: each rank's allocator series within 1%
                           of torch.cuda.memory_allocated() read in that rank, NVML process memory
                           differing by the extra GiB the last rank holds
  p2p-probe                benchmarks/p2p_probe.py: the raw flight-recorder entries of batch_isend_irecv
No part sets TORCH_NCCL_ENABLE_TIMING: collective timing must come from the agent. Every rank is
scraped once it passed ``--scrape-step``. Checks per trainer part: every rank's ``hpar_rank_info``
device is ``cuda:<local rank>`` and its allocator and NVML process series are non-zero; every group
with collectives has durations (``hpar_collective_timing_enabled`` 1); busbw below ``--link-gbs``;
pipeline parts: p2p as pp/send and pp/recv with bytes, no ``coalesced``/``other`` ops, spans of
``collective.send``/``recv`` with a peer. Every part is a clean run: any alert in any rank's event log
is a problem (the zero-false-alert check). Results: ``<out>/validate.json`` and a markdown table
``<out>/validate.md`` (dated, with torch and NCCL versions) for BENCHMARKS.md.

    python3 -m benchmarks.multigpu_validate --parts pp-1f1b,dp-ddp,user-ddp --out DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MODEL = ["--compile", "inductor", "--dtype", "bf16", "--layers", "4", "--dim", "1024", "--heads", "8",
         "--seq-len", "512", "--global-batch", "16", "--vocab", "8192", "--log-every", "10"]  # fmt: skip
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def layouts(n: int) -> dict[str, list[str]]:
    half = str(max(1, n // 2))
    return {
        "pp-1f1b": ["--dp", half, "--pp", "2", "--schedule", "1f1b", "--microbatches", "8"],
        "pp-interleaved": ["--dp", half, "--pp", "2", "--schedule", "interleaved-1f1b",
                           "--stages-per-rank", "2", "--microbatches", "8"],
        "dp-ddp": ["--dp", str(n), "--dp-mode", "ddp"],
        "dp-replicate": ["--dp", str(n), "--dp-mode", "replicate"],
        "tp": ["--dp", half, "--tp", "2"],
        "fsdp": ["--dp", str(n), "--dp-mode", "fsdp", "--mp-param-dtype", "bf16", "--mp-reduce-dtype", "bf16"],
        # a checkpoint-like 10 s pause of rank 0 and the last rank starting 10 s late: still no alert
        "pause-late": ["--dp", str(n), "--dp-mode", "ddp", "--pause-at", "150", "--pause-seconds", "10",
                       "--start-delay-rank", str(n - 1), "--start-delay", "10"],
    }  # fmt: skip


def theory_bubble(args: list[str]) -> float | None:
    """(p - 1) / (v * m + p - 1): p stages per pipeline, m microbatches, v stages per rank."""
    a = dict(zip(args[::2], args[1::2], strict=False))
    p, m, v = int(a.get("--pp", 1)), int(a.get("--microbatches", 1)), int(a.get("--stages-per-rank", 1))
    return None if p < 2 else (p - 1) / (v * m + p - 1)


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def scrape_when(url: str, step: int, proc: subprocess.Popen[Any], deadline: float) -> str | None:
    while time.time() < deadline and proc.poll() is None:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            steps = [v for n, _, v in parse(text) if n == "hpar_steps_total"]
            if steps and steps[0] >= step:
                return text
        except OSError:
            pass
        time.sleep(1.0)
    return None


def torchrun(n: int, target: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *target]
    full = {**os.environ, **NCCL_ENV, "PYTHONUNBUFFERED": "1", **env}
    full.pop("TORCH_NCCL_ENABLE_TIMING", None)  # timing must come from the agent
    return subprocess.Popen(
        cmd, env=full, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def check_trainer(part: str, args: list[str], n: int, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    run = out / part
    run.mkdir(parents=True, exist_ok=True)
    base = a.port
    env = {
        "HPAR_RUN_DIR": str(run),
        "HPAR_JOB_ID": f"validate-{part}",
        "HPAR_METRICS_PORT": str(base),
        "HPAR_METRICS_PORT_FALLBACK": "0",
        "HPAR_METRICS_ADDR": "127.0.0.1",
        "HPAR_TRACE_EVERY": "5",
    }
    t0 = time.time()
    proc = torchrun(
        n,
        [
            "-m",
            "hpar_trainer",
            *args,
            *MODEL,
            "--steps",
            str(a.steps),
            "--device",
            "cuda",
            "--out",
            str(run / "trainer.json"),
        ],
        env,
        run / "torchrun.log",
    )
    deadline = t0 + a.timeout
    scrapes = {}
    for r in range(n):
        text = scrape_when(f"http://127.0.0.1:{base + r}/metrics", a.scrape_step, proc, deadline)
        if text is not None:
            (run / f"scrape.rank{r}.txt").write_text(text)
            scrapes[r] = parse(text)
    try:
        rc = proc.wait(max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = -9
    res: dict[str, Any] = {
        "part": part,
        "args": " ".join(args),
        "exit": rc,
        "wall_s": round(time.time() - t0, 1),
        "scraped_ranks": sorted(scrapes),
        "problems": [],
    }
    probs = res["problems"]
    if len(scrapes) < n:
        probs.append(f"scraped {len(scrapes)}/{n} ranks")
    busbw, bubbles, untimed, pp_ops, bad_ops = 0.0, {}, set(), {}, set()
    for r, samples in scrapes.items():
        info = next((lab for name, lab, _ in samples if name == "hpar_rank_info"), {})
        local = int(info.get("local_rank", r))
        if info.get("device") != f"cuda:{local}":
            probs.append(f"rank {r}: device {info.get('device')} != cuda:{local}")
        get = {
            (name, tuple(sorted((k, v) for k, v in lab.items() if k not in ("rank", "pp_stage")))): v
            for name, lab, v in samples
        }
        if not get.get(("hpar_allocator_bytes", (("kind", "allocated"),))):
            probs.append(f"rank {r}: hpar_allocator_bytes allocated is 0 or missing")
        if not get.get(("hpar_gpu_process_memory_bytes", ())):
            probs.append(f"rank {r}: hpar_gpu_process_memory_bytes 0 or missing")
        timed = {lab["pg"]: v for name, lab, v in samples if name == "hpar_collective_timing_enabled"}
        counts: dict[tuple[str, str], float] = {}
        durs: dict[str, float] = {}
        for name, lab, v in samples:
            if name == "hpar_collectives_total":
                counts[(lab["pg"], lab["op"])] = v
                if lab["op"] in ("coalesced", "other"):
                    bad_ops.add(f"{lab['pg']}/{lab['op']}")
            elif name == "hpar_collective_duration_seconds_count":
                durs[lab["pg"]] = durs.get(lab["pg"], 0) + v
            elif name == "hpar_collective_busbw_bytes_per_second":
                busbw = max(busbw, v)
            elif name == "hpar_pp_bubble_ratio":
                bubbles[r] = round(v, 3)
            elif name == "hpar_collective_bytes_total" and lab["pg"] == "pp":
                pp_ops[lab["op"]] = pp_ops.get(lab["op"], 0) + v
        for pg in {pg for pg, _ in counts}:
            if not durs.get(pg) or not timed.get(pg):
                untimed.add(f"r{r}:{pg}")
    res.update(
        busbw_gbs=round(busbw / 1e9, 1),
        untimed=sorted(untimed),
        pp_bytes=pp_ops,
        bubble=bubbles,
        bubble_theory=theory_bubble(args),
        bad_ops=sorted(bad_ops),
    )
    if untimed:
        probs.append(f"groups without durations: {sorted(untimed)}")
    if busbw > a.link_gbs * 1e9:
        probs.append(f"busbw {busbw / 1e9:.0f} GB/s above the link's {a.link_gbs} GB/s")
    if any(op.endswith("/other") for op in bad_ops):
        probs.append(f"ops the decoder does not know: {sorted(o for o in bad_ops if o.endswith('/other'))}")
    if theory_bubble(args) is not None:
        if not (pp_ops.get("send") and pp_ops.get("recv")):
            probs.append(f"p2p not labelled pp/send+recv with bytes: {pp_ops}")
        if bad_ops:
            probs.append(f"unlabelled ops: {sorted(bad_ops)}")
        spans = p2p_spans(run)
        res["p2p_spans_with_peer"] = spans
        if not spans:
            probs.append("no collective.send/recv span with a peer in the traces")
    if rc != 0:
        probs.append(f"torchrun exit {rc}")
    alerts = fired_alerts(run)
    res["alerts"] = alerts
    if alerts:
        probs.append(f"alerts in a clean run: {alerts}")
    return res


def p2p_spans(run: Path) -> int:
    """collective.send/recv spans carrying collective.peer in the local OTLP-JSON trace files."""
    n = 0
    for path in glob.glob(str(run / "traces.rank*.jsonl")):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if '"collective.send"' not in line and '"collective.recv"' not in line:
                continue
            n += line.count('"collective.peer"')
    return n


def fired_alerts(run: Path) -> list[str]:
    out = []
    for path in sorted(glob.glob(str(run / "events.rank*.jsonl"))):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if '"alert"' in line:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("kind") == "alert" and e.get("state") == "firing":
                    out.append(f"{e.get('alert')}@{e.get('rank')}:step{e.get('step')}")
    return out


def check_user_ddp(n: int, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    run = out / "user-ddp"
    run.mkdir(parents=True, exist_ok=True)
    env = {"HPAR_RUN_DIR": str(run), "HPAR_METRICS_PORT": str(a.port), "HPAR_METRICS_ADDR": "127.0.0.1"}
    t0 = time.time()
    proc = torchrun(n, [str(HERE / "user_ddp.py"), "--out", str(run)], env, run / "torchrun.log")
    try:
        rc = proc.wait(a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = -9
    res: dict[str, Any] = {
        "part": "user-ddp",
        "exit": rc,
        "wall_s": round(time.time() - t0, 1),
        "problems": [],
    }
    ranks = {}
    for r in range(n):
        p = run / f"user_ddp.rank{r}.json"
        if p.exists():
            ranks[r] = json.loads(p.read_text())
    rows = {}
    for r, d in ranks.items():
        s = d.get("scrape", {})
        agent_alloc = s.get('hpar_allocator_bytes{kind="allocated"}')
        proc_mem = s.get("hpar_gpu_process_memory_bytes{}")
        timed = sum(v for k, v in s.items() if k.startswith("hpar_collective_duration_seconds_count"))
        rows[r] = {
            "in_rank": d.get("allocated_in_rank"),
            "agent": agent_alloc,
            "nvml_process": proc_mem,
            "timed_ops": timed,
            "step_median_ms": round(1e3 * d.get("step_median_s", 0), 2),
        }
        if not agent_alloc or abs(agent_alloc - d["allocated_in_rank"]) > 0.01 * d["allocated_in_rank"]:
            res["problems"].append(
                f"rank {r}: agent allocated {agent_alloc} vs in-rank {d.get('allocated_in_rank')}"
            )
        if not timed:
            res["problems"].append(f"rank {r}: no timed collectives")
    if len(ranks) == n and n >= 2:
        first, last = rows[0]["nvml_process"], rows[n - 1]["nvml_process"]
        diff = (last or 0) - (first or 0)
        res["nvml_process_diff_gib"] = round(diff / (1 << 30), 3)
        if diff < 0.9 * (1 << 30):
            res["problems"].append(f"NVML process memory last-first {diff} B, expected >= 0.9 GiB")
    else:
        res["problems"].append(f"{len(ranks)}/{n} ranks wrote results")
    res["ranks"] = rows
    res["alerts"] = fired_alerts(run)
    if res["alerts"]:
        res["problems"].append(f"alerts in a clean run: {res['alerts']}")
    if rc != 0:
        res["problems"].append(f"torchrun exit {rc}")
    return res


def check_p2p_probe(n: int, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    run = out / "p2p-probe"
    run.mkdir(parents=True, exist_ok=True)
    proc = torchrun(n, [str(HERE / "p2p_probe.py"), "--out", str(run)], {}, run / "torchrun.log")
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        rc = -9
    p = run / "p2p_fr.json"
    data = json.loads(p.read_text()) if p.exists() else {}
    names = sorted(
        {
            (e["profiling_name"], bool(e["is_p2p"]), e["duration_ms"] is not None)
            for e in data.get("entries", [])
        }
    )
    return {
        "part": "p2p-probe",
        "exit": rc,
        "entries": names,
        "timing_enabled": data.get("timing_enabled"),
        "problems": [] if rc == 0 and names else ["probe failed"],
    }


def markdown(results: list[dict[str, Any]]) -> str:
    ver = f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    gpus = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        f"multi-GPU validation ({time.strftime('%Y-%m-%d')}, {torch.cuda.device_count()} x {gpus}, {ver}; "
        "no TORCH_NCCL_ENABLE_TIMING set):",
        "",
        "| part | result | busbw max GB/s | bubble (theory) | p2p bytes | alerts | problems |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bub = ""
        if r.get("bubble"):
            th = r.get("bubble_theory")
            bub = f"{', '.join(map(str, r['bubble'].values()))} ({th:.3f})" if th else ""
        lines.append(
            f"| {r['part']} | {'ok' if not r['problems'] else 'FAIL'} | {r.get('busbw_gbs', '')} | {bub} | "
            f"{r.get('pp_bytes', '') or ''} | {', '.join(r.get('alerts', [])) or '-'} | "
            f"{'; '.join(r['problems']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="p2p-probe,pp-1f1b,dp-ddp,user-ddp")
    ap.add_argument("--out", default=os.environ.get("OUT", "validate-out"))
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--scrape-step", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=240.0, help="per part")
    ap.add_argument("--port", type=int, default=19470)
    ap.add_argument(
        "--link-gbs", type=float, default=450.0, help="per-direction link limit (H200 NVLink: 450)"
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.nproc
    lay = layouts(n)
    results = []
    for part in a.parts.split(","):
        t0 = time.time()
        if part in lay:
            res = check_trainer(part, lay[part], n, out, a)
        elif part == "user-ddp":
            res = check_user_ddp(n, out, a)
        elif part == "p2p-probe":
            res = check_p2p_probe(n, out, a)
        else:
            raise SystemExit(f"unknown part {part!r}")
        results.append(res)
        print(f"[{part}] {time.time() - t0:.0f}s {json.dumps(res, default=str)}", flush=True)
        (out / "validate.json").write_text(json.dumps(results, indent=1, default=str))
    md = markdown(results)
    (out / "validate.md").write_text(md)
    print(md)
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
