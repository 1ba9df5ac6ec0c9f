"""Generate the hpar-agent Grafana dashboards (Grafana 11 flavour) from code.

Dashboards are built with Grafana Labs' grafana-foundation-sdk builders (pinned
``grafana-foundation-sdk==1769699379!11.6.0``) and committed as JSON next to this file, so a metric
rename breaks ``--check`` and the tests rather than a panel in production.

    python -m dashboards.generate           # (re)write dashboards/*.json
    python -m dashboards.generate --check   # exit 1 when a committed JSON differs from the code

Every query filters on the ``$job``, ``$rank`` and ``$pp_stage`` variables (and ``$pg`` on the
collectives dashboard); cross-rank aggregates read the recording rules of
``deploy/prometheus/rules/hpar-recording.yml``.

Built for 1,024 ranks: no panel draws every rank. Per-rank time series show the worst (or best)
``$topn`` ranks over the visible time range (:func:`worst`); the whole job is seen in rank x time
heatmaps and in tables (one row per rank at most). Per-rank queries join ``job_id`` from
``hpar_rank_info`` (the run's id, ``$job_id``), which is not Prometheus's scrape ``job``. Alerts and
compiles are annotations. Latency panels ask for exemplars, whose ``trace_id``
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
from grafana_foundation_sdk.builders import heatmap as ghm
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import table as gtable
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as dc
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

from scripts.gen_docs import sync_generated

OUT_DIR = Path(__file__).resolve().parent
GPU_MARK = "Needs a CUDA GPU."
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'job=~"$job",rank=~"$rank",pp_stage=~"$pp_stage"'
SELPG = SEL + ',pg=~"$pg"'
RI = "$__rate_interval"
TAGS = ["hpar"]
#: This run's ranks: hpar_rank_info of the selected scrape job(s) and run id(s).
RANK_INFO = 'hpar_rank_info{job=~"$job",job_id=~"$job_id",rank=~"$rank"}'
#: Choices of the ``$topn`` variable: how many ranks a worst-N / best-N panel draws.
TOPN = (5, 10, 20, 50)
TOPN_DEFAULT = 10


def with_job_id(expr: str) -> str:
    """``expr`` (series that keep ``job``, ``instance`` and ``rank``) restricted to ``$job_id``, with
    the ``job_id`` label joined from ``hpar_rank_info`` (one info series per target, so the join is
    one-to-one even when several runs share a scrape job)."""
    return f"({expr}) * on (job, instance, rank) group_left (job_id) {RANK_INFO}"


def worst(expr: str, best: bool = False, join: bool = True) -> str:
    """The ``$topn`` series of ``expr`` with the highest (``best``: lowest) peak over the dashboard's
    time range. The set is chosen once, at the range's end (``@ end()``), so a range query draws at
    most ``$topn`` series; a bare ``topk`` would pick new ranks at every step. ``join``: restrict to
    ``$job_id`` (needs ``job``, ``instance`` and ``rank``; recording rules keep no ``instance``)."""
    e = with_job_id(expr) if join else expr
    fn, over = ("bottomk", "min_over_time") if best else ("topk", "max_over_time")
    return f"{e} and {fn}($topn, {over}(({e})[$__range:$__interval] @ end()))"


@dataclass
class Q:
    """One PromQL target: expression, legend, and whether Grafana should fetch its exemplars."""

    expr: str
    legend: str = ""
    exemplar: bool = False
    instant: bool = False
    table: bool = False  # Prometheus "table" format: one row per series, labels as columns


@dataclass
class Annotation:
    """A Prometheus annotation: a marker wherever ``expr`` has a sample (titled per series)."""

    name: str
    expr: str
    title: str
    tags: str
    color: str


#: Alert and compile markers, on every dashboard.
ANNOTATIONS = [
    Annotation(
        "Alerts raised",
        f"sum by (job_id, alert) (changes(hpar_alerts_total{{{SEL}}}[{RI}]) * on (job, instance, rank) "
        f"group_left (job_id) {RANK_INFO}) > 0",
        "{{alert}}",
        "alert,job_id",
        "red",
    ),
    Annotation(
        "Compiles",
        f"sum by (job_id, trigger) (changes(hpar_dynamo_compiles_total{{{SEL}}}[{RI}]) * on (job, instance, rank) "
        f"group_left (job_id) {RANK_INFO}) > 0",
        "compile ({{trigger}})",
        "trigger,job_id",
        "purple",
    ),
]


@dataclass
class Board:
    """A dashboard under construction: rows of panels with stable ids."""

    uid: str
    title: str
    description: str
    pg_var: bool = False
    annotations: list[Annotation] = field(default_factory=list)
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
        if q.table:
            t = t.format(pm.PromQueryFormat.TABLE)
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


def heatmap(b: Board, title: str, desc: str, expr: str, unit: str, *, w: int = 12, gpu: bool = False) -> None:
    """A rank x time heatmap: one row per rank (series named by rank, Grafana's buckets-from-series
    mode), the colour the value. Every rank is drawn, as cells, so a 1,024-rank job stays readable."""
    p = (
        ghm.Panel()
        .id(b.next_id())
        .title(title)
        .description(_describe(desc, gpu))
        .datasource(DS)
        .height(9)
        .span(w)
        .calculate(False)
        .y_axis(ghm.YAxisConfig().axis_label("rank"))
        .cell_values(ghm.CellValues().unit(unit))
        .color(
            ghm.HeatmapColorOptions()
            .mode(hm.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .fill("dark-orange")
            .scale(hm.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
        )
        .max_data_points(200)
    )
    _targets(p, [Q(with_job_id(expr), "{{rank}}")])
    b.add(p)


def table(b: Board, title: str, desc: str, queries: list[Q], *, w: int = 12) -> None:
    """An instant-query table (one row per series)."""
    p = gtable.Panel().id(b.next_id()).title(title).description(desc).datasource(DS).height(8).span(w)
    _targets(p, queries)
    b.add(p)


def _variables(b: Board) -> list[object]:
    def query_var(name: str, label: str, query: str) -> gd.QueryVariable:
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
    out.append(
        query_var("job_id", "Run (job id)", 'label_values(hpar_rank_info{job=~"$job"}, job_id)').description(
            "The run's job_id (hpar_rank_info), not Prometheus's scrape job: several runs can share one "
            "scrape job. Filters the per-rank panels, heatmaps and tables."
        )
    )
    out.append(
        gd.CustomVariable("topn")
        .label("Worst / best N")
        .description("How many ranks a worst-N (topk) or best-N (bottomk) panel draws.")
        .values(",".join(str(n) for n in TOPN))
        .current(dm.VariableOption(selected=True, text=str(TOPN_DEFAULT), value=str(TOPN_DEFAULT)))
    )
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
    for a in ANNOTATIONS:
        d = d.annotation(
            gd.AnnotationQuery().name(a.name).datasource(DS).enable(True).icon_color(a.color).expr(a.expr)
        )
    for title, panels in b.rows:
        d = d.with_row(gd.Row(title).id(b.next_id()))
        for p in panels:
            d = d.with_panel(p)  # type: ignore[arg-type]
    out = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    # Prometheus annotation fields the SDK's generic AnnotationQuery has no setters for.
    by_name = {a.name: a for a in ANNOTATIONS}
    for entry in out["annotations"]["list"]:
        anno = by_name.get(entry.get("name", ""))
        if anno is not None:
            entry.update(titleFormat=anno.title, tagKeys=anno.tags, textFormat="", step="$__interval")
            entry.update(useValueForTime=False, refId="Anno")
    return out


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
        "Slowest $topn ranks: step time p99",
        "Per-rank step-time p99 of the $topn ranks with the highest peak in the time range; exemplars open "
        "the step's trace in Jaeger. Every rank: the step-time heatmap below.",
        [
            Q(
                worst(
                    f"histogram_quantile(0.99, sum by (job, instance, rank, le) "
                    f"(rate(hpar_step_duration_seconds_bucket{{{SEL}}}[{RI}])))"
                ),
                "rank {{rank}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Steps per second",
        "Steps per second, mean over the scrape job's ranks (recording rule).",
        [Q('job:hpar_steps:rate5m{job=~"$job"}', "steps/s {{job}}")],
        "short",
    )
    ts(
        b,
        "Tokens per second",
        "Tokens per second of each run: the sum over one rank per data-parallel replica (tp_rank, pp_rank "
        "and cp_rank 0 in hpar_rank_info), since every rank of a replica reports the replica's tokens "
        "(as hpar_trainer does). A loop that reports tokens on other ranks only shows nothing here.",
        [
            Q(
                f"sum by (job_id) (rate(hpar_tokens_total{{{SEL}}}[{RI}]) * on (job, instance, rank) "
                f'group_left (job_id) hpar_rank_info{{job=~"$job",job_id=~"$job_id",rank=~"$rank",'
                f'tp_rank="0",pp_rank="0",cp_rank="0"}})',
                "tokens/s {{job_id}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "MFU (model FLOPs utilization)",
        "Model FLOP/s over peak FLOP/s, summed over the run's ranks: rate(hpar_tokens_total) x "
        "hpar_model_flops_per_token / hpar_peak_flops. Both gauges are what the training loop reports "
        "(agent.report_flops; hpar_trainer: 6 x its local parameters per token, --peak-tflops); no data "
        "until they are reported. Dense estimate: attention's sequence-length FLOPs are left out.",
        [
            Q(
                f"sum by (job_id) ({with_job_id(f'rate(hpar_tokens_total{{{SEL}}}[{RI}]) * on (job, instance, rank) hpar_model_flops_per_token{{{SEL}}}')}) "
                f"/ sum by (job_id) ({with_job_id(f'hpar_peak_flops{{{SEL}}}')})",
                "MFU {{job_id}}",
            )
        ],
        "percentunit",
    )
    ts(
        b,
        "Lowest-MFU $topn ranks",
        "Per-rank MFU (see MFU) of the $topn ranks with the lowest minimum in the time range.",
        [
            Q(
                worst(
                    f"rate(hpar_tokens_total{{{SEL}}}[{RI}]) * on (job, instance, rank) "
                    f"hpar_model_flops_per_token{{{SEL}}} / on (job, instance, rank) hpar_peak_flops{{{SEL}}}",
                    best=True,
                ),
                "rank {{rank}}",
            )
        ],
        "percentunit",
    )
    ts(
        b,
        "Step time vs job median: slowest $topn ranks",
        "Each rank's mean step time over the job median (recording rule, scrape job wide); the $topn "
        "highest in the time range. Straggler fires above 1.2 for 5m.",
        [
            Q(
                worst(f"rank:hpar_step_duration_seconds:ratio_to_median5m{{{SEL}}}", join=False),
                "rank {{rank}}",
            )
        ],
        "short",
    )
    heatmap(
        b,
        "Step time by rank (heatmap)",
        "Mean step time of every rank (rows) over time: a slow rank is a dark row, a slow step a dark "
        "column.",
        f"sum by (job, instance, rank) (rate(hpar_step_duration_seconds_sum{{{SEL}}}[{RI}])) / "
        f"sum by (job, instance, rank) (rate(hpar_step_duration_seconds_count{{{SEL}}}[{RI}]))",
        "s",
        w=24,
    )
    ts(
        b,
        "Where the step time goes",
        "Share of step time by phase (data_wait, forward, backward, optimizer; recording rule, 5m window), "
        "mean over ranks. CPU wall clock: on CUDA, CPU-side launch times.",
        [Q(f"avg by (phase) (rank_phase:hpar_step_phase_duration_seconds:ratio5m{{{SEL}}})", "{{phase}}")],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Ranks input-bound for 10 minutes",
        "Number of ranks whose bottleneck verdict has been input-bound for the whole last 10 minutes "
        "(InputBound fires on each); the table next to it gives every rank's current verdict.",
        [
            Q(
                f'sum(min_over_time(hpar_step_bottleneck{{{SEL},verdict="input-bound"}}[10m]))',
                "ranks",
            )
        ],
        "short",
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
        "Detector signals (worst rank)",
        "Per detector, the highest value over ranks of what it compares with its threshold (units per "
        "detector).",
        [Q(f"max by (alert) (hpar_detector_value{{{SEL}}})", "{{alert}}")],
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
        "Scrape targets down",
        "Targets of the scrape job Prometheus cannot reach (up == 0); their ranks are in the table below.",
        [Q('count(up{job=~"$job"} == 0) or vector(0)', "down")],
        "short",
        w=8,
        thresholds=[(None, "green"), (1, "red")],
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
        "Seconds since last step (oldest rank)",
        "Age of the newest completed step on the rank that stepped least recently; Hang fires above 300 s.",
        [Q(f"max(time() - hpar_last_step_timestamp_seconds{{{SEL}}})", "oldest")],
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
                f"sum by (component) (rate(hpar_agent_errors_total{{{SEL}}}[{RI}]))",
                "{{component}}",
            )
        ],
        "short",
        w=8,
    )
    ts(
        b,
        "Dropped hook events and spans",
        "Events dropped by full buffers, spans dropped by the span queue (all ranks).",
        [
            Q(f"sum by (buffer) (rate(hpar_agent_buffer_dropped_total{{{SEL}}}[{RI}]))", "{{buffer}}"),
            Q(f"sum(rate(hpar_agent_spans_dropped_total{{{SEL}}}[{RI}]))", "spans"),
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
    table(
        b,
        "Ranks: host and GPU",
        "One row per rank from hpar_rank_info: run, host, local rank, NVML GPU index and UUID (empty on "
        "CPU), and whether Prometheus reaches it. Join with dcgm-exporter on the GPU UUID, e.g. "
        'DCGM_FI_DEV_GPU_UTIL * on (UUID) group_left (rank, job_id) label_replace(hpar_rank_info, "UUID", '
        '"$1", "gpu_uuid", "(.+)").',
        [
            Q(
                f"max by (job_id, rank, pp_stage, host, local_rank, gpu_index, gpu_uuid, instance) ({RANK_INFO})"
                ' * on (instance) group_left () max by (instance) (up{job=~"$job"})',
                instant=True,
                table=True,
            )
        ],
        w=24,
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
        "Slowest $topn: p99 latency by rank",
        "Per-rank p99 of the $topn (rank, pg, op) series with the highest peak in the time range; exemplars "
        "open the step's trace in Jaeger. Every rank: the latency heatmap below.",
        [
            Q(
                worst(
                    "histogram_quantile(0.99, sum by (job, instance, rank, pg, op, le) "
                    f"(rate(hpar_collective_duration_seconds_bucket{{{SELPG}}}[{RI}])))"
                ),
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
        w=12,
    )
    heatmap(
        b,
        "Collective latency by rank (heatmap)",
        "Mean latency of every rank's timed collectives in $pg (rows: ranks) over time. In a group the rank "
        "that arrives last waits least: a light row among dark ones is the late rank.",
        f"sum by (job, instance, rank) (rate(hpar_collective_duration_seconds_sum{{{SELPG}}}[{RI}])) / "
        f"sum by (job, instance, rank) (rate(hpar_collective_duration_seconds_count{{{SELPG}}}[{RI}]))",
        "s",
    )
    b.row("Throughput")
    ts(
        b,
        "Lowest $topn: bus bandwidth by rank",
        "Bus bandwidth of the last timed op (nccl-tests factors) of the $topn (rank, pg, op) series with the "
        "lowest minimum in the time range.",
        [
            Q(
                worst(
                    f"max by (job, instance, rank, pg, op) (hpar_collective_busbw_bytes_per_second{{{SELPG}}})",
                    best=True,
                ),
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
        [Q(f"sum by (pg) (rate(hpar_collective_unobserved_total{{{SELPG}}}[{RI}]))", "{{pg}}")],
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
        "Per-rank p99 of FSDP's collectives, the slowest $topn; empty where the backend gives no durations "
        "(gloo).",
        [
            Q(
                worst(
                    "histogram_quantile(0.99, sum by (job, instance, rank, pg, op, le) "
                    f"(rate(hpar_collective_duration_seconds_bucket{{{fsdp}}}[{RI}])))"
                ),
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
    )
    b.row("Gradient sync")
    ts(
        b,
        "Gradient-sync coverage: lowest $topn ranks",
        "Gradient elements each step reduced over the dp groups / trainable gradient elements it must "
        "reduce (1 when whole; a block outside the DDP/FSDP wrapper shows below 1), the $topn ranks with "
        "the lowest minimum in the time range. GradSyncIncomplete fires below 0.99.",
        [Q(worst(f"hpar_grad_sync_coverage_ratio{{{SEL}}}", best=True), "rank {{rank}} {{group}}")],
        "percentunit",
        w=24,
    )
    b.row("In flight and skew")
    ts(
        b,
        "Ops in flight: highest $topn",
        "Ops enqueued but not completed per rank and group; the $topn highest.",
        [Q(worst(f"hpar_collective_inflight{{{SELPG}}}"), "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Oldest in-flight age: highest $topn",
        "Age of the oldest incomplete op, the $topn oldest; Hang fires above 120 s.",
        [Q(worst(f"hpar_collective_oldest_inflight_age_seconds{{{SELPG}}}"), "rank {{rank}} {{pg}}")],
        "s",
        w=8,
    )
    ts(
        b,
        "Last completed seq: lowest $topn",
        "The rank lagging behind its group is the one the others wait for: the $topn lowest.",
        [Q(worst(f"hpar_collective_last_completed_seq{{{SELPG}}}", best=True), "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Mean latency by rank: lowest $topn",
        "The rank with the lowest mean waited least: it arrived last. The $topn lowest (recording rule).",
        [
            Q(
                worst(
                    f"rank_pg_op:hpar_collective_duration_seconds:mean5m{{{SELPG}}}", best=True, join=False
                ),
                "rank {{rank}} {{pg}} {{op}}",
            )
        ],
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
        "Dynamo compile attempts by outcome, trigger and backend (eager, aot_eager, inductor, ...).",
        [
            Q(
                f"sum by (outcome, trigger, backend) (increase(hpar_dynamo_compiles_total{{{SEL}}}[{RI}]))",
                "{{outcome}} {{trigger}} {{backend}}",
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
        "Recompiles and graph breaks: highest $topn ranks",
        "Per-second rates over 5m (recording rules), the $topn ranks with the highest peak of each.",
        [
            Q(worst(f"rank:hpar_dynamo_recompiles:rate5m{{{SEL}}}", join=False), "recompiles rank {{rank}}"),
            Q(
                worst(f"rank:hpar_dynamo_graph_breaks:rate5m{{{SEL}}}", join=False),
                "graph breaks rank {{rank}}",
            ),
        ],
        "short",
    )
    ts(
        b,
        "Graphs compiled: highest $topn ranks",
        "Graphs compiled in 5m, identical ones included, of the $topn ranks with the highest peak. Flat after "
        "warm-up; a line that keeps rising is a fresh compiled function per microbatch kept alive "
        "(CompiledGraphsGrowing names its file:line).",
        [Q(worst(f"sum by (job, instance, rank) (increase(hpar_dynamo_graphs_compiled_total{{{SEL}}}[5m]))"),
           "rank {{rank}}")],
        "short",
    )
    b.row("Caches and compile time")
    ts(
        b,
        "Compile-cache hit ratio",
        "AOTAutograd / Inductor FX graph cache hits over lookups (recording rule), the $topn lowest.",
        [
            Q(
                worst(f"rank_cache:hpar_dynamo_cache_hit:ratio5m{{{SEL}}}", best=True, join=False),
                "{{cache}} rank {{rank}}",
            )
        ],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Cache pollution: recompiles vs hit ratio ($topn ranks)",
        "The design document's cache pollution: recompiles in 5m above 10 while the rank's worst cache "
        "hit ratio (0-1) is below 0.3; RecompileStorm signal=cache_pollution fires when both hold. The $topn "
        "ranks with the most recompiles and the $topn with the lowest hit ratio.",
        [
            Q(worst(f"sum by (job, instance, rank) (increase(hpar_dynamo_recompiles_total{{{SEL}}}[5m]))"),
              "recompiles 5m rank {{rank}}"),
            Q(worst(f"min by (job, rank) (rank_cache:hpar_dynamo_cache_hit:ratio5m{{{SEL}}})", best=True, join=False),
              "hit ratio rank {{rank}}"),
        ],
        "short",
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
        "Unique graphs: highest $topn ranks",
        "Distinct graphs compiled by each rank, the $topn highest.",
        [Q(worst(f"hpar_dynamo_unique_graphs{{{SEL}}}"), "rank {{rank}}")],
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
        [Q(with_job_id(f"hpar_dynamo_graph_fingerprint{{{SEL}}}"), instant=True, table=True)],
        w=8,
    )
    ts(
        b,
        "Recompile-limit hits",
        "Frames that hit the recompile limit and run eagerly from now on (the $topn ranks with most).",
        [
            Q(
                worst(f"sum by (job, instance, rank) (hpar_dynamo_recompile_limit_hits_total{{{SEL}}})"),
                "rank {{rank}}",
            )
        ],
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
        "Post-step memory: highest $topn",
        "Memory sampled right after each step (allocator, nvml, rss): the $topn (rank, source) series with "
        "the highest peak in the time range.",
        [Q(worst(f"hpar_memory_post_step_bytes{{{SEL}}}"), "rank {{rank}} {{source}}")],
        "bytes",
    )
    heatmap(
        b,
        "Post-step memory by rank (heatmap)",
        "Every rank's memory right after each step (rows: ranks): the caching allocator's on CUDA, else "
        "the process RSS. A leak is a row that darkens over time.",
        f'max by (job, instance, rank) (hpar_memory_post_step_bytes{{{SEL},source="allocator"}}) or '
        f'max by (job, instance, rank) (hpar_memory_post_step_bytes{{{SEL},source="rss"}})',
        "bytes",
        w=24,
    )
    ts(
        b,
        "Growth per step: highest $topn",
        "10m slope of post-step memory divided by the step rate: bytes kept per step (the $topn highest).",
        [
            Q(
                worst(
                    f"rank_source:hpar_memory_post_step_bytes:deriv10m{{{SEL}}} / on (job, instance) group_left () "
                    f"sum by (job, instance) (rate(hpar_steps_total{{{SEL}}}[10m]))"
                ),
                "rank {{rank}} {{source}}",
            )
        ],
        "bytes",
    )
    ts(
        b,
        "Host RSS: highest $topn",
        "Resident set size of each rank's process, the $topn highest.",
        [Q(worst(f"hpar_host_rss_bytes{{{SEL}}}"), "rank {{rank}}")],
        "bytes",
    )
    ts(
        b,
        "MemoryLeak detector",
        "Ranks whose detector says leaking, and the signal of the $topn highest ranks.",
        [
            Q(f'sum(hpar_alert_active{{alert="MemoryLeak",{SEL}}})', "ranks leaking"),
            Q(worst(f'hpar_detector_value{{alert="MemoryLeak",{SEL}}}'), "signal rank {{rank}}"),
        ],
        "short",
    )
    b.row("GPU memory")
    ts(
        b,
        "GPU memory used / total (NVML)",
        "Device memory in use by all processes on the $topn fullest ranks, and the largest capacity.",
        [
            Q(worst(f"hpar_gpu_memory_used_bytes{{{SEL}}}"), "used rank {{rank}}"),
            Q(f"max(hpar_gpu_memory_total_bytes{{{SEL}}})", "total"),
        ],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "GPU memory used ratio",
        "The $topn fullest ranks; GpuMemoryNearFull fires above 95% for 5m.",
        [
            Q(
                worst(f"hpar_gpu_memory_used_bytes{{{SEL}}} / hpar_gpu_memory_total_bytes{{{SEL}}}"),
                "rank {{rank}}",
            )
        ],
        "percentunit",
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "Process GPU memory (NVML)",
        "Device memory used by each rank's process, the $topn highest.",
        [Q(worst(f"hpar_gpu_process_memory_bytes{{{SEL}}}"), "rank {{rank}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator bytes by kind",
        "CUDA caching allocator allocated / reserved / active bytes, the $topn highest (rank, kind).",
        [Q(worst(f"hpar_allocator_bytes{{{SEL}}}"), "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator peak bytes",
        "Peak bytes per kind since start or reset, the $topn highest (rank, kind).",
        [Q(worst(f"hpar_allocator_peak_bytes{{{SEL}}}"), "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator retries and OOMs",
        "cudaMalloc retries (memory pressure) and OOMs per interval.",
        [
            Q(f"sum(increase(hpar_allocator_alloc_retries_total{{{SEL}}}[{RI}]))", "retries"),
            Q(f"sum(increase(hpar_allocator_ooms_total{{{SEL}}}[{RI}]))", "OOMs"),
        ],
        "short",
        gpu=True,
    )
    b.row("GPU health")
    ts(
        b,
        "GPU utilization",
        "Fraction of time a kernel ran (NVML), the $topn least busy ranks.",
        [Q(worst(f"hpar_gpu_utilization_ratio{{{SEL}}}", best=True), "rank {{rank}}")],
        "percentunit",
        w=8,
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "GPU power",
        "Board power draw, the $topn highest ranks.",
        [Q(worst(f"hpar_gpu_power_watts{{{SEL}}}"), "rank {{rank}}")],
        "watt",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU temperature",
        "GPU core temperature, the $topn hottest ranks.",
        [Q(worst(f"hpar_gpu_temperature_celsius{{{SEL}}}"), "rank {{rank}}")],
        "celsius",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU clocks",
        "SM and memory clocks, the $topn lowest; a straggler's clock is often throttled.",
        [Q(worst(f"hpar_gpu_clock_hertz{{{SEL}}}", best=True), "rank {{rank}} {{clock}}")],
        "hertz",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "Clock throttling",
        "Ranks on which each throttle reason is active.",
        [Q(f"sum by (reason) (hpar_gpu_throttle_active{{{SEL}}})", "{{reason}}")],
        "short",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "ECC errors",
        "Volatile ECC errors per interval on the $topn ranks with most; GpuEccErrors fires on uncorrected ones.",
        [
            Q(
                worst(
                    f"sum by (job, instance, rank, error_type) (increase(hpar_gpu_ecc_errors_total{{{SEL}}}[{RI}]))"
                ),
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
        "Mean chunk time: slowest $topn",
        "Mean forward/backward time per microbatch chunk, the $topn slowest (rank, phase).",
        [
            Q(
                worst(
                    f"sum by (job, instance, rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_sum{{{SEL}}}[{RI}])) / "
                    f"sum by (job, instance, rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_count{{{SEL}}}[{RI}]))"
                ),
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
        "Busy time: highest $topn ranks",
        "Forward+backward compute time of the last step, the $topn highest.",
        [Q(worst(f"hpar_pp_busy_seconds{{{SEL}}}"), "rank {{rank}} stage {{pp_stage}}")],
        "s",
    )
    ts(
        b,
        "Compute time vs stage median",
        "Busy time over the median of the stage's ranks, the $topn highest; Straggler fires above 1.2.",
        [
            Q(
                worst(f"rank:hpar_pp_busy_seconds:ratio_to_stage_median5m{{{SEL}}}", join=False),
                "rank {{rank}}",
            )
        ],
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
    return sync_generated(files, args.check, "python -m dashboards.generate")


if __name__ == "__main__":
    sys.exit(main())
