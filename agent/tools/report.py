"""``hpar-agent report RUN_DIR``: one self-contained HTML page of a run, for users without Prometheus
or Grafana, built only from the files the agent and trainer leave in the run directory.

Inputs (all optional, read defensively because their shapes evolve): ``events.rank<R>.jsonl``,
``summary.rank<R>.json``, ``traces.rank<R>.jsonl`` (OTLP/JSON, one ExportTraceServiceRequest per line)
and ``trainer.json``. Plots are plotly figures rendered by plotly.js embedded inline, so the page works
offline. Every text taken from the files is HTML-escaped: event fields (graph-break text, stacks) are
free text written by the process under observation.
"""

from __future__ import annotations

import html
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hpar_agent import catalogue as cat
from hpar_agent.safefiles import private_dir, write_atomic
from hpar_agent.tools.summary import COLLECTIVE_PERCENTILE_SOURCE, collective_rows

log = logging.getLogger(__name__)

#: Per (pg, op) samples kept for the latency box plots; more are thinned by a fixed stride.
MAX_SAMPLES = 5000
#: Rows shown in the compile-event table (the timeline plot shows all of them).
MAX_TABLE_ROWS = 500
#: "compile" is the record name of logs written before compile_start/backend_compile.
COMPILE_KINDS = ("compile_start", "backend_compile", "compile", "graph_break", "recompile")
_RANK_RE = re.compile(r"\.rank(\d+)\.")


@dataclass
class Span:
    name: str
    rank: int | None
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]

    @property
    def seconds(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


@dataclass
class Run:
    """Everything the page shows, parsed from a run directory."""

    run_dir: Path
    summaries: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    trainer: dict[str, Any] = field(default_factory=dict)
    #: Per-rank step records of the reference trainer (``trainer.rank<R>.json`` "steps"): every step,
    #: where the traces keep only sampled and slow ones.
    trainer_steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # unreadable files/lines, shown on the page

    @property
    def ranks(self) -> list[int]:
        found = set(self.summaries)
        found |= {e["rank"] for e in self.events if isinstance(e.get("rank"), int)}
        found |= {s.rank for s in self.spans if s.rank is not None}
        found |= set(self.trainer_steps)
        return sorted(found)


# ------------------------------------------------------------------------------------------- loading
def _rank_of(path: Path) -> int | None:
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


def _rank_files(run_dir: Path, prefix: str, ext: str) -> list[tuple[int, Path]]:
    out = [(r, p) for p in run_dir.glob(f"{prefix}.rank*.{ext}") if (r := _rank_of(p)) is not None]
    return sorted(out)


def _jsonl(path: Path, run: Run) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (the process was killed) is counted, not fatal."""
    bad = 0
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    bad += 1
                    continue
                if isinstance(rec, dict):
                    yield rec
    except OSError as exc:
        run.problems.append(f"{path.name}: {exc}")
    if bad:
        run.problems.append(f"{path.name}: {bad} unreadable line(s) skipped")


def _any_value(v: Any) -> Any:
    """An OTLP AnyValue in protobuf-JSON form (int64 arrives as a string) as a Python value."""
    if not isinstance(v, dict):
        return v
    if "intValue" in v:
        try:
            return int(v["intValue"])
        except (TypeError, ValueError):
            return None
    for key in ("stringValue", "doubleValue", "boolValue"):
        if key in v:
            return v[key]
    return None


def _attrs(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        return {}
    return {a["key"]: _any_value(a.get("value")) for a in items if isinstance(a, dict) and "key" in a}


def _spans_of(request: dict[str, Any], file_rank: int | None) -> Iterator[Span]:
    for rs in request.get("resourceSpans") or ():
        res_rank = _attrs((rs.get("resource") or {}).get("attributes")).get(cat.ATTR_RANK, file_rank)
        for ss in rs.get("scopeSpans") or ():
            for sp in ss.get("spans") or ():
                try:
                    start, end = int(sp["startTimeUnixNano"]), int(sp["endTimeUnixNano"])
                except (KeyError, TypeError, ValueError):
                    continue
                attrs = _attrs(sp.get("attributes"))
                rank = attrs.get(cat.ATTR_RANK, res_rank)
                yield Span(
                    str(sp.get("name", "")), rank if isinstance(rank, int) else None, start, end, attrs
                )


def load_run(run_dir: str | os.PathLike[str]) -> Run:
    """Parse every file of the run that exists; missing or broken files only leave gaps."""
    run = Run(Path(run_dir))
    for rank, path in _rank_files(run.run_dir, "summary", "json"):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(doc, dict):
                run.summaries[rank] = doc
        except (OSError, ValueError) as exc:
            run.problems.append(f"{path.name}: {exc}")
    for rank, path in _rank_files(run.run_dir, "events", "jsonl"):
        for rec in _jsonl(path, run):
            rec.setdefault("rank", rank)
            run.events.append(rec)
    run.events.sort(key=lambda e: _num(e.get("ts")) or 0.0)
    for rank, path in _rank_files(run.run_dir, "traces", "jsonl"):
        for req in _jsonl(path, run):
            run.spans.extend(_spans_of(req, rank))
    for rank, path in _rank_files(run.run_dir, "trainer", "json"):
        try:
            steps = json.loads(path.read_text(encoding="utf-8")).get("steps")
        except (OSError, ValueError, AttributeError) as exc:
            run.problems.append(f"{path.name}: {exc}")
            continue
        if isinstance(steps, list):
            run.trainer_steps[rank] = [
                r for r in steps if isinstance(r, dict) and isinstance(r.get("step"), int)
            ]
    trainer = run.run_dir / "trainer.json"
    if trainer.exists():
        try:
            doc = json.loads(trainer.read_text(encoding="utf-8"))
            run.trainer = doc if isinstance(doc, dict) else {}
        except (OSError, ValueError) as exc:
            run.problems.append(f"trainer.json: {exc}")
    return run


# ------------------------------------------------------------------------------------------ figures
def _esc(v: Any) -> str:
    """Escaped text for HTML and for plotly labels (plotly renders a subset of HTML tags in text)."""
    return html.escape(str(v), quote=True)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


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
        pts = [(r["step"], v * scale) for r in recs if (v := _num(r.get(key))) is not None]
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


def _memory_series(summary: dict[str, Any]) -> dict[str, float]:
    """The memory figures of one rank's summary: RSS, post-step samples, allocator and NVML."""
    comps = summary.get("components") or {}
    mem = comps.get("memory") or {}
    out: dict[str, float] = {}
    if (v := _num(mem.get("rss_bytes"))) is not None:
        out["host RSS"] = v
    for src, val in (mem.get("post_step_last") or {}).items():
        if (v := _num(val)) is not None:
            out[f"post-step {src}"] = v
    for kind, val in (mem.get("allocator") or {}).items():
        if (v := _num(val)) is not None:
            out[f"allocator {kind}"] = v
    nvml = comps.get("nvml") or {}
    if (v := _num(nvml.get("process_bytes"))) is not None:
        out["GPU process (NVML)"] = v
    return out


def fig_memory(run: Run) -> Any:
    """Memory per rank at the end of the run, one bar group per source."""
    import plotly.graph_objects as go

    per_rank = {r: _memory_series(s) for r, s in sorted(run.summaries.items())}
    series = sorted({k for d in per_rank.values() for k in d})
    if not series:
        return None
    fig = go.Figure(layout=_layout("Memory per rank (end of run)", "rank", "bytes", barmode="group"))
    ranks = list(per_rank)
    for name in series:
        fig.add_bar(x=[f"rank {r}" for r in ranks], y=[per_rank[r].get(name) for r in ranks], name=_esc(name))
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
        fig.add_box(y=[v * 1e3 for v in vals[::stride]], name=_esc(f"{pg} / {op}"), boxpoints="outliers")
    fig.update_layout(showlegend=False)
    return fig


def _step_anchors(run: Run) -> dict[int, list[tuple[float, float]]]:
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
    ts, pts = _num(e.get("ts")), anchors.get(e.get("rank"))  # type: ignore[arg-type]
    if ts is None or not pts:
        return None
    if ts <= pts[0][0]:
        return pts[0][1]
    for (t0, s0), (t1, s1) in itertools.pairwise(pts):
        if t0 <= ts <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (ts - t0) / (t1 - t0)
    return pts[-1][1]


def _t0(run: Run) -> float:
    ts = [e["ts"] for e in run.events if _num(e.get("ts")) is not None]
    return min(ts) if ts else 0.0


def fig_compile(run: Run) -> Any:
    """Compile, graph-break and recompile events of every rank on the step axis (time since the first
    event when no step can be placed: a run without traced steps)."""
    import plotly.graph_objects as go

    events = [e for e in run.events if e.get("kind") in COMPILE_KINDS and _num(e.get("ts")) is not None]
    if not events:
        return None
    anchors = _step_anchors(run)
    steps = {id(e): event_step(e, anchors) for e in events}
    on_steps = all(v is not None for v in steps.values())
    t0 = _t0(run)
    xtitle = "step (interpolated between traced steps)" if on_steps else "seconds since the first event"
    fig = go.Figure(layout=_layout("torch.compile events", xtitle, "rank"))
    symbols = {"compile_start": "triangle-right", "backend_compile": "circle", "compile": "circle",
               "graph_break": "x", "recompile": "diamond"}
    for kind in COMPILE_KINDS:
        mine = [e for e in events if e.get("kind") == kind]
        if mine:
            fig.add_scatter(
                x=[steps[id(e)] if on_steps else e["ts"] - t0 for e in mine],
                y=[e.get("rank") for e in mine],
                mode="markers",
                name=kind,
                marker={"symbol": symbols[kind], "size": 10},
                text=[_esc(_brief(e))[:200] for e in mine],
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
        if s.name in (cat.SPAN_PP_FORWARD, cat.SPAN_PP_BACKWARD) and s.rank is not None and isinstance(step, int):
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
    fig = go.Figure(layout=_layout(
        f"Pipeline schedule of step {step} (pp.forward / pp.backward spans)",
        "milliseconds since the step's first chunk", "", barmode="overlay",
        height=max(260, 60 + 34 * len(order)),
    ))  # fmt: skip
    for name, short, color in ((cat.SPAN_PP_FORWARD, "F", "#4c78a8"), (cat.SPAN_PP_BACKWARD, "B", "#f58518")):
        mine = sorted((s for s in spans if s.name == name), key=lambda s: (s.rank, s.start_ns))
        if not mine:
            continue
        fig.add_bar(
            orientation="h", name=name, marker={"color": color, "line": {"color": "white", "width": 1}},
            y=[label[s.rank] for s in mine],  # type: ignore[index]
            base=[(s.start_ns - t0) / 1e6 for s in mine], x=[(s.end_ns - s.start_ns) / 1e6 for s in mine],
            text=[f"{short}{s.attrs.get(cat.ATTR_MICROBATCH, '')}" for s in mine], textposition="inside",
            hovertemplate="%{y}<br>%{text}: %{base:.1f} ms + %{x:.1f} ms<extra></extra>",
        )  # fmt: skip
    fig.update_yaxes(categoryorder="array", categoryarray=[label[r] for r in order])
    return fig


def fig_collective_ranks(rows: dict[tuple[str, str], dict[str, Any]]) -> Any:
    """Collective p50 per rank for each (pg, op), from the agent's histograms: skew across ranks."""
    import plotly.graph_objects as go

    rows = {k: v for k, v in rows.items() if v["rank_p50"]}
    if not rows:
        return None
    fig = go.Figure(layout=_layout(
        "Collective p50 per rank (skew across ranks)", "rank", "milliseconds", barmode="group"
    ))
    for (pg, op), row in rows.items():
        ranks = sorted(row["rank_p50"])
        fig.add_bar(x=[f"rank {r}" for r in ranks], y=[row["rank_p50"][r] * 1e3 for r in ranks],
                    name=_esc(f"{pg} / {op}"))
    return fig


def fig_loss(run: Run) -> Any:
    """The loss the trainer logged per step (``trainer.json``)."""
    import plotly.graph_objects as go

    losses = run.trainer.get("losses")
    if not isinstance(losses, list):
        return None
    pts = [(i, v) for i, x in enumerate(losses) if (v := _num(x)) is not None]
    if not pts:
        return None
    fig = go.Figure(layout=_layout("Training loss", "step", "loss"))
    fig.add_scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name="loss")
    return fig


# ------------------------------------------------------------------------------------------- tables
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


def _brief(e: dict[str, Any]) -> str:
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
            parts.append(f"{k}={v if isinstance(v, str) else json.dumps(v, default=str)}")
    return " ".join(parts)


def _fmt_s(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "-"
    return f"{f * 1e3:.1f} ms" if f < 1 else f"{f:.2f} s"


def _fmt_bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def _fmt_value(v: Any) -> str:
    """A detector value: 4 significant digits for numbers, text as it came."""
    f = _num(v)
    return "-" if v is None else f"{f:.4g}" if f is not None else str(v)


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table of already-escaped cells."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _when(ts: Any) -> str:
    f = _num(ts)
    return (
        time.strftime("%H:%M:%S", time.localtime(f)) + f".{int(f % 1 * 1000):03d}" if f is not None else "-"
    )


def ranks_table(run: Run) -> str:
    rows = []
    for rank in run.ranks:
        s = run.summaries.get(rank, {})
        comps = s.get("components") or {}
        steps = comps.get("steps") or {}
        bubble = _num((comps.get("pipeline") or {}).get("bubble_ratio"))
        errors = sum(v for v in (s.get("errors") or {}).values() if isinstance(v, int))
        rows.append([
            _esc(rank), _esc(s.get("pp_stage", "-")), _esc(steps.get("steps", "-")),
            _esc(_fmt_s(steps.get("step_seconds_p50"))), _esc(_fmt_s(steps.get("step_seconds_max"))),
            "-" if bubble is None else f"{bubble:.2f}", _esc(errors),
        ])  # fmt: skip
    return _table(["rank", "pp stage", "steps", "step p50", "step max", "bubble ratio", "agent errors"], rows)


def collectives_table(
    run: Run, samples: dict[tuple[str, str], list[float]], rows: dict[tuple[str, str], dict[str, Any]]
) -> str:
    """Per (pg, op): counts, bytes, p50/p99 and bus bandwidth from the agent's summaries (the same
    numbers as the terminal summary: ``summary.collective_rows``), the skew of p50 across ranks, and
    how many traced spans the box plot shows."""
    counts: dict[str, int] = defaultdict(int)
    for s in run.summaries.values():
        ops = ((s.get("components") or {}).get("collectives") or {}).get("ops") or {}
        for key, n in ops.items():
            if isinstance(n, int):
                counts[str(key)] += n
    keys = sorted({f"{pg}/{op}" for pg, op in samples} | {f"{pg}/{op}" for pg, op in rows} | set(counts))
    out = []
    for key in keys:
        pg, _, op = key.partition("/")
        row = rows.get((pg, op), {})
        per_rank = sorted((row.get("rank_p50") or {}).values())
        skew = f"{per_rank[-1] / per_rank[0]:.2f}x" if len(per_rank) > 1 and per_rank[0] > 0 else "-"
        bw = row.get("busbw")
        out.append([
            _esc(pg), _esc(op), _esc(row.get("count") or counts.get(key, "-")), _esc(row.get("timed", "-")),
            _esc(_fmt_bytes(row["bytes"]) if row.get("bytes") else "-"),
            _esc(_fmt_s(row.get("p50"))), _esc(_fmt_s(row.get("p99"))), skew,
            _esc(f"{bw / 1e9:.2f} GB/s" if bw else "-"), _esc(len(samples.get((pg, op), ()))),
        ])  # fmt: skip
    heads = ["pg", "op", "ops counted", "timed", "bytes", "p50", "p99", "p50 skew (max/min rank)", "busbw", "traced spans"]
    return _table(heads, out) + f'<p class="meta">{_esc(COLLECTIVE_PERCENTILE_SOURCE)}.</p>'


def memory_table(run: Run) -> str:
    rows = []
    for rank, s in sorted(run.summaries.items()):
        for name, v in sorted(_memory_series(s).items()):
            rows.append([_esc(rank), _esc(name), _esc(_fmt_bytes(v))])
    return _table(["rank", "source", "bytes"], rows)


def compile_table(run: Run) -> str:
    events = [e for e in run.events if e.get("kind") in COMPILE_KINDS]
    rows = [
        [
            _esc(_when(e.get("ts"))),
            _esc(e.get("rank")),
            _esc(e.get("kind")),
            f"<pre>{_esc(_brief(e))[:4000]}</pre>",
        ]
        for e in events[:MAX_TABLE_ROWS]
    ]
    more = f"<p>{len(events) - MAX_TABLE_ROWS} more not shown.</p>" if len(events) > MAX_TABLE_ROWS else ""
    return _table(["time", "rank", "kind", "details"], rows, "events") + more


def _evidence_link(path: Any, run_dir: Path, out_dir: Path) -> str:
    """A link to an evidence file relative to the page, so a copied run directory keeps working."""
    p = Path(str(path))
    target = p if p.is_absolute() else run_dir / p
    rel = os.path.relpath(target.resolve(), out_dir.resolve())
    exists = "" if target.exists() else ' <span class="missing">(missing)</span>'
    return f'<a href="{_esc(quote(Path(rel).as_posix()))}">{_esc(Path(rel).as_posix())}</a>{exists}'


def alerts_table(run: Run, out_dir: Path) -> str:
    rows = []
    for e in run.events:
        if e.get("kind") != "alert":
            continue
        evidence = e.get("evidence")
        evidence = evidence if isinstance(evidence, list) else []
        links = "<br>".join(_evidence_link(p, run.run_dir, out_dir) for p in evidence) or "-"
        state = str(e.get("state", ""))
        details = e.get("details")
        rows.append([
            _esc(_when(e.get("ts"))), _esc(e.get("rank")), f"<b>{_esc(e.get('alert', '?'))}</b>",
            f'<span class="state-{_esc(state)}">{_esc(state)}</span>', _esc(_fmt_value(e.get("value"))),
            _esc(_fmt_value(e.get("threshold"))), _esc(e.get("step", "-")),
            f"<pre>{_esc(json.dumps(details, default=str))[:2000]}</pre>" if details else "-", links,
        ])  # fmt: skip
    headers = ["time", "rank", "alert", "state", "value", "threshold", "step", "details", "evidence"]
    return _table(headers, rows, "alerts")


# ------------------------------------------------------------------------------------------- page
_CSS = """
body{font-family:system-ui,sans-serif;margin:0 2em 2em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0} th,td{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top} th{background:#f4f4f4} pre{margin:0;white-space:pre-wrap;overflow-wrap:anywhere;max-width:90em}
.plot{min-height:380px} .none{color:#888} .state-firing,.state-active{color:#b00;font-weight:bold}
.state-resolved,.state-inactive{color:#070} .missing{color:#b00} .meta{color:#555}
"""

# Draws every figure, then records how many plots rendered and any script error in the DOM, so a
# headless browser (and a user with devtools) can tell a complete page from a broken one.
_SCRIPT = """
window.hparErrors = [];
window.addEventListener('error', function (e) {
  window.hparErrors.push(String(e.message));
  document.body.dataset.errors = JSON.stringify(window.hparErrors);
});
(function () {
  var figs = JSON.parse(document.getElementById('hpar-figures').textContent);
  var jobs = Object.keys(figs).map(function (id) {
    return Plotly.newPlot(id, figs[id].data, figs[id].layout, {displaylogo: false, responsive: true});
  });
  Promise.all(jobs).then(function () {
    var n = 0;
    document.querySelectorAll('.js-plotly-plot').forEach(function (el) {
      if (el.querySelector('.main-svg')) { n += 1; }
    });
    document.body.dataset.plotsDrawn = String(n);
  }, function (err) {
    window.hparErrors.push(String(err));
    document.body.dataset.errors = JSON.stringify(window.hparErrors);
  });
})();
"""


def _script_json(obj: Any) -> str:
    """JSON safe inside a <script> element: no '<', '>' or '&' can end it or open a comment."""
    text = json.dumps(obj, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _header(run: Run) -> str:
    topo: dict[str, Any] = {}
    for s in run.summaries.values():
        if isinstance(s.get("topology"), dict):
            topo = s["topology"]
            break
    job = topo.get("job") or run.run_dir.name
    shape = " x ".join(f"{k}{topo[k]}" for k in ("dp", "tp", "pp") if k in topo)
    facts = [f"job <b>{_esc(job)}</b>", f"{len(run.ranks)} rank(s)"]
    if shape:
        facts.append(_esc(shape))
    for key in ("world_size", "backend", "device", "torch_version", "agent_version"):
        if key in topo:
            facts.append(f"{_esc(key)} {_esc(topo[key])}")
    facts.append(f"{len(run.events)} events, {len(run.spans)} spans")
    return "<p class='meta'>" + " · ".join(facts) + "</p>"


def anatomy_table(run: Run) -> str:
    """Per rank: phase medians, shares of step time and the bottleneck verdict with its evidence."""
    rows = []
    digests = [(s.get("components") or {}).get("anatomy") or {} for s in run.summaries.values()]
    phases = [p for p in cat.STEP_PHASES if any(p in (d.get("phase_seconds_p50") or {}) for d in digests)]
    for rank in run.ranks:
        a = (run.summaries.get(rank, {}).get("components") or {}).get("anatomy") or {}
        if not a:
            continue
        p50 = a.get("phase_seconds_p50") or {}
        ev = a.get("evidence") or {}
        shares = ev.get("shares") or {}
        cells = [_esc(rank), _esc(_fmt_s(a.get("step_seconds_p50")))]
        for p in phases:
            share = _num(shares.get(p))
            cells.append(_esc(_fmt_s(p50.get(p))) + ("" if share is None else f" ({share:.0%})"))
        other = _num(ev.get("other_share"))
        cells += ["-" if other is None else f"{other:.0%}", f"<b>{_esc(a.get('verdict') or '-')}</b>",
                  _esc(", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("shares",)))]
        rows.append(cells)
    if not rows:
        return ""
    heads = ["rank", "step p50", *(f"{p} p50 (share)" for p in phases), "other", "verdict", "evidence"]
    return _table(heads, rows) + slow_rank_note(run)


def slow_rank_note(run: Run) -> str:
    """The job's one slow rank named across the ranks (``anatomy.slow_rank_across``), or nothing."""
    from hpar_agent.collectors.anatomy import slow_rank_across

    slow = slow_rank_across(
        (r, s.get("pp_stage"), (s.get("components") or {}).get("anatomy") or {}) for r, s in sorted(run.summaries.items())
    )
    if slow is None:
        return ""
    ev = ", ".join(f"{k}={v}" for k, v in slow.items() if k != "rank" and v is not None)
    return f"<p><b>One slow rank: rank {_esc(slow['rank'])}</b> ({_esc(ev)})</p>"


def render(run: Run, out_dir: Path, compare: Path | None = None) -> str:
    """The page as a string; ``out_dir`` is where it will live (evidence links are relative to it)."""
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs

    samples = collective_samples(run)
    coll_rows = collective_rows([{"rank": r, **s} for r, s in sorted(run.summaries.items())])
    figures: dict[str, Any] = {}
    sections: list[str] = [
        f"<h1>hpar-agent run report</h1>{_header(run)}",
        "" if run.trainer or run.trainer_steps else
        "<p class='meta'>A run of your own script (no trainer.json: losses are the training script's "
        "to log). Everything below is what the agent observed: step time, pipeline, collectives, "
        "torch.compile, memory and alerts.</p>",
        "<h2>Ranks</h2>",
        ranks_table(run),
    ]

    def section(title: str, fid: str, fig: go.Figure | None, extra: str = "", none: str = "no data") -> None:
        sections.append(f"<h2>{_esc(title)}</h2>")
        if fig is not None:
            figures[fid] = json.loads(fig.to_json())
            sections.append(f'<div id="{fid}" class="plot"></div>')
        else:
            sections.append(f'<p class="none">{_esc(none)}</p>')
        sections.append(extra)

    anatomy = anatomy_table(run)
    if anatomy:
        sections += ["<h2>Where the step time goes</h2>", anatomy]
    if compare is not None:
        from hpar_agent.tools.compare import html_table

        sections += [f"<h2>Compared with {_esc(compare.name)}</h2>", html_table(run.run_dir, compare)]
    alerts = [e for e in run.events if e.get("kind") == "alert"]
    sections.append("<h2>Alerts</h2>")
    sections.append(alerts_table(run, out_dir) if alerts else '<p class="none">no alerts fired</p>')
    section("Step time", "fig-steps", fig_step_times(run), none="no train.step spans (traces.rank*.jsonl)")
    pipe = fig_pipeline(run)
    if pipe is not None:
        section("Pipeline", "fig-pipeline", pipe)
    loss = fig_loss(run)
    if loss is not None:  # the reference trainer writes losses; a user's own script usually does not
        section("Loss", "fig-loss", loss)
    section("Memory", "fig-memory", fig_memory(run), memory_table(run) if run.summaries else "")
    mem_steps = fig_memory_steps(run)
    if mem_steps is not None:
        figures["fig-memory-steps"] = json.loads(mem_steps.to_json())
        sections.append('<div id="fig-memory-steps" class="plot"></div>')
    section(
        "Collectives", "fig-collectives", fig_collectives(samples),
        collectives_table(run, samples, coll_rows), none="no collective.* spans",
    )  # fmt: skip
    skew = fig_collective_ranks(coll_rows)
    if skew is not None:
        figures["fig-collective-ranks"] = json.loads(skew.to_json())
        sections.append('<div id="fig-collective-ranks" class="plot"></div>')
    compile_events = any(e.get("kind") in COMPILE_KINDS for e in run.events)
    section(
        "torch.compile", "fig-compile", fig_compile(run),
        compile_table(run) if compile_events else "", none="no compile events",
    )  # fmt: skip
    if run.problems:
        sections.append("<h2>Unreadable input</h2><ul>")
        sections += [f"<li>{_esc(p)}</li>" for p in run.problems]
        sections.append("</ul>")
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>hpar-agent report: {_esc(run.run_dir.name)}</title><style>{_CSS}</style>"
        f"<script>{get_plotlyjs()}</script></head>\n<body data-plots-expected='{len(figures)}'>\n{body}\n"
        f"<script type='application/json' id='hpar-figures'>{_script_json(figures)}</script>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def build_report(
    run_dir: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    compare: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the report (default ``RUN_DIR/report.html``) and return its path; raises on failure.
    ``compare``: another run directory shown side by side."""
    run_path = Path(run_dir)
    if not run_path.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_path}")
    out = Path(output) if output else run_path / "report.html"
    private_dir(str(out.parent), chosen=True)  # a missing one is created 0700
    if compare is not None and not Path(compare).is_dir():
        raise FileNotFoundError(f"run directory not found: {compare}")
    page = render(load_run(run_path), out.parent, Path(compare) if compare is not None else None)
    write_atomic(str(out), page.encode("utf-8"))  # 0600; a reader never sees half a page
    return out


def write_report(
    run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path | None:
    """``build_report`` for the end of the demo: logs and returns None instead of raising."""
    try:
        return build_report(run_dir, output)
    except ImportError as exc:
        log.warning("hpar_agent: no run report (%s); reinstall hpar-agent (plotly is a dependency)", exc)
    except Exception as exc:
        log.warning("hpar_agent: no run report for %s: %s: %s", run_dir, type(exc).__name__, exc)
    return None


#: Files that make a directory a run directory (the agent's and the trainer's outputs).
RUN_FILES = ("summary.rank*.json", "events.rank*.jsonl", "traces.rank*.jsonl", "trainer.json")


def main(run_dir: str, output: str | None = None, compare: str | None = None) -> int:
    """The ``hpar-agent report`` command: print where the page is; exit 2 (one line, nothing written)
    for a path that is not a run directory, 1 when the page cannot be written."""
    path = Path(run_dir)
    if not path.is_dir() or not any(next(path.glob(g), None) for g in RUN_FILES):
        what = "not found" if not path.exists() else "has no summary/events/traces/trainer files"
        print(f"hpar-agent report: error: {run_dir}: {what}", file=sys.stderr)
        return 2
    try:
        out = build_report(run_dir, output, compare)
    except ImportError as exc:
        print(f"hpar-agent report: {exc}; reinstall hpar-agent (plotly is a dependency)", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"hpar-agent report: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"report: {out}")
    return 0


__all__ = ["Run", "build_report", "load_run", "main", "render", "write_report"]
