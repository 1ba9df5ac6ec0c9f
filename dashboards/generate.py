"""Generate the hpar-agent Grafana dashboards (Grafana 11 flavour) from code.

Dashboards are built with Grafana Labs' grafana-foundation-sdk builders (pinned
``grafana-foundation-sdk==1769699379!11.6.0``) and committed as JSON next to this file, so a metric
rename breaks ``--check`` and the tests rather than a panel in production.

    python dashboards/generate.py           # (re)write dashboards/*.json
    python dashboards/generate.py --check   # exit 1 when a committed JSON differs from the code

Every query filters on the ``$job``, ``$rank`` and ``$pp_stage`` variables (and ``$pg`` on the
collectives dashboard); cross-rank aggregates read the recording rules of
``deploy/prometheus/rules/hpar-recording.yml``. Latency panels ask for exemplars, whose ``trace_id``
label the provisioned Prometheus datasource links to Jaeger. Panels whose description ends with
:data:`GPU_MARK` only have data on CUDA ranks (NVML and the caching allocator).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as dc
from grafana_foundation_sdk.models import dashboard as dm

from hpar_agent.docs import sync_generated

OUT_DIR = Path(__file__).resolve().parent
GPU_MARK = "Needs a CUDA GPU."
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job",rank=~"$rank",pp_stage=~"$pp_stage"'
SELPG = SEL + ',pg=~"$pg"'
RI = "$__rate_interval"
TAGS = ["hpar"]


@dataclass
class Q:
    """One PromQL target: expression, legend, and whether Grafana should fetch its exemplars."""

    expr: str
    legend: str = ""
    exemplar: bool = False
    instant: bool = False


@dataclass
class Board:
    """A dashboard under construction: rows of panels with stable ids."""

    uid: str
    title: str
    description: str
    pg_var: bool = False
    rows: list[tuple[str, list[object]]] = field(default_factory=list)
    _next_id: int = 1

    def row(self, title: str) -> None:
        self.rows.append((title, []))

    def add(self, panel: object) -> None:
        self.rows[-1][1].append(panel)

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id


def _targets(builder: object, queries: list[Q]) -> None:
    for i, q in enumerate(queries):
        t = gp.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i)).datasource(DS)
        t = t.legend_format(q.legend or "__auto")
        t = t.instant() if q.instant else t.range()
        if q.exemplar:
            t = t.exemplar(True)
        builder.with_target(t)  # type: ignore[attr-defined]


def _describe(text: str, gpu: bool) -> str:
    return f"{text} {GPU_MARK}" if gpu else text


def ts(
    b: Board,
    title: str,
    desc: str,
    queries: list[Q],
    unit: str,
    *,
    w: int = 12,
    gpu: bool = False,
    max_val: float | None = None,
) -> None:
    """A time-series panel."""
    p = (
        gts.Panel()
        .id(b.next_id())
        .title(title)
        .description(_describe(desc, gpu))
        .datasource(DS)
        .unit(unit)
        .height(8)
        .span(w)
        .line_width(1)
        .fill_opacity(10)
        .show_points(dc.VisibilityMode.NEVER)
    )
    if max_val is not None:
        p = p.min(0).max(max_val)
    _targets(p, queries)
    b.add(p)


def stat(
    b: Board,
    title: str,
    desc: str,
    queries: list[Q],
    unit: str,
    *,
    w: int = 6,
    gpu: bool = False,
    thresholds: list[tuple[float | None, str]] | None = None,
) -> None:
    """A single-value panel, coloured by thresholds."""
    p = gstat.Panel().id(b.next_id()).title(title).description(_describe(desc, gpu)).datasource(DS)
    p = p.unit(unit).height(6).span(w)
    if thresholds:
        p = p.thresholds(
            gd.ThresholdsConfig()
            .mode(dm.ThresholdsMode.ABSOLUTE)
            .steps([dm.Threshold(value=v, color=c) for v, c in thresholds])
        )
    _targets(p, queries)
    b.add(p)


def table(b: Board, title: str, desc: str, queries: list[Q], *, w: int = 12) -> None:
    """An instant-query table (one row per series)."""
    p = gtable.Panel().id(b.next_id()).title(title).description(desc).datasource(DS).height(8).span(w)
    _targets(p, queries)
    b.add(p)


def _variables(b: Board) -> list[object]:
    def query_var(name: str, label: str, query: str) -> object:
        return (
            gd.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .sort(dm.VariableSort.NATURAL_ASC)
            .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        )

    out: list[object] = [gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus")]
    out.append(
        gd.QueryVariable("job")
        .label("Job")
        .datasource(DS)
        .query("label_values(hpar_agent_component_up, job)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )
    out.append(query_var("rank", "Rank", 'label_values(hpar_agent_component_up{job=~"$job"}, rank)'))
    out.append(
        query_var("pp_stage", "PP stage", 'label_values(hpar_agent_component_up{job=~"$job"}, pp_stage)')
    )
    if b.pg_var:
        out.append(query_var("pg", "Process group", 'label_values(hpar_collectives_total{job=~"$job"}, pg)'))
    return out


def build(b: Board) -> dict[str, object]:
    """Assemble the dashboard into its JSON model."""
    d = (
        gd.Dashboard(b.title)
        .uid(b.uid)
        .description(b.description)
        .tags(TAGS)
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .variables(_variables(b))  # type: ignore[arg-type]
        .link(
            gd.DashboardLink("hpar dashboards")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for title, panels in b.rows:
        d = d.with_row(gd.Row(title).id(b.next_id()))
        for p in panels:
            d = d.with_panel(p)  # type: ignore[arg-type]
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


# ---------------------------------------------------------------------------------------------- boards
def overview() -> Board:
    b = Board(
        "hpar-overview", "hpar / Overview", "Step time, throughput, alerts and agent health of every rank."
    )
    b.row("Training")
    ts(
        b,
        "Step time p50 / p99 by stage",
        "Job-wide step-time quantiles (recording rules, 5m window).",
        [
            Q(
                'job_pp_stage:hpar_step_duration_seconds:p50_5m{job=~"$job",pp_stage=~"$pp_stage"}',
                "p50 stage {{pp_stage}}",
            ),
            Q(
                'job_pp_stage:hpar_step_duration_seconds:p99_5m{job=~"$job",pp_stage=~"$pp_stage"}',
                "p99 stage {{pp_stage}}",
            ),
        ],
        "s",
    )
    ts(
        b,
        "Step time p99 by rank",
        "Per-rank step-time p99; exemplars open the step's trace in Jaeger.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (rank, le) (rate(hpar_step_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                "rank {{rank}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Throughput",
        "Steps per second (mean over ranks) and tokens per second (sum over ranks).",
        [
            Q('job:hpar_steps:rate5m{job=~"$job"}', "steps/s {{job}}"),
            Q('job:hpar_tokens:rate5m{job=~"$job"}', "tokens/s {{job}}"),
        ],
        "short",
    )
    ts(
        b,
        "Step time vs job median",
        "Each rank's mean step time over the job median; Straggler fires above 1.2 for 5m.",
        [Q(f"rank:hpar_step_duration_seconds:ratio_to_median5m{{{SEL}}}", "rank {{rank}}")],
        "short",
    )
    ts(
        b,
        "Where the step time goes",
        "Share of each rank's step time by phase (data_wait, forward, backward, optimizer; recording rule, "
        "5m window). CPU wall clock: on CUDA, CPU-side launch times.",
        [Q(f"rank_phase:hpar_step_phase_duration_seconds:ratio5m{{{SEL}}}", "rank {{rank}} {{phase}}")],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Input-bound for 10 minutes",
        "1 on a rank whose bottleneck verdict has been input-bound for the whole last 10 minutes "
        "(InputBound fires); the table next to it gives every rank's current verdict.",
        [Q(f'min_over_time(hpar_step_bottleneck{{{SEL},verdict="input-bound"}}[10m])', "rank {{rank}}")],
        "short",
        max_val=1,
    )
    table(
        b,
        "Bottleneck by rank",
        "Each rank's current verdict: input-bound, compute-bound, communication-bound or slow-rank.",
        [Q(f"max by (rank, pp_stage, verdict) (hpar_step_bottleneck{{{SEL}}}) == 1", instant=True)],
    )
    b.row("Alerts")
    table(
        b,
        "Active alerts by rank and stage",
        "In-process detectors whose condition holds now (hpar_alert_active == 1).",
        [Q(f"max by (alert, rank, pp_stage) (hpar_alert_active{{{SEL}}}) == 1", instant=True)],
    )
    ts(
        b,
        "Ranks in alert",
        "Number of ranks on which each detector's condition holds.",
        [Q(f"sum by (alert) (hpar_alert_active{{{SEL}}})", "{{alert}}")],
        "short",
    )
    ts(
        b,
        "Detector signals",
        "The value each detector compares with its threshold (units per detector).",
        [Q(f"hpar_detector_value{{{SEL}}}", "{{alert}} rank {{rank}}")],
        "short",
    )
    ts(
        b,
        "Alerts raised",
        "Transitions from inactive to active per detector.",
        [Q(f"sum by (alert) (increase(hpar_alerts_total{{{SEL}}}[{RI}]))", "{{alert}}")],
        "short",
    )
    b.row("Rank health")
    stat(
        b,
        "Scrape targets up",
        "1 when Prometheus reaches the rank's /metrics endpoint.",
        [Q('up{job=~"$job"}', "{{instance}}")],
        "short",
        w=8,
        thresholds=[(None, "red"), (1, "green")],
    )
    stat(
        b,
        "Components up (min over ranks)",
        "0 when a component's source is missing or failing on some rank.",
        [Q(f"min by (component) (hpar_agent_component_up{{{SEL}}})", "{{component}}")],
        "short",
        w=8,
        thresholds=[(None, "red"), (1, "green")],
    )
    stat(
        b,
        "Seconds since last step",
        "Age of the newest completed step per rank; Hang fires above 300 s.",
        [Q(f"time() - hpar_last_step_timestamp_seconds{{{SEL}}}", "rank {{rank}}")],
        "s",
        w=8,
        thresholds=[(None, "green"), (60, "orange"), (300, "red")],
    )
    ts(
        b,
        "Agent errors",
        "Exceptions caught inside agent components (training unaffected).",
        [
            Q(
                f"sum by (rank, component) (rate(hpar_agent_errors_total{{{SEL}}}[{RI}]))",
                "rank {{rank}} {{component}}",
            )
        ],
        "short",
        w=8,
    )
    ts(
        b,
        "Dropped hook events and spans",
        "Events dropped by full buffers, spans dropped by the span queue.",
        [
            Q(
                f"sum by (rank, buffer) (rate(hpar_agent_buffer_dropped_total{{{SEL}}}[{RI}]))",
                "rank {{rank}} {{buffer}}",
            ),
            Q(f"sum by (rank) (rate(hpar_agent_spans_dropped_total{{{SEL}}}[{RI}]))", "rank {{rank}} spans"),
        ],
        "short",
        w=8,
    )
    ts(
        b,
        "Agent poll time",
        "Agent-thread time of each component's last poll.",
        [Q(f"max by (component) (hpar_agent_collect_duration_seconds{{{SEL}}})", "{{component}}")],
        "s",
        w=8,
    )
    return b


def collectives() -> Board:
    b = Board(
        "hpar-collectives",
        "hpar / Collectives",
        "Latency, bandwidth, in-flight ops and cross-rank skew of every process group.",
        pg_var=True,
    )
    b.row("Latency")
    ts(
        b,
        "p99 latency by op and pg",
        "Job-wide p99 (recording rule); CollectiveLatencyHigh fires for all_reduce above 85 ms.",
        [Q('job_pg_op:hpar_collective_duration_seconds:p99_5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    ts(
        b,
        "p50 latency by op and pg",
        "Job-wide median latency (recording rule).",
        [Q('job_pg_op:hpar_collective_duration_seconds:p50_5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    ts(
        b,
        "p99 latency by rank",
        "Per-rank p99; exemplars open the step's trace in Jaeger.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (rank, pg, op, le) (rate(hpar_collective_duration_seconds_bucket{{{SELPG}}}[{RI}])))",
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
        w=24,
    )
    b.row("Throughput")
    ts(
        b,
        "Bus bandwidth",
        "Bus bandwidth of the last timed op (nccl-tests factors).",
        [
            Q(
                f"max by (rank, pg, op) (hpar_collective_busbw_bytes_per_second{{{SELPG}}})",
                "rank {{rank}} {{pg}} {{op}}",
            )
        ],
        "Bps",
    )
    ts(
        b,
        "Payload bytes per second",
        "Collective payload by pg and op.",
        [Q(f"sum by (pg, op) (rate(hpar_collective_bytes_total{{{SELPG}}}[{RI}]))", "{{pg}} {{op}}")],
        "Bps",
    )
    ts(
        b,
        "Ops per second",
        "Collectives observed, timed or not.",
        [Q(f"sum by (pg, op) (rate(hpar_collectives_total{{{SELPG}}}[{RI}]))", "{{pg}} {{op}}")],
        "ops",
    )
    ts(
        b,
        "Unobserved flight-recorder entries",
        "Entries overwritten before the agent read them.",
        [
            Q(
                f"sum by (rank, pg) (rate(hpar_collective_unobserved_total{{{SELPG}}}[{RI}]))",
                "rank {{rank}} {{pg}}",
            )
        ],
        "short",
    )
    b.row("FSDP (sharded data parallel)")
    fsdp = SELPG + ',pg=~"dp_shard.*|dp_replicate|dp",op=~"all_gather|reduce_scatter|all_reduce"'
    ts(
        b,
        "FSDP all-gather / reduce-scatter bytes per second",
        "FSDP2's parameter all-gathers and gradient reduce-scatters on the dp_shard group, and HSDP's "
        "gradient all-reduce on dp_replicate (gloo runs a reduce-scatter as an all_reduce).",
        [Q(f"sum by (pg, op) (rate(hpar_collective_bytes_total{{{fsdp}}}[{RI}]))", "{{pg}} {{op}}")],
        "Bps",
    )
    ts(
        b,
        "FSDP all-gather / reduce-scatter p99 latency by rank",
        "Per-rank p99 of FSDP's collectives; empty where the backend gives no durations (gloo).",
        [
            Q(
                f"histogram_quantile(0.99, sum by (rank, pg, op, le) (rate(hpar_collective_duration_seconds_bucket{{{fsdp}}}[{RI}])))",
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
    )
    b.row("Gradient sync")
    ts(
        b,
        "Gradient-sync coverage by rank",
        "Gradient elements each step reduced over the dp groups / trainable gradient elements it must "
        "reduce (1 when whole; a block outside the DDP/FSDP wrapper shows below 1). GradSyncIncomplete "
        "fires below 0.99.",
        [Q(f"hpar_grad_sync_coverage_ratio{{{SEL}}}", "rank {{rank}} {{group}}")],
        "percentunit",
        w=24,
    )
    b.row("In flight and skew")
    ts(
        b,
        "Ops in flight",
        "Ops enqueued but not completed per rank and group.",
        [Q(f"hpar_collective_inflight{{{SELPG}}}", "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Oldest in-flight age",
        "Age of the oldest incomplete op; Hang fires above 120 s.",
        [Q(f"hpar_collective_oldest_inflight_age_seconds{{{SELPG}}}", "rank {{rank}} {{pg}}")],
        "s",
        w=8,
    )
    ts(
        b,
        "Last completed seq",
        "The rank lagging behind its group is the one the others wait for.",
        [Q(f"hpar_collective_last_completed_seq{{{SELPG}}}", "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Mean latency by rank",
        "The rank with the lowest mean waited least: it arrived last.",
        [Q(f"rank_pg_op:hpar_collective_duration_seconds:mean5m{{{SELPG}}}", "rank {{rank}} {{pg}} {{op}}")],
        "s",
    )
    ts(
        b,
        "Skew across ranks",
        "Max - min of per-rank mean latency per group and op (recording rule).",
        [Q('job_pg_op:hpar_collective_duration_seconds:rank_skew5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    return b


def compile_board() -> Board:
    b = Board(
        "hpar-compile", "hpar / torch.compile", "Compiles, recompiles, graph breaks, caches and compile time."
    )
    b.row("Compiles")
    ts(
        b,
        "Compiles by outcome",
        "Dynamo compile attempts by outcome and trigger.",
        [
            Q(
                f"sum by (outcome, trigger) (increase(hpar_dynamo_compiles_total{{{SEL}}}[{RI}]))",
                "{{outcome}} {{trigger}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "Recompiles by reason",
        "Recompiles by failed-guard kind; RecompileStorm fires above 10 per 5m.",
        [Q(f"sum by (reason) (increase(hpar_dynamo_recompiles_total{{{SEL}}}[{RI}]))", "{{reason}}")],
        "short",
    )
    ts(
        b,
        "Graph breaks by reason",
        "Graph breaks by registry code (gbNNNN) or short key.",
        [Q(f"sum by (reason) (increase(hpar_dynamo_graph_breaks_total{{{SEL}}}[{RI}]))", "{{reason}}")],
        "short",
    )
    ts(
        b,
        "Recompiles and graph breaks per rank",
        "Per-second rates over 5m (recording rules).",
        [
            Q(f"rank:hpar_dynamo_recompiles:rate5m{{{SEL}}}", "recompiles rank {{rank}}"),
            Q(f"rank:hpar_dynamo_graph_breaks:rate5m{{{SEL}}}", "graph breaks rank {{rank}}"),
        ],
        "short",
    )
    b.row("Caches and compile time")
    ts(
        b,
        "Compile-cache hit ratio",
        "AOTAutograd / Inductor FX graph cache hits over lookups (recording rule).",
        [Q(f"rank_cache:hpar_dynamo_cache_hit:ratio5m{{{SEL}}}", "{{cache}} rank {{rank}}")],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Cache lookups by result",
        "Compile-cache lookups per second by cache and result.",
        [
            Q(
                f"sum by (cache, result) (rate(hpar_dynamo_cache_events_total{{{SEL}}}[{RI}]))",
                "{{cache}} {{result}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "Compile time p99 by phase",
        "Per-attempt compile time; exemplars open the dynamo.compile span.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (phase, le) (rate(hpar_dynamo_compile_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                "{{phase}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Compile time spent",
        "Seconds spent compiling per interval, by phase.",
        [
            Q(
                f"sum by (phase) (increase(hpar_dynamo_compile_duration_seconds_sum{{{SEL}}}[{RI}]))",
                "{{phase}}",
            )
        ],
        "s",
    )
    b.row("Graphs across ranks")
    ts(
        b,
        "Unique graphs by rank",
        "Distinct graphs compiled by each rank.",
        [Q(f"hpar_dynamo_unique_graphs{{{SEL}}}", "rank {{rank}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Distinct fingerprints per stage",
        "1 when all ranks of a stage compiled the same graphs; CompileDivergence above.",
        [
            Q(
                'job_pp_stage:hpar_dynamo_graph_fingerprint:distinct{job=~"$job",pp_stage=~"$pp_stage"}',
                "stage {{pp_stage}}",
            )
        ],
        "short",
        w=8,
    )
    table(
        b,
        "Graph fingerprint by rank",
        "The rank whose fingerprint differs from its stage peers diverged.",
        [Q(f"hpar_dynamo_graph_fingerprint{{{SEL}}}", instant=True)],
        w=8,
    )
    ts(
        b,
        "Recompile-limit hits",
        "Frames that hit the recompile limit and run eagerly from now on.",
        [Q(f"sum by (rank) (hpar_dynamo_recompile_limit_hits_total{{{SEL}}})", "rank {{rank}}")],
        "short",
        w=24,
    )
    return b


def memory() -> Board:
    b = Board(
        "hpar-memory",
        "hpar / Memory",
        "Device (NVML), CUDA caching allocator and host memory per rank; leaks.",
    )
    b.row("Post-step memory and leaks")
    ts(
        b,
        "Post-step memory by source",
        "Memory sampled right after each step (allocator, nvml, rss).",
        [Q(f"hpar_memory_post_step_bytes{{{SEL}}}", "rank {{rank}} {{source}}")],
        "bytes",
    )
    ts(
        b,
        "Growth per step",
        "10m slope of post-step memory divided by the step rate: bytes kept per step.",
        [
            Q(
                f"rank_source:hpar_memory_post_step_bytes:deriv10m{{{SEL}}} / on (job, instance) group_left () "
                f"sum by (job, instance) (rate(hpar_steps_total{{{SEL}}}[10m]))",
                "rank {{rank}} {{source}}",
            )
        ],
        "bytes",
    )
    ts(
        b,
        "Host RSS",
        "Resident set size of each rank's process.",
        [Q(f"hpar_host_rss_bytes{{{SEL}}}", "rank {{rank}}")],
        "bytes",
    )
    ts(
        b,
        "MemoryLeak detector",
        "Detector state (1 = leaking) and its signal per rank.",
        [
            Q(f'hpar_alert_active{{alert="MemoryLeak",{SEL}}}', "active rank {{rank}}"),
            Q(f'hpar_detector_value{{alert="MemoryLeak",{SEL}}}', "signal rank {{rank}}"),
        ],
        "short",
    )
    b.row("GPU memory")
    ts(
        b,
        "GPU memory used / total (NVML)",
        "Device memory in use by all processes vs capacity.",
        [
            Q(f"hpar_gpu_memory_used_bytes{{{SEL}}}", "used rank {{rank}}"),
            Q(f"hpar_gpu_memory_total_bytes{{{SEL}}}", "total rank {{rank}}"),
        ],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "GPU memory used ratio",
        "GpuMemoryNearFull fires above 95% for 5m.",
        [Q(f"hpar_gpu_memory_used_bytes{{{SEL}}} / hpar_gpu_memory_total_bytes{{{SEL}}}", "rank {{rank}}")],
        "percentunit",
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "Process GPU memory (NVML)",
        "Device memory used by each rank's process.",
        [Q(f"hpar_gpu_process_memory_bytes{{{SEL}}}", "rank {{rank}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator bytes by kind",
        "CUDA caching allocator allocated / reserved / active bytes.",
        [Q(f"hpar_allocator_bytes{{{SEL}}}", "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator peak bytes",
        "Peak bytes per kind since start or reset.",
        [Q(f"hpar_allocator_peak_bytes{{{SEL}}}", "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator retries and OOMs",
        "cudaMalloc retries (memory pressure) and OOMs per interval.",
        [
            Q(
                f"sum by (rank) (increase(hpar_allocator_alloc_retries_total{{{SEL}}}[{RI}]))",
                "retries rank {{rank}}",
            ),
            Q(f"sum by (rank) (increase(hpar_allocator_ooms_total{{{SEL}}}[{RI}]))", "OOMs rank {{rank}}"),
        ],
        "short",
        gpu=True,
    )
    b.row("GPU health")
    ts(
        b,
        "GPU utilization",
        "Fraction of time a kernel ran (NVML).",
        [Q(f"hpar_gpu_utilization_ratio{{{SEL}}}", "rank {{rank}}")],
        "percentunit",
        w=8,
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "GPU power",
        "Board power draw.",
        [Q(f"hpar_gpu_power_watts{{{SEL}}}", "rank {{rank}}")],
        "watt",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU temperature",
        "GPU core temperature.",
        [Q(f"hpar_gpu_temperature_celsius{{{SEL}}}", "rank {{rank}}")],
        "celsius",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU clocks",
        "SM and memory clocks; a straggler's clock is often throttled.",
        [Q(f"hpar_gpu_clock_hertz{{{SEL}}}", "rank {{rank}} {{clock}}")],
        "hertz",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "Clock throttling",
        "1 while a throttle reason is active.",
        [Q(f"max by (rank, reason) (hpar_gpu_throttle_active{{{SEL}}})", "rank {{rank}} {{reason}}")],
        "short",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "ECC errors",
        "Volatile ECC errors per interval; GpuEccErrors fires on uncorrected ones.",
        [
            Q(
                f"sum by (rank, error_type) (increase(hpar_gpu_ecc_errors_total{{{SEL}}}[{RI}]))",
                "rank {{rank}} {{error_type}}",
            )
        ],
        "short",
        w=8,
        gpu=True,
    )
    return b


def pipeline() -> Board:
    b = Board(
        "hpar-pipeline", "hpar / Pipeline", "Per-stage forward/backward chunk times and pipeline bubbles."
    )
    b.row("Stages")
    ts(
        b,
        "Chunk time p99 by stage and phase",
        "Per-microbatch compute time; exemplars open the step's trace.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (pp_stage, phase, le) (rate(hpar_pp_chunk_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                "stage {{pp_stage}} {{phase}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Mean chunk time by rank and phase",
        "Mean forward/backward time per microbatch chunk.",
        [
            Q(
                f"sum by (rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_sum{{{SEL}}}[{RI}])) / "
                f"sum by (rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_count{{{SEL}}}[{RI}]))",
                "rank {{rank}} stage {{pp_stage}} {{phase}}",
            )
        ],
        "s",
    )
    ts(
        b,
        "Bubble ratio by stage",
        "Idle fraction of the last step: 1 - busy / step time.",
        [Q(f"avg by (pp_stage) (hpar_pp_bubble_ratio{{{SEL}}})", "stage {{pp_stage}}")],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Busy time by rank",
        "Forward+backward compute time of the last step.",
        [Q(f"hpar_pp_busy_seconds{{{SEL}}}", "rank {{rank}} stage {{pp_stage}}")],
        "s",
    )
    ts(
        b,
        "Compute time vs stage median",
        "Busy time over the median of the stage's ranks; Straggler fires above 1.2.",
        [Q(f"rank:hpar_pp_busy_seconds:ratio_to_stage_median5m{{{SEL}}}", "rank {{rank}}")],
        "short",
    )
    ts(
        b,
        "Chunks per second by stream",
        "Microbatch chunks executed per CUDA stream (cpu on CPU).",
        [
            Q(
                f"sum by (pp_stage, stream, phase) (rate(hpar_pp_chunk_duration_seconds_count{{{SEL}}}[{RI}]))",
                "stage {{pp_stage}} {{stream}} {{phase}}",
            )
        ],
        "short",
    )
    return b


BOARDS: dict[str, Callable[[], Board]] = {
    "overview": overview,
    "collectives": collectives,
    "compile": compile_board,
    "memory": memory,
    "pipeline": pipeline,
}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard (stable key order, trailing newline)."""
    return {
        f"{name}.json": json.dumps(build(fn()), indent=2, sort_keys=True) + "\n"
        for name, fn in BOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if committed JSON differs from the code")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (default: next to this file)")
    args = ap.parse_args(argv)
    files = {args.out / name: text for name, text in render().items()}
    return sync_generated(files, args.check, "python dashboards/generate.py")

if __name__ == "__main__":
    sys.exit(main())
