"""What the agent's metrics cost at scale, from one rank's series to a Prometheus scraping hundreds.

count       the series one rank exports, counted on a live 8-rank CPU run (dp2 x tp2 x pp2, 1F1B,
            aot_eager) as Prometheus stores them (a histogram is its buckets + 1 ``_bucket`` series,
            ``_sum`` and ``_count``; plus 5 synthetic series a target), projected to 1,024 and 8,192
            ranks; the worst case a rank at every cap the code enforces (``caps()``, read from the
            code); the trace volume (spans per traced step, OTLP bytes a span). ``--save-scrapes DIR``
            keeps each rank's OpenMetrics scrape (``rank<r>.om``) for ``prometheus``.
prometheus  a real Prometheus (the Debian binary, the shipped rules loaded, ``testkit.prom_stack``)
            scraping ``TARGETS`` simulated ranks (``testkit.metrics_sim`` replaying those scrapes) every
            ``INTERVAL`` s for ``--duration``: its CPU and memory, head series, samples a second, scrape
            durations, rule-group evaluation time and missed evaluations, the simulator's CPU;
flood       a training-like loop's step time while ``--clients`` threads of another process scrape
            the agent's endpoint as fast as they can, against the same flood on a static server (the
            flood's own CPU) and no flood, in rotating order.

  python -m benchmarks.scale count --json series.json --save-scrapes scrapes/
  python -m benchmarks.scale prometheus --scrapes scrapes/ --cases 64:1 256:5 256:15 --json prom.json
  python -m benchmarks.scale flood --rounds 6 --seconds 3 --clients 8
"""

from __future__ import annotations

import argparse
import base64
import datetime
import http.server
import json
import multiprocessing as mp
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hpar_agent import catalogue as cat

#: Series Prometheus adds for every target (up, scrape_duration_seconds, scrape_samples_scraped,
#: scrape_samples_post_metric_relabeling, scrape_series_added).
SYNTHETIC_PER_TARGET = 5
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
PROJECT_TO = (1024, 8192)


# ------------------------------------------------------------------------------------ count
def scrape(url: str, openmetrics: bool = False) -> str:
    req = urllib.request.Request(url, headers={"Accept": OPENMETRICS_ACCEPT} if openmetrics else {})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def count_series(text: str) -> dict[str, Any]:
    """Series per catalogue metric in one scrape (text format), and the values of each non-common label."""
    by_metric: Counter[str] = Counter()
    label_values: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + ("_total" if fam.type == "counter" else "_info" if fam.type == "info" else "")
        for s in fam.samples:
            by_metric[name] += 1
            for k, v in s.labels.items():
                if k not in cat.COMMON_LABELS and k != "le" and s.name != "hpar_rank_info":
                    label_values.setdefault(k, set()).add(v)
    return {
        "total": sum(by_metric.values()),
        "by_metric": dict(sorted(by_metric.items())),
        "label_values": {k: sorted(v) for k, v in sorted(label_values.items())},
    }


def samples_per_series(spec: cat.MetricSpec) -> int:
    """Stored series per label set: a histogram has a bucket per bound and +Inf, then _sum and _count."""
    if spec.type != "histogram":
        return 1
    step_like = ("hpar_step_duration_seconds", "hpar_dynamo_compile_duration_seconds")
    return len(cat.STEP_BUCKETS if spec.name in step_like else cat.LATENCY_BUCKETS) + 3


def caps() -> dict[str, int]:
    """How many values each bounded label can take, read from the code that bounds it."""
    from hpar_agent import streams
    from hpar_agent.collectors import collectives, compile, memory, pipeline
    from hpar_agent.torch_compat import dynamo, dynamo_log, fr_decode

    return {
        "pg": collectives.CollectiveCollector().max_pgs + 2,  # named groups, then "other"; plus "pp"
        "op": len(set(fr_decode._OP_ALIASES.values()) | {fr_decode.OTHER}),
        "stream (pipeline)": streams.MAX_STREAMS + 1,
        "phase (pipeline)": len(pipeline._METHODS),
        "phase (compile)": len(compile.PHASES) + 1,
        "outcome x trigger": 4 * 3,
        "reason (recompiles)": len({k for _p, k in dynamo_log._GUARD_KINDS} | {"other"}),
        "reason (graph breaks)": compile.MAX_BREAK_KEYS + 1,
        "reason (throttle)": len(memory.THROTTLE_REASONS),
        "cache x result": len(set(dynamo.CACHE_COUNTERS.values())),
        "alert": len(cat.ALERT_NAMES),
    }


def worst_case(observed: dict[str, int]) -> dict[str, int]:
    """Per-rank series of each metric at every cap (the observed count where a label has no cap: the
    components and buffers installed, a fixed set)."""
    c = caps()
    pgs, ops = c["pg"], c["op"]
    label_sets = {
        "hpar_collective_duration_seconds": pgs * ops,
        "hpar_collectives_total": pgs * ops,
        "hpar_collective_bytes_total": pgs * ops,
        "hpar_collective_busbw_bytes_per_second": pgs * ops,
        "hpar_collective_inflight": pgs,
        "hpar_collective_oldest_inflight_age_seconds": pgs,
        "hpar_collective_last_completed_seq": pgs,
        "hpar_collective_unobserved_total": pgs,
        "hpar_dynamo_compiles_total": c["outcome x trigger"],
        "hpar_dynamo_recompiles_total": c["reason (recompiles)"],
        "hpar_dynamo_graph_breaks_total": c["reason (graph breaks)"],
        "hpar_dynamo_cache_events_total": c["cache x result"],
        "hpar_dynamo_compile_duration_seconds": c["phase (compile)"],
        "hpar_pp_chunk_duration_seconds": c["phase (pipeline)"] * c["stream (pipeline)"],
        "hpar_gpu_clock_hertz": 2,
        "hpar_gpu_ecc_errors_total": 2,
        "hpar_gpu_throttle_active": c["reason (throttle)"],
        "hpar_allocator_bytes": 3,
        "hpar_allocator_peak_bytes": 3,
        "hpar_memory_post_step_bytes": 3,
        "hpar_alert_active": c["alert"],
        "hpar_alerts_total": c["alert"],
        "hpar_detector_value": c["alert"],
    }
    out = {}
    for spec in cat.METRICS:
        if spec.name in label_sets:
            out[spec.name] = label_sets[spec.name] * samples_per_series(spec)
        elif not spec.labels:
            out[spec.name] = samples_per_series(spec)
        else:
            out[spec.name] = observed.get(spec.name, 0)
    return out


def trace_volume(run_dir: Path) -> dict[str, Any]:
    """Spans per traced step per rank and OTLP protobuf bytes a span, from the run's local trace files
    (OTLP/JSON lines, ids in hex), over the steps without a compile span."""
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    def b64(doc: Any) -> None:
        for k, v in doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ():
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                doc[k] = base64.b64encode(bytes.fromhex(v)).decode()
            else:
                b64(v)

    per_step: dict[tuple[int, int], Counter[str]] = {}
    wire = spans = 0
    for f in sorted(run_dir.glob("traces.rank*.jsonl")):
        rank = int(f.name.split("rank")[1].split(".")[0])
        for line in f.read_text().splitlines():
            doc = json.loads(line)
            for rs in doc.get("resourceSpans", ()):
                for ss in rs.get("scopeSpans", ()):
                    for sp in ss.get("spans", ()):
                        attrs = {a["key"]: a["value"] for a in sp.get("attributes", ())}
                        step = int(attrs.get("hpar.step", {}).get("intValue", -1))
                        per_step.setdefault((rank, step), Counter())[sp["name"]] += 1
                        spans += 1
            b64(doc)
            wire += ParseDict(doc, trace_service_pb2.ExportTraceServiceRequest()).ByteSize()
    steady = sorted(
        sum(c.values()) for c in per_step.values() if "dynamo.compile" not in c and "train.step" in c
    )
    return {
        "spans": spans,
        "bytes_per_span": round(wire / spans, 1) if spans else None,
        "spans_per_rank_step_median": steady[len(steady) // 2] if steady else None,
        "spans_per_rank_step_range": [steady[0], steady[-1]] if steady else None,
    }


def count(a: argparse.Namespace) -> dict[str, Any]:
    from testkit.live_run import LiveRun

    args = [
        "--dp",
        str(a.dp),
        "--tp",
        str(a.tp),
        "--pp",
        str(a.pp),
        "--schedule",
        "1f1b",
        "--compile",
        a.compile,
        "--steps",
        str(a.steps),
        *"--log-every 1 --device cpu".split(),
        *shlex.split(a.extra),
    ]
    run_dir = Path(tempfile.mkdtemp(prefix="hpar-series-")) / "series"
    t0 = time.time()
    run = LiveRun(run_dir, args, nproc=a.nproc, env={"HPAR_TRACE_EVERY": "1", "HPAR_TRACES": "file"})
    try:
        run.wait_for_steps(a.scrape_at, timeout=a.timeout)
        oms = [scrape(run.url(r), openmetrics=True) for r in range(a.nproc)]
        counts = [count_series(scrape(run.url(r))) for r in range(a.nproc)]
        rc = run.wait(timeout=a.timeout)
    except BaseException:
        run.kill()
        raise
    if a.save_scrapes:
        Path(a.save_scrapes).mkdir(parents=True, exist_ok=True)
        for r, text in enumerate(oms):
            Path(a.save_scrapes, f"rank{r}.om").write_text(text)
    per_rank = [c["total"] for c in counts]
    by_metric = {
        m: [c["by_metric"].get(m, 0) for c in counts]
        for m in sorted({m for c in counts for m in c["by_metric"]})
    }
    worst = worst_case({m: max(v) for m, v in by_metric.items()})
    mean = statistics.fmean(per_rank) + SYNTHETIC_PER_TARGET
    return {
        "trainer_args": args,
        "nproc": a.nproc,
        "trainer_rc": rc,
        "run_s": round(time.time() - t0, 1),
        "per_rank_series": per_rank,
        "by_metric": by_metric,
        "caps": caps(),
        "label_values": {
            k: sorted({v for c in counts for v in c["label_values"].get(k, ())})
            for k in sorted({k for c in counts for k in c["label_values"]})
        },
        "projection": {str(n): round(n * mean) for n in PROJECT_TO},
        "worst_case_per_rank": sum(worst.values()),
        "worst_case_by_metric": worst,
        "worst_case_projection": {
            str(n): n * (sum(worst.values()) + SYNTHETIC_PER_TARGET) for n in PROJECT_TO
        },
        "trace_volume": trace_volume(run_dir),
    }


def print_count(r: dict[str, Any]) -> None:
    print(
        f"{r['nproc']} ranks (trainer rc {r['trainer_rc']}): series per rank {r['per_rank_series']}; worst case "
        f"at every cap {r['worst_case_per_rank']:,}"
    )
    print(f"{'metric':48} {'min':>5} {'max':>5} {'cap':>6}")
    for m, v in sorted(r["by_metric"].items(), key=lambda kv: -max(kv[1])):
        print(f"{m:48} {min(v):5d} {max(v):5d} {r['worst_case_by_metric'].get(m, 0):6d}")
    print(
        "per job (with Prometheus' 5 a target): "
        + ", ".join(
            f"{n} ranks {v:,} (worst {r['worst_case_projection'][n]:,})" for n, v in r["projection"].items()
        )
    )
    tv = r["trace_volume"]
    print(
        f"traces: {tv['spans_per_rank_step_median']} spans a traced step a rank ({tv['spans_per_rank_step_range']}), "
        f"{tv['bytes_per_span']} OTLP bytes a span"
    )


# ------------------------------------------------------------------------------------ prometheus
def prom_self(url: str) -> dict[str, float]:
    """Prometheus's own /metrics: the families this benchmark reads, name{labels} -> value."""
    want = (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "prometheus_tsdb_head_series",
        "prometheus_tsdb_head_samples_appended_total",
        "prometheus_rule_group_last_duration_seconds",
        "prometheus_rule_group_iterations_missed_total",
        "prometheus_rule_evaluation_failures_total",
    )
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode().splitlines():
        if line.startswith(want):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def total(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def prometheus_case(targets: int, interval: float, duration: float, scrapes: list[Path]) -> dict[str, Any]:
    from testkit.ports import free_base_port
    from testkit.prom_stack import PromStack

    work = Path(tempfile.mkdtemp(prefix="hpar-scale-"))
    for _attempt in range(5):  # a port of the range can be taken between the check and the bind
        base = free_base_port(targets)
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.metrics_sim",
                "--base",
                str(base),
                "--targets",
                str(targets),
                "--interval",
                str(interval),
                "--gzip",
                "--scrapes",
                *map(str, scrapes),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sim.stdout is not None
        if sim.stdout.readline().strip() == "ready":
            break
        sim.wait(30)
    else:
        raise RuntimeError("the simulator could not bind its ports")
    stack = PromStack(work, ["hpar"], interval=f"{interval:g}s")
    try:
        stack.set_targets("hpar", [f"127.0.0.1:{base + i}" for i in range(targets)])
        polls, t0 = [], time.time()
        sim_cpu = Path(f"/proc/{sim.pid}/stat")
        while time.time() - t0 < duration:
            time.sleep(min(5.0, max(0.5, duration / 20)))
            fields = sim_cpu.read_text().rsplit(")", 1)[1].split()
            polls.append(
                {
                    "t": time.time() - t0,
                    "sim_cpu_s": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
                    **prom_self(stack.url),
                }
            )
        last = polls[-1]
        mid = min(polls, key=lambda p: abs(p["t"] - last["t"] / 2))  # rates over the second half
        span = last["t"] - mid["t"]

        def q(expr: str) -> float | None:
            got = stack.query(expr)
            return float(got[0]["value"][1]) if got else None

        groups = sorted(
            {k for p in polls for k in p if k.startswith("prometheus_rule_group_last_duration_seconds")}
        )
        samples = total(last, "prometheus_tsdb_head_samples_appended_total") - total(
            mid, "prometheus_tsdb_head_samples_appended_total"
        )
        return {
            "targets": targets,
            "interval_s": interval,
            "duration_s": round(last["t"], 1),
            "up": q('count(up{job="hpar"} == 1)'),
            "head_series": last.get("prometheus_tsdb_head_series"),
            "samples_per_s": round(samples / span),
            "rss_mb": round(last["process_resident_memory_bytes"] / 2**20, 1),
            "cpu_cores": round(
                (last["process_cpu_seconds_total"] - mid["process_cpu_seconds_total"]) / span, 3
            ),
            "scrape_avg_s": q('avg(avg_over_time(scrape_duration_seconds{job="hpar"}[1m]))'),
            "scrape_max_s": q('max(max_over_time(scrape_duration_seconds{job="hpar"}[1m]))'),
            "rule_groups_max_s": {
                g.split('rule_group="', 1)[1].split('"', 1)[0].rsplit(";", 1)[-1]: max(
                    p.get(g, 0.0) for p in polls
                )
                for g in groups
            },
            "rule_iterations_missed": total(last, "prometheus_rule_group_iterations_missed_total"),
            "rule_evaluation_failures": total(last, "prometheus_rule_evaluation_failures_total"),
            "simulator_cpu_cores": round((last["sim_cpu_s"] - mid["sim_cpu_s"]) / span, 3),
        }
    finally:
        stack.close()
        sim.terminate()
        sim.wait(20)


def prometheus(a: argparse.Namespace) -> dict[str, Any]:
    files: list[Path] = []
    for s in a.scrapes:
        files += (
            sorted(Path(s).glob("*.om"), key=lambda f: (len(f.name), f.name))
            if Path(s).is_dir()
            else [Path(s)]
        )
    out: dict[str, Any] = {"recorded_scrapes": [f.name for f in files], "cases": []}
    for case in a.cases:
        targets, interval = case.split(":")
        r = prometheus_case(int(targets), float(interval), a.duration, files)
        out["cases"].append(r)
        groups = ", ".join(f"{g} {v * 1e3:.0f} ms" for g, v in r["rule_groups_max_s"].items())
        print(
            f"{r['targets']:4d} targets @ {r['interval_s']:g} s: up {r['up']}, head series {r['head_series']:.0f}, "
            f"{r['samples_per_s']} samples/s, CPU {r['cpu_cores']} cores, RSS {r['rss_mb']} MB, scrape avg "
            f"{(r['scrape_avg_s'] or 0) * 1e3:.1f} ms max {(r['scrape_max_s'] or 0) * 1e3:.0f} ms; rule groups (max) "
            f"{groups}; missed {r['rule_iterations_missed']:.0f}; simulator {r['simulator_cpu_cores']} cores",
            flush=True,
        )
    return out


# ------------------------------------------------------------------------------------ flood
def _flooder(urls: Any, arm: Any, go: Any, done: Any, counter: Any, clients: int) -> None:
    """Child process: a static server (the control arm's target) and ``clients`` scraping threads."""
    body = b"# static\n" * 2000

    class Static(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Static)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    urls["control"] = f"http://127.0.0.1:{srv.server_address[1]}/metrics"

    def client() -> None:
        while not done.is_set():
            url = urls.get(arm.value.decode()) if go.wait(0.05) else None
            if not url:
                continue
            try:
                urllib.request.urlopen(url, timeout=10).read()
                with counter.get_lock():
                    counter.value += 1
            except OSError:
                pass

    for _ in range(clients):
        threading.Thread(target=client, daemon=True).start()
    done.wait()


def flood(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import hpar_agent

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    agent = hpar_agent.attach(
        model,
        metrics_port=0,
        metrics_addr="127.0.0.1",
        traces="none",
        run_dir=tempfile.mkdtemp(prefix="hpar-flood-"),
    )
    if agent.metrics_url is None:
        raise RuntimeError("no metrics endpoint")
    ctx = mp.get_context("spawn")
    mgr = ctx.Manager()
    urls = mgr.dict({"agent": agent.metrics_url, "quiet": ""})
    arm, go, done, counter = ctx.Array("c", 16), ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_flooder, args=(urls, arm, go, done, counter, a.clients), daemon=True)
    proc.start()
    while "control" not in urls:
        time.sleep(0.05)

    def run_arm(name: str) -> tuple[float, int]:
        arm.value = name.encode()  # type: ignore[attr-defined]  # a char array's value
        before = counter.value
        go.set()
        time.sleep(0.3)  # the flood is under way
        times, end = [], time.perf_counter() + a.seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        go.clear()
        time.sleep(0.3)
        return statistics.median(times), counter.value - before

    run_arm("quiet")  # warm-up
    arms = ["quiet", "agent", "control"]
    med: dict[str, list[float]] = {n: [] for n in arms}
    scrapes = dict.fromkeys(arms, 0)
    for r in range(a.rounds):
        for name in arms[r % 3 :] + arms[: r % 3]:
            m, n = run_arm(name)
            med[name].append(m)
            scrapes[name] += n
    done.set()
    proc.join(10)
    hpar_agent.detach()
    out = {
        "clients": a.clients,
        "cores": os.cpu_count(),
        "scrapes": scrapes,
        "step_ms": {n: statistics.median(v) * 1e3 for n, v in med.items()},
        "agent_over_quiet": statistics.median(x / q for x, q in zip(med["agent"], med["quiet"], strict=True)),
        "agent_over_control": statistics.median(
            x / c for x, c in zip(med["agent"], med["control"], strict=True)
        ),
    }
    for name in arms:
        print(f"{name:8} median step {out['step_ms'][name]:.3f} ms, scrapes {scrapes[name]}")
    print(
        f"agent/quiet {out['agent_over_quiet']:.4f}, agent/control {out['agent_over_control']:.4f} (the control "
        f"carries the flood's own CPU: the fair baseline with fewer cores than clients + 1; {out['cores']} cores)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("count", help="series per rank on a live 8-rank CPU run")
    for flag, default in (
        ("--nproc", 8),
        ("--dp", 2),
        ("--tp", 2),
        ("--pp", 2),
        ("--steps", 10),
        ("--scrape-at", 8),
    ):
        c.add_argument(flag, type=int, default=default)
    c.add_argument("--compile", default="aot_eager")
    c.add_argument("--extra", default="", help="more trainer arguments, e.g. '--inject graph-break'")
    c.add_argument("--timeout", type=float, default=900)
    c.add_argument("--save-scrapes", help="keep each rank's OpenMetrics scrape here (rank<r>.om)")
    pr = sub.add_parser("prometheus", help="a real Prometheus scraping simulated ranks")
    pr.add_argument(
        "--scrapes", nargs="+", required=True, help="recorded scrapes (files, or folders of *.om)"
    )
    pr.add_argument(
        "--cases", nargs="+", default=["64:1", "64:15", "256:1", "256:5", "256:15"], help="TARGETS:INTERVAL_S"
    )
    pr.add_argument("--duration", type=float, default=75.0, help="seconds per case")
    f = sub.add_parser("flood", help="step time while clients flood the endpoint")
    f.add_argument("--rounds", type=int, default=6)
    f.add_argument("--seconds", type=float, default=3.0, help="per arm and round")
    f.add_argument("--clients", type=int, default=8)
    for sp in (c, pr, f):
        sp.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    import torch

    head = {
        "what": a.what,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.scale " + shlex.join(argv if argv is not None else sys.argv[1:]),
    }
    if a.what == "count":
        out = count(a)
        print_count(out)
    elif a.what == "prometheus":
        out = prometheus(a)
    else:
        out = flood(a)
    if a.json:
        Path(a.json).write_text(json.dumps({**head, **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
