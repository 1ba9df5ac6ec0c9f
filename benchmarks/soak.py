"""Soak: the 4-rank CPU trainer with the agent for 10,000+ steps while the OTLP endpoint flaps.

The trainer runs under torchrun (default dp1 x tp2 x pp2, 1F1B, tiny model, ``--compile none``) with
tracing on (``HPAR_TRACE_EVERY`` small, ``HPAR_TRACES=otlp``) into a real OTLP/HTTP receiver
(``testkit/otlp_receiver.py``) that this script takes down and brings back up on a timer. Every
``--sample-every`` seconds it reads, for each rank, the thread count and open file descriptors from
``/proc/<pid>/status`` and ``/proc/<pid>/fd`` and then the rank's own /metrics (``hpar_host_rss_bytes``,
``hpar_steps_total``, dropped spans, agent errors), and it rewrites the JSON after every sample, so an
interrupted soak still leaves its data.

RSS is read from ``/proc/<pid>/status`` (VmRSS) in both arms; with the agent on, its
``hpar_host_rss_bytes`` is kept next to it (``metric_rss_bytes``). The step number is the trainer's own:
the log rank's ``step N loss ... step_time`` lines (``--log-every``) read from torchrun's output as it
streams (ranks of the PP schedule run in lockstep); with the agent on, ``hpar_steps_total`` is kept too
(``agent_steps``).

``--no-agent`` is the baseline arm: the trainer runs with ``--no-agent``, no OTLP receiver or flapper is
started and nothing is scraped; the ranks are sampled from /proc exactly as with the agent on, so the
two arms' RSS slopes can be read against each other.

At the end it fits a least-squares line to RSS and to the thread count against the step number, after
warm-up, per rank. The trainer itself keeps a small record per step in memory (``RankRecorder`` step
dicts and the loss list); ``trainer_record_bytes_per_step`` measures that growth with tracemalloc so the
RSS slope can be read against it. ``--out`` is not passed to the trainer: with it every rank rewrites its
whole per-step JSON after every step, which is quadratic over 10,000 steps.

    python -m benchmarks.soak --steps 10000 --json soak.json
    python -m benchmarks.soak --no-agent --steps 10000 --json soak-off.json

Stop early with ``--max-minutes`` (the run is ended and the JSON says how many steps it reached).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hpar_agent.detectors.signals import theil_sen_slope
from hpar_agent.tools.launch import torchrun_cmd
from testkit.otlp_receiver import HttpReceiver
from testkit.ports import free_base_port

TRAINER_ARGS = (
    "--dp 1 --tp 2 --pp 2 --schedule 1f1b --microbatches 2 --global-batch 4 "
    "--seq-len 16 --layers 2 --dim 32 --heads 2 --vocab 64 --compile none "
    "--device cpu"
).split()


class CountingReceiver(HttpReceiver):
    """The test receiver, counting spans (per rank: the last step traced) instead of keeping them."""

    def __init__(self) -> None:
        super().__init__()
        self.span_count = 0
        self.last_step: dict[int, int] = {}

    def _accept(self, request: Any) -> None:
        with self._cond:
            self.requests += 1
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.span_count += 1
                        if s.name == "train.step":
                            attrs = {kv.key: kv.value.int_value for kv in s.attributes}
                            rank, step = int(attrs.get("hpar.rank", -1)), int(attrs.get("hpar.step", -1))
                            self.last_step[rank] = max(step, self.last_step.get(rank, -1))


def flapper(receiver: CountingReceiver, down_s: float, up_s: float, stop: threading.Event, log: list) -> None:
    """Take the receiver down for ``down_s`` seconds every ``down_s + up_s`` seconds."""
    while not stop.wait(up_s):
        receiver.set_mode("down")
        log.append((time.time(), "down"))
        if stop.wait(down_s):
            break
        receiver.set_mode("up")
        log.append((time.time(), "up"))
    if receiver.mode == "down":
        receiver.set_mode("up")
        log.append((time.time(), "up"))


STEP_LINE = re.compile(rb"hpar_trainer: step (\d+) loss \S+ step_time")


class LogSteps:
    """The trainer's step count from its log rank's ``step N loss ... step_time`` lines in torchrun's output
    (the file torchrun writes to), read incrementally: ``steps`` is N + 1, the steps completed, as
    ``hpar_steps_total`` counts them; None before the first line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.steps: int | None = None
        self.lines = 0

    def poll(self) -> int | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.steps
        self.offset += len(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            m = STEP_LINE.search(line)
            if m:
                self.lines += 1
                self.steps = max(int(m.group(1)) + 1, self.steps or 0)
        return self.steps


def rank_pids(job_id: str) -> dict[int, int]:
    """rank -> pid of this soak's trainer processes (torchrun workers carry RANK and our job id)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HPAR_JOB_ID={job_id}".encode() in env:
            rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(entry)
    return found


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "Threads":
                out["threads"] = int(value)
            elif key == "VmRSS":
                out["vmrss_bytes"] = int(value.split()[0]) * 1024
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        pass
    return out


def scrape_values(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = {
        "hpar_host_rss_bytes": "metric_rss_bytes",
        "hpar_steps_total": "agent_steps",
        "hpar_agent_spans_dropped_total": "spans_dropped",
        "hpar_agent_errors_total": "agent_errors",
        "hpar_agent_buffer_dropped_total": "buffer_dropped",
    }
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[want[s.name]] = out.get(want[s.name], 0.0) + s.value
    out["scrape_bytes"] = len(text)
    return out


def fit(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def trainer_record_bytes_per_step(n: int = 10_000) -> float:
    """Python heap the trainer's own per-step record takes (RankRecorder step dict + losses list entry)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    steps: list[dict[str, Any]] = []
    losses: list[float | None] = []
    for i in range(n):
        cur: dict[str, Any] = {"step": i, "fwd_s": 0.001 * i}
        cur.update(step_s=0.1 + i * 1e-9, loss=1.0 + i * 1e-9, rss_mb=300.0 + i * 1e-9, leaked_bytes=0)
        steps.append(cur)
        losses.append(1.0 + i * 1e-9)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / n


def analyse(samples: list[dict[str, Any]], nproc: int, warmup: int, calib: float) -> dict[str, Any]:
    """Per rank fits over the samples taken inside the training loop after warm-up (a sample whose step
    count already reads the last step was taken in teardown: summary, detach, process-group exit)."""
    out: dict[str, Any] = {}
    for r in range(nproc):
        rows = [s["ranks"][str(r)] for s in samples if str(r) in s["ranks"] and not s.get("teardown")]
        rows = [x for x in rows if "steps" in x and "rss_bytes" in x]
        after = [x for x in rows if x["steps"] >= warmup]
        if len(after) < 3:
            out[str(r)] = {"samples_after_warmup": len(after)}
            continue
        steps = [x["steps"] for x in after]
        rss = [x["rss_bytes"] for x in after]
        threads = [x.get("threads", 0) for x in after]
        fds = [x.get("fds", 0) for x in after]
        rss_slope = fit(steps, rss) or 0.0
        robust = theil_sen_slope(
            list(zip(steps, rss, strict=True))
        )  # RSS dips now and then: a median ignores them
        thr_slope = fit(steps, threads) or 0.0
        out[str(r)] = {
            "rss_source": "/proc VmRSS",
            "samples_after_warmup": len(after),
            "steps_range": [steps[0], steps[-1]],
            "rss_first_mb": round(rss[0] / 2**20, 1),
            "rss_last_mb": round(rss[-1] / 2**20, 1),
            "rss_min_mb": round(min(rss) / 2**20, 1),
            "rss_max_mb": round(max(rss) / 2**20, 1),
            "rss_slope_bytes_per_step": round(rss_slope, 1),
            "rss_slope_minus_trainer_record": round(rss_slope - calib, 1),
            "rss_growth_per_10k_steps_mb": round(rss_slope * 10_000 / 2**20, 2),
            "rss_slope_robust_bytes_per_step": round(robust, 1),
            "rss_slope_robust_minus_trainer_record": round(robust - calib, 1),
            "threads_min": min(threads),
            "threads_max": max(threads),
            "threads_slope_per_1k_steps": round(thr_slope * 1000, 4),
            "fds_min": min(fds),
            "fds_max": max(fds),
        }
        # Agent on: its own RSS gauge against its own step counter, as the earlier soaks reported it.
        metric = [
            x for x in rows if "agent_steps" in x and "metric_rss_bytes" in x and x["agent_steps"] >= warmup
        ]
        if len(metric) >= 3:
            m_slope = fit([x["agent_steps"] for x in metric], [x["metric_rss_bytes"] for x in metric]) or 0.0
            out[str(r)].update(
                metric_rss_slope_bytes_per_step=round(m_slope, 1),
                metric_rss_first_mb=round(metric[0]["metric_rss_bytes"] / 2**20, 1),
                metric_rss_last_mb=round(metric[-1]["metric_rss_bytes"] / 2**20, 1),
                spans_dropped=after[-1].get("spans_dropped"),
                agent_errors=after[-1].get("agent_errors"),
                buffer_dropped=after[-1].get("buffer_dropped"),
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument(
        "--no-agent",
        action="store_true",
        help="baseline arm: trainer --no-agent, no OTLP receiver, no scrape",
    )
    p.add_argument("--log-every", type=int, default=10, help="trainer --log-every: the step number's source")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--trace-every", type=int, default=5, help="HPAR_TRACE_EVERY")
    p.add_argument("--sample-every", type=float, default=15.0, help="seconds between samples")
    p.add_argument("--flap-down", type=float, default=20.0, help="seconds the OTLP endpoint stays down")
    p.add_argument("--flap-up", type=float, default=40.0, help="seconds it stays up between outages")
    p.add_argument(
        "--warmup", type=int, default=0, help="steps left out of the fits (default: 10%% of --steps)"
    )
    p.add_argument("--max-minutes", type=float, default=0, help="end the run after this long (0: no limit)")
    p.add_argument(
        "--max-rss-slope", type=float, default=1024.0, help="flat: B/step beyond the trainer's record"
    )
    p.add_argument("--json", default="soak.json")
    p.add_argument("--run-dir", help="the run's files (default: a temporary directory)")
    a = p.parse_args(argv)

    import torch

    warmup = a.warmup or a.steps // 10
    tmp = tempfile.TemporaryDirectory(prefix="hpar-soak-")
    run_dir = Path(a.run_dir) if a.run_dir else Path(tmp.name) / "soak"
    run_dir.mkdir(parents=True, exist_ok=True)
    job_id = f"soak-{os.getpid()}-{int(time.time())}"
    calib = trainer_record_bytes_per_step()

    agent_on = not a.no_agent
    base = free_base_port(a.nproc) if agent_on else 0
    receiver: CountingReceiver | None = None
    stop = threading.Event()
    flaps: list[tuple[float, str]] = []
    flap_thread: threading.Thread | None = None
    args = [*TRAINER_ARGS, "--steps", str(a.steps), "--log-every", str(a.log_every)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HPAR_RUN_DIR": str(run_dir),
        "HPAR_JOB_ID": job_id,  # how rank_pids finds the ranks; the trainer ignores it with --no-agent
    }
    if agent_on:
        receiver = CountingReceiver()
        receiver.__enter__()
        flap_thread = threading.Thread(
            target=flapper, args=(receiver, a.flap_down, a.flap_up, stop, flaps), name="flapper", daemon=True
        )
        env.update(
            {
                "HPAR_METRICS_PORT": str(base),
                "HPAR_METRICS_ADDR": "127.0.0.1",
                "HPAR_METRICS_PORT_FALLBACK": "0",
                "HPAR_TRACE_EVERY": str(a.trace_every),
                "HPAR_TRACES": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
            }
        )
    else:
        args.append("--no-agent")
    log_path = run_dir / "torchrun.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    log_steps = LogSteps(log_path)
    t0 = time.time()
    proc = subprocess.Popen(
        torchrun_cmd(a.nproc, "hpar_trainer", args),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: ended as a group if --max-minutes runs out
    )
    if flap_thread is not None:
        flap_thread.start()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trainer_args": args,
        "arm": "agent_on" if agent_on else "agent_off",
        "rss_source": "/proc/<pid>/status VmRSS"
        + (" (+ hpar_host_rss_bytes as metric_rss_bytes)" if agent_on else ""),
        "step_source": f"trainer log rank 'step N loss' lines, --log-every {a.log_every} (steps = N + 1)",
        "nproc": a.nproc,
        "steps_requested": a.steps,
        "trace_every": a.trace_every if agent_on else None,
        "flap": {"down_s": a.flap_down, "up_s": a.flap_up} if agent_on else None,
        "warmup_steps": warmup,
        "trainer_record_bytes_per_step": round(calib, 1),
        "samples": [],
    }
    samples: list[dict[str, Any]] = result["samples"]
    pids: dict[int, int] = {}
    ended_early = False
    try:
        while proc.poll() is None:
            if a.max_minutes and time.time() - t0 > a.max_minutes * 60:
                ended_early = True
                break
            time.sleep(a.sample_every)
            if len(pids) < a.nproc:
                pids = rank_pids(job_id)
            sample: dict[str, Any] = {"t": round(time.time() - t0, 1), "ranks": {}}
            if receiver is not None:
                sample.update(
                    otlp_mode=receiver.mode,
                    spans_received=receiver.span_count,
                    otlp_requests=receiver.requests,
                    last_traced_step=dict(receiver.last_step),
                )
            for r, pid in sorted(pids.items()):
                status = proc_status(pid)  # /proc first: no scrape thread in it
                if "vmrss_bytes" not in status:
                    continue  # the rank has exited or is a zombie (torchrun outlives its workers a few seconds)
                row: dict[str, Any] = {"pid": pid, **status}
                if "vmrss_bytes" in row:
                    row["rss_bytes"] = row.pop("vmrss_bytes")
                if agent_on:
                    try:
                        row.update(scrape_values(f"http://127.0.0.1:{base + r}/metrics"))
                    except OSError:
                        pass
                sample["ranks"][str(r)] = row
            # The step after the /proc reads: the log line lags the step by < --log-every steps either way.
            steps_now = log_steps.poll()
            sample["log_steps"] = steps_now
            sample["teardown"] = steps_now is not None and steps_now >= a.steps
            if steps_now is not None:
                for row in sample["ranks"].values():
                    row["steps"] = steps_now
            samples.append(sample)
            otlp = f" spans={receiver.span_count} otlp={receiver.mode}" if receiver is not None else ""
            print(
                f"t={sample['t']:7.0f}s steps={steps_now} "
                f"rss_mb={[round(x.get('rss_bytes', 0) / 2**20) for x in sample['ranks'].values()]} "
                f"threads={[x.get('threads') for x in sample['ranks'].values()]} "
                f"fds={[x.get('fds') for x in sample['ranks'].values()]}{otlp}",
                flush=True,
            )
            result["analysis"] = analyse(samples, a.nproc, warmup, calib)
            _write(a.json, result)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        stop.set()
        if flap_thread is not None:
            flap_thread.join(a.flap_down + a.flap_up + 5)
        if receiver is not None:
            receiver.__exit__(None, None, None)
        log.close()

    reached = log_steps.poll() or 0  # the whole log, to the last line the trainer wrote
    analysis = analyse(samples, a.nproc, warmup, calib)
    per_rank = [v for v in analysis.values() if "rss_slope_bytes_per_step" in v]
    result.update(
        wall_s=round(time.time() - t0, 1),
        trainer_rc=proc.returncode,
        ended_early=ended_early,
        steps_reached=reached,
        agent_steps_reached=max(
            (min(x.get("agent_steps", 0) for x in s["ranks"].values()) for s in samples if s["ranks"]),
            default=0,
        )
        if agent_on
        else None,
        flaps=len([f for f in flaps if f[1] == "down"]) if agent_on else None,
        spans_received=receiver.span_count if receiver is not None else None,
        otlp_requests=receiver.requests if receiver is not None else None,
        analysis=analysis,
        rss_flat=bool(per_rank)
        and all(abs(v["rss_slope_robust_minus_trainer_record"]) <= a.max_rss_slope for v in per_rank),
        threads_flat=bool(per_rank) and all(v["threads_max"] - v["threads_min"] <= 1 for v in per_rank),
    )
    _write(a.json, result)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if not ended_early and proc.returncode != 0:
        print((run_dir / "torchrun.log").read_text()[-3000:], file=sys.stderr)
    tmp.cleanup()
    return 0 if result["rss_flat"] and result["threads_flat"] else 1


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
