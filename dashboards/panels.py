"""Shared building blocks of the dashboards: the label selectors and variables every query filters
on, PromQL helpers for 1,024-rank jobs (worst-N, the ``job_id`` join), the panel constructors and the
dashboard assembly. The board modules beside this one only compose them, so a dashboard-wide change
(a variable, an annotation, a panel default) is made once here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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


def worst(expr: str, best: bool = False, join: bool = True, draw: str = "") -> str:
    """The ``$topn`` series of ``expr`` with the highest (``best``: lowest) peak over the dashboard's
    time range. The set is chosen once, at the range's end (``@ end()``), so a range query draws at
    most ``$topn`` series; a bare ``topk`` would pick new ranks at every step. ``join``: restrict to
    ``$job_id`` (needs ``job``, ``instance`` and ``rank``; recording rules keep no ``instance``).
    ``draw``: a series with the same labels to draw for that set instead of ``expr``."""
    e = with_job_id(expr) if join else expr
    d = (with_job_id(draw) if join else draw) if draw else e
    fn, over = ("bottomk", "min_over_time") if best else ("topk", "max_over_time")
    return f"{d} and {fn}($topn, {over}(({e})[$__range:$__interval] @ end()))"


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
