"""GPU validation of the agent's numbers against independent sources (one rank, NCCL, the device run).

Checks, each printed with its figures and written to ``--json``:
  collectives  explicit ``dist.all_reduce`` / ``all_gather_into_tensor`` on a few sizes with
               TORCH_NCCL_ENABLE_TIMING=1: the flight recorder has ``duration_ms``, and the agent's
               ``hpar_collective_duration_seconds`` mean per op is compared with torch.profiler's device
               time of the same ops (NCCL kernels, or what NCCL ran instead at world size 1)
  nvml         ``hpar_gpu_*`` series non-zero, from the registry and from the live /metrics endpoint
  cuda_leak    CUDA tensors held every step from a named function: MemoryLeak fires (allocator/NVML) and
               the allocator snapshot's frames name that function
  trainer_leak the trainer's ``--inject tensor-leak`` / ``--inject compile-leak`` (torchrun, 1 rank):
               MemoryLeak fires; the step, source, evidence files and whether the allocator snapshot
               names the trainer's inject module
  trainer      one-rank trainer ``--compile inductor --dtype bf16``: step time, loss first/last
  fr_reader    ``HPAR_FR_READER``: the worker server's full dump equal to the in-process one entry by
               entry (NCCL: ``dump_nccl_trace_pickle``), and an agent reading through it counting and
               timing every all-reduce
  binding      ``hpar_rank_info``'s CPU/NUMA labels against sysfs (the GPU's PCI ``local_cpulist`` and
               ``numa_node``: a source independent of NVML) and ``os.sched_getaffinity``; doctor's NUMA
               line; a subprocess pinned (``taskset``) off the GPU's ideal CPUs, where that set leaves any,
               must raise NumaMisbinding; a one-stage pipeline's ``pp.forward`` spans, run on the
               current stream and on a side stream, carry ``cuda.stream.handle`` equal to each
               stream's ``cuda_stream``
Why in one process (except the trainer runs): one rank cannot hold two NCCL groups' GPUs twice, and
world size 1 needs no launcher. ``--cpu-smoke`` runs every check on CPU (gloo, tiny model, no
profiler device times, no NVML) so the script is tested before the one device call.

    TORCH_NCCL_ENABLE_TIMING=1 python -m benchmarks.gpu_validate --json gpu-validate.json
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # read when the NCCL group is created

import torch
import torch.distributed as dist

import hpar_agent
from benchmarks.overhead import CONFIGS  # the benchmark's model sizes, shared
from hpar_agent.torch_compat import flight_recorder as fr

MiB = 1 << 20
# NCCL kernels, or what NCCL runs at world size 1 (oneRankReduce / a copy); "nccl:<op>" device-side
# events are the profiler's GPU user annotations spanning the op, reported apart, never summed in.
COMM_KERNEL = re.compile(r"ncclDevKernel|ncclKernel|onerank", re.I)
COPY = re.compile(r"memcpy|memset", re.I)


def sample_sum(agent: hpar_agent.Agent, sample: str, **labels: str) -> float:
    """Sum of a sample over every series whose labels include ``labels`` (from the agent's registry)."""
    total = 0.0
    for fam in agent.registry.collect():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def device_events(prof: Any) -> list[tuple[str, float]]:
    """(name, µs) of every device-side event (kernels, memcpy/memset) a profile recorded."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, float(e.time_range.elapsed_us())))
    return out


def check_collectives(agent: hpar_agent.Agent, device: torch.device, reps: int) -> dict[str, Any]:
    """Agent (FR duration_ms) vs torch.profiler device time per op, per (op, size)."""
    cuda = device.type == "cuda"
    results = []
    variants = [("all_reduce", "sum"), ("all_reduce", "avg"), ("all_gather", "-")]
    sizes = (1 * MiB, 16 * MiB, 128 * MiB) if cuda else (64 * 1024,)
    last_rid = -1
    for op, red in variants:
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=device)
            outbuf = torch.empty_like(x)
            before = (sample_sum(agent, "hpar_collective_duration_seconds_sum", op=op),
                      sample_sum(agent, "hpar_collective_duration_seconds_count", op=op))

            rop = dist.ReduceOp.AVG if red == "avg" else dist.ReduceOp.SUM
            collective = (lambda: dist.all_gather_into_tensor(outbuf, x)) if op == "all_gather" else (  # noqa: B023
                lambda: dist.all_reduce(x, op=rop))  # noqa: B023
            collective()  # warm-up outside the profile
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(reps):
                    collective()
                if cuda:
                    torch.cuda.synchronize()
            deadline = time.monotonic() + 10
            while True:  # the watchdog stamps duration_ms after completion: poll until all are timed
                agent.tick()
                got = sample_sum(agent, "hpar_collective_duration_seconds_count", op=op) - before[1]
                if got >= reps + 1 or time.monotonic() > deadline or not cuda:
                    break
                time.sleep(0.1)
            d_sum = sample_sum(agent, "hpar_collective_duration_seconds_sum", op=op) - before[0]
            d_cnt = sample_sum(agent, "hpar_collective_duration_seconds_count", op=op) - before[1]
            entries = [e for e in fr.dump(fr.available_recorders()[-1]).get("entries", [])
                       if e.get("record_id", -1) > last_rid]
            if entries:
                last_rid = max(e["record_id"] for e in entries)
            fr_ms = [float(e["duration_ms"]) for e in entries if e.get("duration_ms") is not None]
            dev = device_events(prof)
            names = sorted({n for n, _ in dev})
            comm = [us for n, us in dev if COMM_KERNEL.search(n)] or [us for n, us in dev if COPY.search(n)]
            annot = [us for n, us in dev if n.startswith("nccl:")]
            prof_us = sum(comm) / reps if comm else None
            agent_us = d_sum / d_cnt * 1e6 if d_cnt else None
            row = {
                "op": op, "reduce": red, "bytes": nbytes, "reps": reps + 1, "fr_entries": len(entries),
                "fr_timed": len(fr_ms), "fr_median_us": statistics.median(fr_ms) * 1e3 if fr_ms else None,
                "agent_timed": d_cnt, "agent_mean_us": agent_us, "profiler_device_us_per_op": prof_us,
                "profiler_device_events": names[:8],
                "profiler_annotation_us_per_op": sum(annot) / reps if annot else None,
                "fr_sample": {k: entries[-1].get(k) for k in ("state", "time_created_ns", "duration_ms",
                                                             "profiling_name", "process_group")} if entries else None,
                "ratio_agent_to_profiler": agent_us / prof_us if agent_us and prof_us else None,
            }  # fmt: skip
            results.append(row)
            print(f"  {op:10} {red:3} {nbytes / MiB:7.2f} MiB: FR timed {len(fr_ms):2}/{len(entries):2} "
                  f"median {_fmt(row['fr_median_us'])} us; agent {int(d_cnt):2} timed, mean {_fmt(agent_us)} us; "
                  f"profiler {_fmt(prof_us)} us/op ({', '.join(n[:40] for n in names[:3]) or 'no device events'})"
                  f"; ratio {_fmt(row['ratio_agent_to_profiler'], '.3f')}", flush=True)
    ratios = [r["ratio_agent_to_profiler"] for r in results if r["ratio_agent_to_profiler"]]
    comp = agent.component("collectives")
    return {
        "agent_errors": dict(agent.errors), "agent_time_ns": time.time_ns(),
        "collector_summary": comp.summary() if comp is not None else None,
        "rows": results,
        "fr_durations_present": any(r["fr_timed"] for r in results),
        "median_ratio_agent_to_profiler": statistics.median(ratios) if ratios else None,
    }


def check_nvml(agent: hpar_agent.Agent) -> dict[str, Any]:
    agent.tick()
    names = ("hpar_gpu_memory_used_bytes", "hpar_gpu_memory_total_bytes", "hpar_gpu_process_memory_bytes",
             "hpar_gpu_utilization_ratio", "hpar_gpu_power_watts", "hpar_gpu_temperature_celsius",
             "hpar_gpu_clock_hertz")
    values = {n: sample_sum(agent, n) for n in names}
    scraped: dict[str, float] = {}
    if agent.metrics_url:
        text = urllib.request.urlopen(agent.metrics_url, timeout=5).read().decode()
        for line in text.splitlines():
            m = re.match(r"^(hpar_gpu_[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$", line)
            if m:
                scraped[m.group(1)] = scraped.get(m.group(1), 0.0) + float(m.group(2))
    real = all(values[n] > 0 for n in ("hpar_gpu_memory_used_bytes", "hpar_gpu_process_memory_bytes",
                                       "hpar_gpu_power_watts"))
    for n in names:
        print(f"  {n:34} registry {values[n]:.4g}  /metrics {scraped.get(n, float('nan')):.4g}")
    return {"registry": values, "scraped": scraped, "real": real}


def _leak_cuda_tensor(kept: list[torch.Tensor], nbytes: int, device: torch.device) -> None:
    """The leak site the allocator snapshot must name."""
    kept.append(torch.ones(nbytes // 4, device=device))


def alert_events(run_dir: str, alert: str) -> list[dict[str, Any]]:
    out = []
    for path in Path(run_dir).glob("events.rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "alert" and rec.get("alert") == alert:
                out.append(rec)
    return out


def snapshot_sites(paths: list[str], pattern: str) -> dict[str, Any]:
    """Frames (file:line name) of allocator-snapshot blocks/traces matching ``pattern``."""
    hits: dict[str, int] = {}
    pickles = [p for p in paths if p.endswith(".pickle")]
    for p in pickles:
        snap = pickle.loads(Path(p).read_bytes())
        frame_lists = [b.get("frames", []) for seg in snap.get("segments", []) for b in seg.get("blocks", [])]
        frame_lists += [t.get("frames", []) for dev in snap.get("device_traces", []) for t in dev]
        for frames in frame_lists:
            for f in frames:
                site = f"{f.get('filename', '')}:{f.get('line', '')} {f.get('name', '')}"
                if re.search(pattern, site):
                    key = f"{os.path.basename(f.get('filename', ''))}:{f.get('line', '')} {f.get('name', '')}"
                    hits[key] = hits.get(key, 0) + 1
    return {"snapshots": pickles, "sites": hits, "named": bool(hits)}


#: Wall time of one step of the CUDA leak check (``memory.ALLOCATOR_GAP_NS`` is 50 ms).
LEAK_STEP_S = 0.06


def check_cuda_leak(agent: hpar_agent.Agent, device: torch.device, steps: int, nbytes: int) -> dict[str, Any]:
    model = torch.nn.Linear(256, 256, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    kept: list[torch.Tensor] = []
    first_fire = None
    for step in range(steps):
        t0 = time.perf_counter()
        model(torch.randn(64, 256, device=device)).sum().backward()
        _leak_cuda_tensor(kept, nbytes, device)
        opt.step()  # the agent's step boundary (global optimizer hook)
        opt.zero_grad()
        agent.tick()
        # paced like a training step (60 ms): the agent reads the allocator at most every 50 ms
        time.sleep(max(0.0, LEAK_STEP_S - (time.perf_counter() - t0)))
        if first_fire is None and sample_sum(agent, "hpar_alert_active", alert="MemoryLeak") > 0:
            first_fire = step
    fired = alert_events(agent.run_dir, "MemoryLeak")
    firing = [e for e in fired if e.get("state") == "firing"]
    evidence = [p for e in firing for p in e.get("evidence", [])]
    sites = snapshot_sites(evidence, r"_leak_cuda_tensor")
    res = {"steps": steps, "bytes_per_step": nbytes, "fired_at_step": first_fire,
           "details": firing[0].get("details") if firing else None, "value": firing[0].get("value") if firing else None,
           "evidence": [os.path.basename(p) for p in evidence], **sites}  # fmt: skip
    print(f"  fired at step {first_fire} ({res['details']}), value {_fmt(res['value'], '.4g')} B/step; "
          f"evidence {res['evidence']}; snapshot names leak site: {sites['named']} {sites['sites']}")
    kept.clear()
    return res


#: Entry fields the two dumps must agree on (times, state and duration of entries retired before both).
FR_KEYS = ("record_id", "pg_id", "process_group", "collective_seq_id", "profiling_name", "input_sizes",
           "input_dtypes", "output_sizes", "is_p2p", "state", "time_created_ns", "duration_ms")


def check_fr_reader(device: torch.device, reps: int, work: str) -> dict[str, Any]:
    """The reader process on this backend: the worker server's dump (``dump_nccl_trace_pickle`` on NCCL,
    ``fr_trace_json`` on gloo) equals the in-process dump entry by entry, and an agent whose full reads
    run in the reader process (the default) counts every all-reduce and times each (NCCL)."""
    from hpar_agent.agent import Agent
    from hpar_agent.torch_compat.fr_server import DumpServer

    rec = fr.available_recorders()[-1]
    x = torch.ones(MiB // 4, device=device)

    def run_ops() -> None:
        for _ in range(reps):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        time.sleep(1.0)  # the watchdog retires the entries (duration_ms) a poll after completion

    run_ops()
    server = DumpServer([rec])
    try:
        t0 = time.perf_counter()
        via = server.dump(rec)
        t1 = time.perf_counter()
        direct = fr.dump(rec)
        t2 = time.perf_counter()
    finally:
        server.close()
    a_entries, b_entries = via.get("entries") or [], direct.get("entries") or []
    differ = [a.get("record_id") for a, b in zip(a_entries, b_entries, strict=False)
              if {k: a.get(k) for k in FR_KEYS} != {k: b.get(k) for k in FR_KEYS}]
    agent = Agent(metrics_port=-1, traces="none", run_dir=os.path.join(work, "fr-reader"), fr_reader="process",
                  interval=3600.0, fr_interval=1e-6)
    agent.start()
    try:
        coll = agent.component("collectives")
        before = sample_sum(agent, "hpar_collectives_total", op="all_reduce")
        run_ops()
        agent.tick()
        agent.tick()  # a second read completes entries the first saw without their duration
        counted = sample_sum(agent, "hpar_collectives_total", op="all_reduce") - before
        timed = sample_sum(agent, "hpar_collective_duration_seconds_count", op="all_reduce")
        reader = coll.reader_state()
        errors = sample_sum(agent, "hpar_agent_errors_total")
    finally:
        agent.stop()
    res = {"recorder": rec, "entries": [len(a_entries), len(b_entries)], "differing_record_ids": differ[:10],
           "equal": bool(a_entries) and len(a_entries) == len(b_entries) and not differ,
           "server_read_ms": (t1 - t0) * 1e3, "in_process_read_ms": (t2 - t1) * 1e3,
           "agent_counted": counted, "agent_timed": timed, "reps": reps, "reader": reader,
           "agent_errors": errors}  # fmt: skip
    print(f"  {res}")
    return res


def run_trainer(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "hpar_trainer", *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout, check=False)


def check_trainer_leak(inject: str, base: list[str], steps: int, work: str, timeout: float) -> dict[str, Any]:
    run_dir = os.path.join(work, inject)
    out = os.path.join(work, f"{inject}.json")
    env = {"HPAR_RUN_DIR": run_dir, "HPAR_TRACES": "none", "HPAR_METRICS_PORT": "0", "HPAR_INTERVAL": "0.2",
           "HPAR_JOB_ID": f"validate-{inject}"}
    res = run_trainer([*base, "--steps", str(steps), "--inject", inject, "--inject-rank", "0", "--log-every", "1000",
                       "--out", out], env, timeout)
    firing = [e for e in alert_events(run_dir, "MemoryLeak") if e.get("state") == "firing"]
    evidence = [p for e in firing for p in e.get("evidence", [])]
    sites = snapshot_sites(evidence, r"inject\.py")  # the injection module, not any trainer frame
    row = {"inject": inject, "rc": res.returncode, "steps": steps, "fired": bool(firing),
           "fired_at_step": firing[0].get("step") if firing else None,
           "details": firing[0].get("details") if firing else None,
           "value_bytes_per_step": firing[0].get("value") if firing else None,
           "evidence": [os.path.basename(p) for p in evidence], **sites}  # fmt: skip
    if res.returncode:
        row["stderr_tail"] = res.stderr[-1500:]
    print(f"  {inject}: rc {res.returncode}, MemoryLeak fired {row['fired']} at step {row['fired_at_step']} "
          f"({row['details']}, {_fmt(row['value_bytes_per_step'], '.4g')} B/step); evidence {row['evidence']}; "
          f"snapshot names the trainer's inject site: {sites['named']} {list(sites['sites'])[:3]}", flush=True)
    return row


def check_trainer(base: list[str], steps: int, skip: int, work: str, timeout: float) -> dict[str, Any]:
    out = os.path.join(work, "trainer.json")
    env = {"HPAR_RUN_DIR": os.path.join(work, "trainer"), "HPAR_TRACES": "file", "HPAR_METRICS_PORT": "0"}
    res = run_trainer([*base, "--steps", str(steps), "--log-every", "1000", "--out", out], env, timeout)
    if res.returncode:
        print(f"  trainer failed rc {res.returncode}: {res.stderr[-1500:]}")
        return {"rc": res.returncode, "stderr_tail": res.stderr[-1500:]}
    s = json.loads(Path(out).read_text())
    times, losses = s["step_times"], [v for v in s["losses"] if v is not None]
    row = {"rc": 0, "args": base, "steps": steps, "step_s_median": statistics.median(times[skip:]),
           "first_step_s": times[0], "loss_first": losses[0], "loss_last": losses[-1]}
    print(f"  {' '.join(base)}: step {row['step_s_median'] * 1e3:.2f} ms (median after {skip}; first "
          f"{times[0]:.1f} s), loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return row


def rank_info(agent: hpar_agent.Agent) -> dict[str, str]:
    for fam in agent.registry.collect():
        for s in fam.samples:
            if s.name == "hpar_rank_info":
                return dict(s.labels)
    return {}


def sysfs_gpu(device: torch.device) -> dict[str, Any]:
    """The GPU's PCI device in sysfs: ideal CPUs and NUMA node, read without NVML."""
    p = torch.cuda.get_device_properties(device)
    bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    root = Path("/sys/bus/pci/devices") / str(bus).lower()
    out: dict[str, Any] = {"pci": str(bus).lower()}
    for name in ("local_cpulist", "numa_node"):
        try:
            out[name] = (root / name).read_text().strip()
        except OSError as exc:
            out[name] = f"unreadable: {exc}"
    return out


PINNED = """
import os, sys, time, torch, hpar_agent
agent = hpar_agent.attach(metrics_port=0, traces="none", run_dir=sys.argv[1], interval=0.2)
x = torch.ones(1 << 20, device="cuda")
for _ in range(20):
    x.mul_(1.0001); agent.step(); time.sleep(0.05)
hpar_agent.detach()
"""


def check_binding(agent: hpar_agent.Agent, device: torch.device, work: str) -> dict[str, Any]:
    from hpar_agent.affinity import cpu_list, parse_cpu_list
    from hpar_agent.tools.doctor import _numa

    info = rank_info(agent)
    res: dict[str, Any] = {"rank_info": {k: info.get(k, "") for k in (
        "numa_node", "cpu_affinity", "gpu_numa_node", "gpu_cpu_affinity", "gpu_index")}}
    allowed = set(os.sched_getaffinity(0))
    res["sched_getaffinity"] = cpu_list(allowed)
    res["sysfs"] = sysfs_gpu(device) if device.type == "cuda" else {}
    res["doctor"] = [f"{c.status}: {c.detail}" for c in _numa()]
    probs = []
    if info.get("cpu_affinity") != cpu_list(allowed):
        probs.append("cpu_affinity label differs from sched_getaffinity")
    ideal_sysfs = res["sysfs"].get("local_cpulist", "")
    if device.type == "cuda" and not ideal_sysfs.startswith("unreadable"):
        ideal = parse_cpu_list(ideal_sysfs)
        if info.get("gpu_cpu_affinity") != cpu_list(ideal):
            probs.append(f"gpu_cpu_affinity {info.get('gpu_cpu_affinity')!r} != sysfs local_cpulist {cpu_list(ideal)!r}")
        node = res["sysfs"].get("numa_node", "")
        if node not in ("", "-1") and info.get("gpu_numa_node") != node:
            probs.append(f"gpu_numa_node {info.get('gpu_numa_node')!r} != sysfs numa_node {node!r}")
        off = sorted(allowed - ideal)
        res["off_node_cpus"] = cpu_list(set(off))
        if off:  # pin a subprocess where the GPU would not have it: NumaMisbinding must fire
            run = os.path.join(work, "pinned")
            subprocess.run(["taskset", "-c", cpu_list(set(off)), sys.executable, "-c", PINNED, run],
                           timeout=120, capture_output=True, text=True)
            fired = alert_events(run, "NumaMisbinding")
            res["pinned_off_node_alert"] = bool(fired)
            if not fired:
                probs.append("NumaMisbinding did not fire with the process pinned off the GPU's CPUs")
        if alert_events(agent.run_dir, "NumaMisbinding"):
            probs.append("NumaMisbinding fired in the unpinned process")
    res["problems"] = probs
    for k, v in res.items():
        print(f"  {k}: {v}")
    return res


def check_stream_handle(device: torch.device, work: str) -> dict[str, Any]:
    """A one-stage pipeline traced every step: its chunk spans name the stream and carry its handle."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    run = os.path.join(work, "stream")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).to(device)
    stage = PipelineStage(model, 0, 1, device)
    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().mean())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    agent = hpar_agent.attach(model, optimizer=opt, metrics_port=0, traces="file", trace_every=1,
                              run_dir=run, interval=0.2)
    agent.watch_pipeline(schedule=sched)
    x = torch.randn(8, 256, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    for i in range(12):  # half on the current stream, half on a side stream: two handles
        with torch.cuda.stream(side) if side is not None and i >= 6 else contextlib.nullcontext():
            sched.step(x, target=x)
            opt.step()
            opt.zero_grad()
    expect = ({int(torch.cuda.current_stream(device).cuda_stream), int(side.cuda_stream)}
              if side is not None else None)
    if side is not None:
        torch.cuda.synchronize(device)
    hpar_agent.detach()
    handles: set[int] = set()
    names: set[str] = set()
    spans = 0
    for path in glob.glob(os.path.join(run, "traces.rank*.jsonl")):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for sp in ss.get("spans", []):
                        if sp["name"] != "pp.forward":
                            continue
                        spans += 1
                        for kv in sp.get("attributes", []):
                            v = kv["value"]
                            if kv["key"] == "cuda.stream.handle":
                                handles.add(int(v.get("intValue", -1)))
                            elif kv["key"] == "cuda.stream":
                                names.add(v.get("stringValue", ""))
    out: dict[str, Any] = {"pp_forward_spans": spans, "handles": sorted(handles), "names": sorted(names),
                           "expected_handles": sorted(expect) if expect else None, "problems": []}
    if not spans:
        out["problems"].append("no pp.forward span")
    elif expect is not None and handles != expect:
        out["problems"].append(f"cuda.stream.handle {sorted(handles)} != the streams used {sorted(expect)}")
    return out


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every check on CPU (gloo, tiny), to test the script")
    ap.add_argument("--reps", type=int, default=10, help="collectives per (op, size)")
    ap.add_argument("--leak-steps", type=int, default=40, help="steps of the in-process leak run (60 ms each)")
    ap.add_argument("--trainer-leak-steps", type=int, default=150,
                    help="steps of the trainer leak runs (fast steps: the allocator is sampled every 50 ms)")
    ap.add_argument("--skip", nargs="*", default=[], help="checks to leave out (collectives nvml binding "
                    "cuda_leak fr_reader trainer_leak trainer)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per trainer subprocess")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        sys.exit("no GPU: use --cpu-smoke")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    work = tempfile.mkdtemp(prefix="hpar-validate-")
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "date": time.strftime("%Y-%m-%d"), "nccl_timing": os.environ["TORCH_NCCL_ENABLE_TIMING"]}
    print(f"torch {torch.__version__} on {result['device']}; TORCH_NCCL_ENABLE_TIMING={result['nccl_timing']}")
    if cuda:
        result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if cuda else None)
    agent = hpar_agent.attach(metrics_port=0, traces="none", run_dir=os.path.join(work, "inproc"), interval=3600.0)
    try:
        if "collectives" not in a.skip:
            print("collectives (agent FR durations vs torch.profiler device time):")
            result["collectives"] = check_collectives(agent, device, a.reps)
        if "nvml" not in a.skip:
            print("nvml:")
            result["nvml"] = check_nvml(agent)
        if "binding" not in a.skip:
            print("binding (NUMA/CPU labels vs sysfs, doctor, pinned subprocess; stream handle on spans):")
            result["binding"] = check_binding(agent, device, work)
        if "cuda_leak" not in a.skip:
            print("cuda_leak (in-process, CUDA tensors held every step):")
            result["cuda_leak"] = check_cuda_leak(agent, device, a.leak_steps, 8 * MiB if cuda else 2 * MiB)
    finally:
        hpar_agent.detach()
    try:
        if "fr_reader" not in a.skip:  # its own agent, its full reads in the reader process
            print("fr_reader (full FR dumps through torch's worker server vs in-process, read by the reader process):")
            result["fr_reader"] = check_fr_reader(device, a.reps * 5, work)
        if "binding" not in a.skip:  # its own agent: attach() while one runs returns the running one
            print("stream handle (one-stage pipeline, every step traced):")
            stream = result["binding"]["stream"] = check_stream_handle(device, work)
            result["binding"]["problems"] += stream["problems"]
            print(f"  {stream}")
    finally:
        dist.destroy_process_group()
    base = CONFIGS["gpu" if cuda else "cpu-smoke"]["args"]
    small = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "32", "--global-batch", "8",
             "--device", "cuda" if cuda else "cpu"]
    if "trainer_leak" not in a.skip:
        print("trainer_leak (torchrun, 1 rank, --inject):")
        result["trainer_leak"] = [check_trainer_leak(i, small, a.trainer_leak_steps, work, a.timeout)
                                  for i in ("tensor-leak", "compile-leak")]
    if "trainer" not in a.skip:
        print("trainer (1 rank):")
        result["trainer"] = check_trainer(base, 30 if cuda else 8, 5 if cuda else 3, work, a.timeout)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
