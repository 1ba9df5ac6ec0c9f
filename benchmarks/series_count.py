"""Series one rank exports, measured on a live 8-rank CPU run, projected to 1,024 and 8,192 ranks.

Runs the reference trainer under torchrun (default dp2 x tp2 x pp2, 1F1B, aot_eager, a few steps) with
the agent on every rank, scrapes every rank's /metrics once all ranks passed ``--scrape-at`` steps (the
run is still going: endpoints close at exit), and counts series the way Prometheus stores them: one per
exposition sample (a histogram is ``buckets + 1`` ``_bucket`` series plus ``_sum`` and ``_count``), plus
the 5 synthetic series Prometheus adds per target (up, scrape_duration_seconds, scrape_samples_scraped,
scrape_samples_post_metric_relabeling, scrape_series_added).

It also states the worst case per rank from the caps in the collectors (``caps()``): every label whose
values could grow, with the bound the code enforces, read from the code itself so the table follows it.

    python -m benchmarks.series_count --json series-count.json --save-scrapes scrapes/

The run traces every step (``HPAR_TRACE_EVERY=1``, local OTLP/JSON files), so the report also gives the
trace volume per rank: spans per traced step (steps without a compile) and OTLP protobuf bytes per span.

``--save-scrapes DIR`` keeps each rank's scrape in the OpenMetrics format Prometheus negotiates
(``rank<r>.om``); ``benchmarks/scrape_sim.py`` replays them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hpar_agent import catalogue as cat
from testkit.live_run import LiveRun

#: Series Prometheus adds for every target (2.42: up, scrape_duration_seconds, scrape_samples_scraped,
#: scrape_samples_post_metric_relabeling, scrape_series_added).
SYNTHETIC_PER_TARGET = 5
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
PROJECT_TO = (1024, 8192)


def scrape(url: str, openmetrics: bool = False) -> str:
    req = urllib.request.Request(url, headers={"Accept": OPENMETRICS_ACCEPT} if openmetrics else {})
    return urllib.request.urlopen(req, timeout=10).read().decode()


def count_series(text: str) -> dict[str, Any]:
    """Series per catalogue metric in one scrape (text format), and the values of each non-common label."""
    by_metric: Counter[str] = Counter()
    label_values: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        spec_name = fam.name + "_total" if fam.type == "counter" else fam.name
        if fam.type == "info":
            spec_name = fam.name + "_info"
        for s in fam.samples:
            by_metric[spec_name] += 1
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
    bounds = cat.STEP_BUCKETS if spec.name in step_like else cat.LATENCY_BUCKETS
    return len(bounds) + 1 + 2


def caps() -> dict[str, dict[str, Any]]:
    """Every label besides rank/pp_stage: how many values it can take and what bounds it (read from the code)."""
    from hpar_agent import streams
    from hpar_agent.collectors import collectives, compile, memory, pipeline
    from hpar_agent.torch_compat import dynamo, dynamo_log, fr_decode

    max_pgs = collectives.CollectiveCollector().max_pgs
    ops = sorted(set(fr_decode._OP_ALIASES.values()) | {fr_decode.OTHER})
    guard_kinds = sorted({k for _p, k in dynamo_log._GUARD_KINDS} | {"other"})
    cache_pairs = sorted(set(dynamo.CACHE_COUNTERS.values()))
    return {
        "pg": {
            "max": max_pgs + 2,
            "bound": f"CollectiveCollector(max_pgs={max_pgs}): the first {max_pgs} group descriptions keep their "
            "name (mesh_dp -> dp; unnamed groups pg<N>), later ones are 'other'; plus 'pp' for wrapped "
            "pipelining p2p",
        },
        "op": {
            "max": len(ops),
            "bound": f"fixed alias table -> {len(ops)} values incl. 'other': {', '.join(ops)}",
        },
        "stream (collectives)": {
            "max": 1,
            "bound": "one per pg: 'nccl:<pg>' on NCCL, 'cpu' on gloo (comm_stream_label)",
        },
        "stream (pipeline)": {
            "max": streams.MAX_STREAMS + 1,
            "bound": f"'cpu', 'cuda:default' or 'cuda:<stream_id>' of the stream a stage chunk ran on; the first "
            f"{streams.MAX_STREAMS} seen keep their name, later ones share '{streams.OTHER}' (StreamCap)",
        },
        "phase (pipeline)": {"max": len(pipeline._METHODS), "bound": "forward, backward"},
        "phase (compile)": {
            "max": len(compile.PHASES) + 1,
            "bound": ", ".join([p for p, _f in compile.PHASES] + ["lazy_backward"]),
        },
        "outcome x trigger": {
            "max": 4 * 3,
            "bound": "outcome in ok/graph_break/failed/limit, trigger in forward/lazy_backward/runtime",
        },
        "reason (recompiles)": {
            "max": len(guard_kinds),
            "bound": f"fixed guard-kind table -> {len(guard_kinds)} values incl. 'other'",
        },
        "reason (graph breaks)": {
            "max": compile.MAX_BREAK_KEYS + 1,
            "bound": f"MAX_BREAK_KEYS={compile.MAX_BREAK_KEYS} distinct gbNNNN codes or slugs, then 'other'",
        },
        "reason (throttle)": {"max": len(memory.THROTTLE_REASONS), "bound": "NVML clock-event reason bits"},
        "cache x result": {
            "max": len(cache_pairs),
            "bound": "fixed counter table: " + ", ".join(f"{c}/{r}" for c, r in cache_pairs),
        },
        "component": {
            "max": None,
            "bound": "collectors and detectors installed (fixed set) + agent, events, prometheus, tracing",
        },
        "buffer": {"max": None, "bound": "one per hook buffer of the installed components (fixed set)"},
        "kind / source / clock / error_type": {"max": 3, "bound": "fixed: 3 / 3 / 2 / 2"},
        "alert": {"max": len(cat.ALERT_NAMES), "bound": "the catalogue's alerts"},
        "peer": {"max": 0, "bound": "span attribute only (collective.peer), never a metric label"},
    }


def worst_case(observed: dict[str, int]) -> dict[str, int]:
    """Per-rank series at every cap (observed counts where a label has no numeric cap)."""
    c = caps()
    pgs, ops = c["pg"]["max"], c["op"]["max"]
    label_sets = {
        "hpar_collective_duration_seconds": pgs * ops,
        "hpar_collectives_total": pgs * ops,
        "hpar_collective_bytes_total": pgs * ops,
        "hpar_collective_busbw_bytes_per_second": pgs * ops,
        "hpar_collective_inflight": pgs,
        "hpar_collective_oldest_inflight_age_seconds": pgs,
        "hpar_collective_last_completed_seq": pgs,
        "hpar_collective_unobserved_total": pgs,
        "hpar_dynamo_compiles_total": c["outcome x trigger"]["max"],
        "hpar_dynamo_recompiles_total": c["reason (recompiles)"]["max"],
        "hpar_dynamo_graph_breaks_total": c["reason (graph breaks)"]["max"],
        "hpar_dynamo_cache_events_total": c["cache x result"]["max"],
        "hpar_dynamo_compile_duration_seconds": c["phase (compile)"]["max"],
        "hpar_pp_chunk_duration_seconds": c["phase (pipeline)"]["max"] * c["stream (pipeline)"]["max"],
        "hpar_gpu_clock_hertz": 2,
        "hpar_gpu_ecc_errors_total": 2,
        "hpar_gpu_throttle_active": c["reason (throttle)"]["max"],
        "hpar_allocator_bytes": 3,
        "hpar_allocator_peak_bytes": 3,
        "hpar_memory_post_step_bytes": 3,
        "hpar_alert_active": c["alert"]["max"],
        "hpar_alerts_total": c["alert"]["max"],
        "hpar_detector_value": c["alert"]["max"],
    }
    out: dict[str, int] = {}
    for spec in cat.METRICS:
        if spec.name in label_sets:
            out[spec.name] = label_sets[spec.name] * samples_per_series(spec)
        elif not spec.labels:
            out[spec.name] = samples_per_series(spec)
        else:  # component / buffer: a fixed set per install, take what the run showed
            out[spec.name] = observed.get(spec.name, 0)
    return out


def project(per_rank: list[int], ranks: int) -> dict[str, Any]:
    mean = sum(per_rank) / len(per_rank)
    return {
        "ranks": ranks,
        "per_rank_min": min(per_rank) + SYNTHETIC_PER_TARGET,
        "per_rank_max": max(per_rank) + SYNTHETIC_PER_TARGET,
        "per_job": round(ranks * (mean + SYNTHETIC_PER_TARGET)),
        "per_job_range": [
            ranks * (min(per_rank) + SYNTHETIC_PER_TARGET),
            ranks * (max(per_rank) + SYNTHETIC_PER_TARGET),
        ],
    }


def trace_volume(run_dir: Path) -> dict[str, Any]:
    """Spans per traced step per rank and OTLP/protobuf bytes per span, from the run's local trace files
    (OTLP/JSON lines, ids in hex), counting only steps without a compile span (steady state)."""
    import base64

    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    def b64(doc: Any) -> None:
        if isinstance(doc, dict):
            for k, v in doc.items():
                if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str):
                    doc[k] = base64.b64encode(bytes.fromhex(v)).decode()
                else:
                    b64(v)
        elif isinstance(doc, list):
            for v in doc:
                b64(v)

    per_step: dict[tuple[int, int], Counter[str]] = {}
    wire_bytes = spans = 0
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
            wire_bytes += ParseDict(doc, trace_service_pb2.ExportTraceServiceRequest()).ByteSize()
    steady = [c for c in per_step.values() if "dynamo.compile" not in c and "train.step" in c]
    totals = sorted(sum(c.values()) for c in steady)
    names: Counter[str] = Counter()
    for c in steady:
        names.update(c)
    return {
        "spans": spans,
        "otlp_protobuf_bytes": wire_bytes,
        "bytes_per_span": round(wire_bytes / spans, 1) if spans else None,
        "steady_rank_steps": len(steady),
        "spans_per_rank_step_median": totals[len(totals) // 2] if totals else None,
        "spans_per_rank_step_range": [totals[0], totals[-1]] if totals else None,
        "spans_by_name_per_rank_step": {k: round(v / len(steady), 2) for k, v in sorted(names.items())}
        if steady
        else {},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--compile", default="aot_eager")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--scrape-at", type=int, default=8, help="scrape once every rank completed this many steps"
    )
    p.add_argument("--extra", default="", help="more trainer arguments, e.g. '--inject graph-break'")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--save-scrapes", help="directory for each rank's OpenMetrics scrape (rank<r>.om)")
    p.add_argument("--run-dir", help="keep the run's files here (default: a temporary directory)")
    a = p.parse_args(argv)

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
        "--log-every",
        "1",
        "--device",
        "cpu",
        *shlex.split(a.extra),
    ]
    tmp = tempfile.TemporaryDirectory(prefix="hpar-series-")
    run_dir = Path(a.run_dir) if a.run_dir else Path(tmp.name) / "series-count"
    t0 = time.time()
    run = LiveRun(run_dir, args, nproc=a.nproc, env={"HPAR_TRACE_EVERY": "1", "HPAR_TRACES": "file"})
    try:
        run.wait_for_steps(a.scrape_at, timeout=a.timeout)
        oms = [scrape(run.url(r), openmetrics=True) for r in range(a.nproc)]
        texts = [scrape(run.url(r)) for r in range(a.nproc)]  # the same moment as the OpenMetrics scrape
        rc = run.wait(timeout=a.timeout)
    except BaseException:
        run.kill()
        raise
    wall = time.time() - t0
    if rc != 0:
        print(run.tail(), file=sys.stderr)

    counts = [count_series(t) for t in texts]
    per_rank = [c["total"] for c in counts]
    metrics = sorted({m for c in counts for m in c["by_metric"]})
    by_metric = {m: [c["by_metric"].get(m, 0) for c in counts] for m in metrics}
    labels: dict[str, set[str]] = {}
    for c in counts:
        for k, v in c["label_values"].items():
            labels.setdefault(k, set()).update(v)
    observed_max = {m: max(v) for m, v in by_metric.items()}
    worst = worst_case(observed_max)
    import torch

    result = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.series_count "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "trainer_args": args,
        "nproc": a.nproc,
        "trainer_rc": rc,
        "wall_s": round(wall, 1),
        "per_rank_series": per_rank,
        "per_rank_min": min(per_rank),
        "per_rank_max": max(per_rank),
        "per_rank_with_synthetic": [n + SYNTHETIC_PER_TARGET for n in per_rank],
        "openmetrics_bytes": [len(t) for t in oms],
        "by_metric": by_metric,
        "label_values": {k: sorted(v) for k, v in sorted(labels.items())},
        "projection": [project(per_rank, n) for n in PROJECT_TO],
        "caps": caps(),
        "trace_volume": trace_volume(run_dir),
        "worst_case_per_rank": sum(worst.values()),
        "worst_case_by_metric": worst,
        "worst_case_projection": {
            str(n): n * (sum(worst.values()) + SYNTHETIC_PER_TARGET) for n in PROJECT_TO
        },
    }
    if a.save_scrapes:
        d = Path(a.save_scrapes)
        d.mkdir(parents=True, exist_ok=True)
        for r, t in enumerate(oms):
            (d / f"rank{r}.om").write_text(t)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print_report(result)
    tmp.cleanup()
    return 0 if rc == 0 else 1


def print_report(r: dict[str, Any]) -> None:
    print(f"{r['nproc']} ranks, trainer rc {r['trainer_rc']}, {r['wall_s']} s; torch {r['torch']}")
    print(
        "series per rank (agent only):",
        r["per_rank_series"],
        f"min {r['per_rank_min']} max {r['per_rank_max']}",
    )
    print(f"{'metric':48s} {'min':>5s} {'max':>5s} {'cap':>6s}")
    for m, v in sorted(r["by_metric"].items(), key=lambda kv: -max(kv[1])):
        print(f"{m:48s} {min(v):5d} {max(v):5d} {r['worst_case_by_metric'].get(m, 0):6d}")
    for pr in r["projection"]:
        print(
            f"{pr['ranks']:>6d} ranks: {pr['per_rank_min']}-{pr['per_rank_max']} series per rank, "
            f"{pr['per_job']:,} per job ({pr['per_job_range'][0]:,}-{pr['per_job_range'][1]:,})"
        )
    print(
        f"worst case per rank at every cap: {r['worst_case_per_rank']:,}; per job: "
        + ", ".join(f"{n} ranks {v:,}" for n, v in r["worst_case_projection"].items())
    )
    tv = r["trace_volume"]
    print(
        f"traces: {tv['spans_per_rank_step_median']} spans per traced step per rank "
        f"(range {tv['spans_per_rank_step_range']}, {tv['steady_rank_steps']} rank-steps), "
        f"{tv['bytes_per_span']} OTLP protobuf bytes per span; by name {tv['spans_by_name_per_rank_step']}"
    )
    for k, v in r["label_values"].items():
        print(f"  {k}: {len(v)} values: {', '.join(v[:12])}{' ...' if len(v) > 12 else ''}")


if __name__ == "__main__":
    raise SystemExit(main())
