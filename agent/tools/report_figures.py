"""The report's plotly figures of a run (``hpar-agent report``), and the short texts that label its
events (``brief``, shared with the page's tables). A figure is None when the run has nothing to plot;
labels taken from the files are escaped (plotly renders a subset of HTML in text)."""

from __future__ import annotations

import html
import itertools
import json
import math
import os
import re
from collections import defaultdict
from typing import Any

from hpar_agent import catalogue as cat
from hpar_agent.tools import units
from hpar_agent.tools.run_files import Run, Span, num

#: Per (pg, op) samples kept for the latency box plots; more are thinned by a fixed stride.
MAX_SAMPLES = 5000
#: "compile" is the record name of logs written before compile_start/backend_compile.
COMPILE_KINDS = ("compile_start", "backend_compile", "compile", "graph_break", "recompile")
#: Event fields every row shows anyway, left out of its text.
_SKIP_FIELDS = {"ts", "rank", "kind"}
_GUARD_PREFIX = re.compile(r"^\s*(?:- )?\d+/\d+: ")
#: Characters of a guard kept in a recompile row (the full text stays in the event log).
GUARD_CHARS = 160


def short_guard(guard: Any) -> str:
    """The first failed guard of a recompile, once: first line, no ``- 0/1:`` prefix, no ``# file:line``
    comment, at most GUARD_CHARS characters."""
    text = _GUARD_PREFIX.sub("", str(guard or "").strip().splitlines()[0] if str(guard or "").strip() else "")
    text = text.split("  #", 1)[0].strip()
    return text if len(text) <= GUARD_CHARS else text[: GUARD_CHARS - 1] + "…"


def brief(e: dict[str, Any]) -> str:
    """The fields of an event other than ts/rank/kind, compact (the caller escapes). A recompile says
    its function, reason and first failed guard once (its event repeats the guard in three fields)."""
    if e.get("kind") == "recompile":
        failed = e.get("failed_guards")
        more = len(failed) - 1 if isinstance(failed, list) and len(failed) > 1 else 0
        func = str(e.get("function") or "")
        name, _, where = func.partition(" ")
        func = f"{name} {os.path.basename(where)}" if where else name  # "forward model.py:78"
        parts = [p for p in (func, str(e.get("reason") or "")) if p]
        head = " · ".join(parts)
        guard = short_guard(e.get("guard") or (failed[0] if isinstance(failed, list) and failed else ""))
        return f"{head}: {guard}" + (f" (+{more} more failed guards)" if more else "")
    parts = []
    for k, v in e.items():
        if k not in _SKIP_FIELDS:
            parts.append(f"{k}={v if isinstance(v, str) else json.dumps(units.rounded(v), default=str)}")
    return " ".join(parts)


def esc(v: Any) -> str:
    """Escaped text for HTML and for plotly labels (plotly renders a subset of HTML tags in text)."""
    return html.escape(str(v), quote=True)


def _layout(title: str, xtitle: str, ytitle: str, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title},
        "xaxis": {"title": {"text": xtitle}},
        "yaxis": {"title": {"text": ytitle}},
        "margin": {"l": 60, "r": 20, "t": 50, "b": 50},
        "height": 380,
        "template": "plotly_white",
        **extra,
    }


def _color(rank: int) -> str:
    from plotly.colors import qualitative

    palette: list[str] = qualitative.Plotly
    return palette[rank % len(palette)]


def _trainer_series(run: Run, key: str, scale: float = 1.0) -> dict[int, tuple[list[int], list[float]]]:
    """(steps, values) per rank of one numeric field of the trainer's per-rank step records."""
    out = {}
    for rank, recs in sorted(run.trainer_steps.items()):
        pts = [(r["step"], v * scale) for r in recs if (v := num(r.get(key))) is not None]
        if pts:
            out[rank] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def fig_step_times(run: Run) -> Any:
    """Step time per rank over steps: every step from the trainer's per-rank records (lines) and the
    agent's ``train.step`` spans (markers; only traced steps), in one colour per rank."""
    import plotly.graph_objects as go

    spans: dict[int, dict[int, float]] = defaultdict(dict)
    for s in run.spans:
        step = s.attrs.get(cat.ATTR_STEP)
        if s.name == cat.SPAN_STEP and s.rank is not None and isinstance(step, int):
            spans[s.rank][step] = s.seconds
    lines = _trainer_series(run, "step_s")
    if not spans and not lines:
        return None
    fig = go.Figure(layout=_layout("Step time per rank", "step", "seconds"))
    for rank in sorted(set(spans) | set(lines)):
        style = {
            "legendgroup": f"rank {rank}",
            "line": {"color": _color(rank)},
            "marker": {"color": _color(rank)},
        }
        if rank in lines:
            x, y = lines[rank]
            fig.add_scatter(x=x, y=y, mode="lines", name=f"rank {rank} (trainer)", **style)
        if rank in spans:
            steps = sorted(spans[rank])
            mode = "markers" if rank in lines else "lines+markers"
            y = [spans[rank][k] for k in steps]
            fig.add_scatter(x=steps, y=y, mode=mode, name=f"rank {rank} (train.step span)", **style)
    values = [v for d in spans.values() for v in d.values()] + [v for _, ys in lines.values() for v in ys]
    positive = [v for v in values if v > 0]
    if positive and max(positive) > 20 * min(positive):
        fig.update_yaxes(type="log")  # compile steps take 100x longer: keep steady-state steps readable
    return fig


def fig_memory_steps(run: Run) -> Any:
    """Host RSS per rank after every step (trainer records): a leak shows as a rising line."""
    import plotly.graph_objects as go

    series = _trainer_series(run, "rss_mb", 2**20)
    if not series:
        return None
    fig = go.Figure(layout=_layout("Host RSS per rank over steps", "step", "bytes"))
    for rank, (x, y) in series.items():
        fig.add_scatter(x=x, y=y, mode="lines+markers", name=f"rank {rank}", line={"color": _color(rank)})
    return fig


def memory_series(summary: dict[str, Any]) -> dict[str, float]:
    """The memory figures of one rank's summary: RSS, post-step samples, allocator and NVML."""
    comps = summary.get("components") or {}
    mem = comps.get("memory") or {}
    out: dict[str, float] = {}
    if (v := num(mem.get("rss_bytes"))) is not None:
        out["host RSS"] = v
    for src, val in (mem.get("post_step_last") or {}).items():
        if (v := num(val)) is not None:
            out[f"post-step {src}"] = v
    for kind, val in (mem.get("allocator") or {}).items():
        if (v := num(val)) is not None:
            out[f"allocator {kind}"] = v
    nvml = comps.get("nvml") or {}
    if (v := num(nvml.get("process_bytes"))) is not None:
        out["GPU process (NVML)"] = v
    return out


def fig_memory(run: Run) -> Any:
    """Memory per rank at the end of the run, one bar group per source."""
    import plotly.graph_objects as go

    per_rank = {r: memory_series(s) for r, s in sorted(run.summaries.items())}
    series = sorted({k for d in per_rank.values() for k in d})
    if not series:
        return None
    fig = go.Figure(layout=_layout("Memory per rank (end of run)", "rank", "bytes", barmode="group"))
    ranks = list(per_rank)
    for name in series:
        fig.add_bar(x=[f"rank {r}" for r in ranks], y=[per_rank[r].get(name) for r in ranks], name=esc(name))
    return fig


def collective_samples(run: Run) -> dict[tuple[str, str], list[float]]:
    """Latency samples (seconds) of ``collective.*`` spans by (pg, op)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in run.spans:
        if s.name.startswith(cat.SPAN_COLLECTIVE_PREFIX):
            op = s.attrs.get(cat.ATTR_OP) or s.name[len(cat.SPAN_COLLECTIVE_PREFIX) :]
            out[(str(s.attrs.get(cat.ATTR_PG, "?")), str(op))].append(s.seconds)
    return dict(sorted(out.items()))


def fig_collectives(samples: dict[tuple[str, str], list[float]]) -> Any:
    """Latency distribution per process group and op (box plot, milliseconds)."""
    import plotly.graph_objects as go

    if not samples:
        return None
    fig = go.Figure(
        layout=_layout("Collective latency per group (collective.* spans)", "pg / op", "milliseconds")
    )
    for (pg, op), vals in samples.items():
        stride = max(1, math.ceil(len(vals) / MAX_SAMPLES))
        fig.add_box(y=[v * 1e3 for v in vals[::stride]], name=esc(f"{pg} / {op}"), boxpoints="outliers")
    fig.update_layout(showlegend=False)
    return fig


def step_anchors(run: Run) -> dict[int, list[tuple[float, float]]]:
    """Per rank, (wall seconds, step) at the start and end of every traced ``train.step`` span: the
    points that place an event (stamped with wall time) on the step axis."""
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in run.spans:
        step = s.attrs.get(cat.ATTR_STEP)
        if s.name == cat.SPAN_STEP and s.rank is not None and isinstance(step, int):
            out[s.rank] += [(s.start_ns / 1e9, float(step)), (s.end_ns / 1e9, step + 1.0)]
    return {r: sorted(v) for r, v in out.items()}


def event_step(e: dict[str, Any], anchors: dict[int, list[tuple[float, float]]]) -> float | None:
    """The step an event happened in: its own ``step`` field, else interpolated between the traced
    steps of its rank (an event before the first traced step sits at that step, after the last at it)."""
    if isinstance(e.get("step"), int):
        return float(e["step"])
    ts, pts = num(e.get("ts")), anchors.get(e.get("rank"))  # type: ignore[arg-type]
    if ts is None or not pts:
        return None
    if ts <= pts[0][0]:
        return pts[0][1]
    for (t0, s0), (t1, s1) in itertools.pairwise(pts):
        if t0 <= ts <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (ts - t0) / (t1 - t0)
    return pts[-1][1]


def _t0(run: Run) -> float:
    ts = [e["ts"] for e in run.events if num(e.get("ts")) is not None]
    return min(ts) if ts else 0.0


def fig_compile(run: Run) -> Any:
    """Compile, graph-break and recompile events of every rank on the step axis (time since the first
    event when no step can be placed: a run without traced steps)."""
    import plotly.graph_objects as go

    events = [e for e in run.events if e.get("kind") in COMPILE_KINDS and num(e.get("ts")) is not None]
    if not events:
        return None
    anchors = step_anchors(run)
    steps = {id(e): event_step(e, anchors) for e in events}
    on_steps = all(v is not None for v in steps.values())
    t0 = _t0(run)
    xtitle = "step (interpolated between traced steps)" if on_steps else "seconds since the first event"
    fig = go.Figure(layout=_layout("torch.compile events", xtitle, "rank"))
    symbols = {
        "compile_start": "triangle-right",
        "backend_compile": "circle",
        "compile": "circle",
        "graph_break": "x",
        "recompile": "diamond",
    }
    for kind in COMPILE_KINDS:
        mine = [e for e in events if e.get("kind") == kind]
        if mine:
            fig.add_scatter(
                x=[steps[id(e)] if on_steps else e["ts"] - t0 for e in mine],
                y=[e.get("rank") for e in mine],
                mode="markers",
                name=kind,
                marker={"symbol": symbols[kind], "size": 10},
                text=[esc(brief(e))[:200] for e in mine],
                hoverinfo="x+y+text",
            )
    fig.update_yaxes(dtick=1)
    return fig


def pipeline_step(run: Run) -> tuple[int, list[Span]] | None:
    """The traced step with ``pp.forward``/``pp.backward`` spans on the most ranks (latest on ties),
    and those spans."""
    by_step: dict[int, list[Span]] = defaultdict(list)
    for s in run.spans:
        step = s.attrs.get(cat.ATTR_STEP)
        if (
            s.name in (cat.SPAN_PP_FORWARD, cat.SPAN_PP_BACKWARD)
            and s.rank is not None
            and isinstance(step, int)
        ):
            by_step[step].append(s)
    if not by_step:
        return None
    step = max(by_step, key=lambda k: (len({s.rank for s in by_step[k]}), k))
    return step, by_step[step]


def fig_pipeline(run: Run) -> Any:
    """The pipeline schedule of one traced step: per rank (grouped by stage), a bar per microbatch's
    forward and backward on the time axis from the step's first chunk; the gaps are the bubble."""
    import plotly.graph_objects as go

    found = pipeline_step(run)
    if found is None:
        return None
    step, spans = found
    t0 = min(s.start_ns for s in spans)
    stage_of = {s.rank: s.attrs.get(cat.ATTR_PP_STAGE, "?") for s in spans}
    order = sorted(stage_of, key=lambda r: (str(stage_of[r]), r), reverse=True)  # stage 0 on top
    label = {r: f"stage {stage_of[r]} · rank {r}" for r in order}
    fig = go.Figure(
        layout=_layout(
            f"Pipeline schedule of step {step} (pp.forward / pp.backward spans)",
            "milliseconds since the step's first chunk",
            "",
            barmode="overlay",
            height=max(260, 60 + 34 * len(order)),
        )
    )
    for name, short, color in ((cat.SPAN_PP_FORWARD, "F", "#4c78a8"), (cat.SPAN_PP_BACKWARD, "B", "#f58518")):
        mine = sorted((s for s in spans if s.name == name), key=lambda s: (s.rank, s.start_ns))
        if not mine:
            continue
        fig.add_bar(
            orientation="h",
            name=name,
            marker={"color": color, "line": {"color": "white", "width": 1}},
            y=[label[s.rank] for s in mine],  # type: ignore[index]
            base=[(s.start_ns - t0) / 1e6 for s in mine],
            x=[(s.end_ns - s.start_ns) / 1e6 for s in mine],
            text=[f"{short}{s.attrs.get(cat.ATTR_MICROBATCH, '')}" for s in mine],
            textposition="inside",
            hovertemplate="%{y}<br>%{text}: %{base:.1f} ms + %{x:.1f} ms<extra></extra>",
        )
    fig.update_yaxes(categoryorder="array", categoryarray=[label[r] for r in order])
    return fig


def fig_collective_ranks(rows: dict[tuple[str, str], dict[str, Any]]) -> Any:
    """Collective p50 per rank for each (pg, op), from the agent's histograms: skew across ranks."""
    import plotly.graph_objects as go

    rows = {k: v for k, v in rows.items() if v["rank_p50"]}
    if not rows:
        return None
    fig = go.Figure(
        layout=_layout("Collective p50 per rank (skew across ranks)", "rank", "milliseconds", barmode="group")
    )
    for (pg, op), row in rows.items():
        ranks = sorted(row["rank_p50"])
        fig.add_bar(
            x=[f"rank {r}" for r in ranks],
            y=[row["rank_p50"][r] * 1e3 for r in ranks],
            name=esc(f"{pg} / {op}"),
        )
    return fig


def fig_loss(run: Run) -> Any:
    """The loss the trainer logged per step (``trainer.json``)."""
    import plotly.graph_objects as go

    losses = run.trainer.get("losses")
    if not isinstance(losses, list):
        return None
    pts = [(i, v) for i, x in enumerate(losses) if (v := num(x)) is not None]
    if not pts:
        return None
    fig = go.Figure(layout=_layout("Training loss", "step", "loss"))
    fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name="loss")
    return fig
