"""``hpar-agent report RUN_DIR``: one self-contained HTML page of a run, for users without Prometheus
or Grafana, built only from the files the agent and trainer leave in the run directory.

Inputs are read by ``run_files``, the plots drawn by ``report_figures``; this module lays out the
tables and the page. Plots are plotly figures rendered by plotly.js embedded inline, so the page works
offline. Every text taken from the files is HTML-escaped: event fields (graph-break text, stacks) are
free text written by the process under observation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hpar_agent import catalogue as cat
from hpar_agent.safefiles import not_a_directory, private_dir, write_atomic
from hpar_agent.tools import goodput_view, units
from hpar_agent.tools.report_figures import (
    COMPILE_KINDS,
    brief,
    collective_samples,
    esc,
    fig_collective_ranks,
    fig_collectives,
    fig_compile,
    fig_loss,
    fig_memory,
    fig_memory_steps,
    fig_pipeline,
    fig_step_times,
    memory_series,
)
from hpar_agent.tools.run_files import Run, load_run, num
from hpar_agent.tools.summary import COLLECTIVE_PERCENTILE_SOURCE, collective_rows

log = logging.getLogger(__name__)

#: Rows shown in the compile-event table (the timeline plot shows all of them).
MAX_TABLE_ROWS = 500


# ------------------------------------------------------------------------------------------- tables
def _fmt_s(v: Any) -> str:
    return units.seconds(num(v))


def _fmt_value(v: Any) -> str:
    """A detector value: three significant digits for numbers, text as it came."""
    return "-" if v is None else units.value(v)


def _table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table of already-escaped cells."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _when(ts: Any) -> str:
    f = num(ts)
    return (
        time.strftime("%H:%M:%S", time.localtime(f)) + f".{int(f % 1 * 1000):03d}" if f is not None else "-"
    )


def ranks_table(run: Run) -> str:
    rows = []
    for rank in run.ranks:
        s = run.summaries.get(rank, {})
        comps = s.get("components") or {}
        steps = comps.get("steps") or {}
        bubble = num((comps.get("pipeline") or {}).get("bubble_ratio"))
        errors = sum(v for v in (s.get("errors") or {}).values() if isinstance(v, int))
        rows.append(
            [
                esc(rank),
                esc(s.get("pp_stage", "-")),
                esc(steps.get("steps", "-")),
                esc(_fmt_s(steps.get("step_seconds_p50"))),
                esc(_fmt_s(steps.get("step_seconds_max"))),
                "-" if bubble is None else f"{bubble:.2f}",
                esc(errors),
            ]
        )
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
        out.append(
            [
                esc(pg),
                esc(op),
                esc(row.get("count") or counts.get(key, "-")),
                esc(row.get("timed", "-")),
                esc(units.size(row["bytes"]) if row.get("bytes") else "-"),
                esc(_fmt_s(row.get("p50"))),
                esc(_fmt_s(row.get("p99"))),
                skew,
                esc(f"{bw / 1e9:.2f} GB/s" if bw else "-"),
                esc(len(samples.get((pg, op), ()))),
            ]
        )
    heads = [
        "pg",
        "op",
        "ops counted",
        "timed",
        "bytes",
        "p50",
        "p99",
        "p50 skew (max/min rank)",
        "busbw",
        "traced spans",
    ]
    return _table(heads, out) + f'<p class="meta">{esc(COLLECTIVE_PERCENTILE_SOURCE)}.</p>'


def memory_table(run: Run) -> str:
    rows = []
    for rank, s in sorted(run.summaries.items()):
        for name, v in sorted(memory_series(s).items()):
            rows.append([esc(rank), esc(name), esc(units.size(v))])
    return _table(["rank", "source", "bytes"], rows)


def compile_table(run: Run) -> str:
    events = [e for e in run.events if e.get("kind") in COMPILE_KINDS]
    rows = [
        [
            esc(_when(e.get("ts"))),
            esc(e.get("rank")),
            esc(e.get("kind")),
            f"<pre>{esc(brief(e))[:4000]}</pre>",
        ]
        for e in events[:MAX_TABLE_ROWS]
    ]
    more = f"<p>{len(events) - MAX_TABLE_ROWS} more not shown.</p>" if len(events) > MAX_TABLE_ROWS else ""
    return _table(["time", "rank", "kind", "details"], rows, "events") + more


def _evidence_link(path: Any, run_dir: Path, out_dir: Path) -> str:
    """A link to an evidence file relative to the page, so a copied run directory keeps working."""
    p = Path(str(path))
    target = p if p.is_absolute() else run_dir / p
    try:
        rel = os.path.relpath(target.resolve(), out_dir.resolve())
    except (OSError, ValueError):  # a NUL byte, a link loop: not a path to link
        return f'{esc(path)} <span class="missing">(not a usable path)</span>'
    exists = "" if target.exists() else ' <span class="missing">(missing)</span>'
    return f'<a href="{esc(quote(Path(rel).as_posix()))}">{esc(Path(rel).as_posix())}</a>{exists}'


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
        rows.append(
            [
                esc(_when(e.get("ts"))),
                esc(e.get("rank")),
                f"<b>{esc(e.get('alert', '?'))}</b>",
                f'<span class="state-{esc(state)}">{esc(state)}</span>',
                esc(_fmt_value(e.get("value"))),
                esc(_fmt_value(e.get("threshold"))),
                esc(e.get("step", "-")),
                f"<pre>{esc(json.dumps(units.rounded(details), default=str))[:2000]}</pre>"
                if details
                else "-",
                links,
            ]
        )
    headers = ["time", "rank", "alert", "state", "value", "threshold", "step", "details", "evidence"]
    return _table(headers, rows, "alerts")


def culprits_list(run: Run) -> str:
    """Who caused what went wrong (``tools.culprits``): the culprits the cross-rank alerts named, and the
    first rank to end abnormally (its state file); "" when nothing did."""
    from hpar_agent.tools.culprits import ending_lines, endings

    lines = ending_lines(endings(run.run_dir), run.events)
    return (
        '<ul class="culprits">' + "".join(f"<li>{esc(line.strip())}</li>" for line in lines) + "</ul>"
        if lines
        else ""
    )


def oom_table(run: Run, out_dir: Path) -> str:
    """Each ``oom`` event (``collectors.oom``): where the memory ran out, what was asked and free, what
    held it, and links to the allocator snapshot, the py-spy dump and the record."""
    rows = []
    for e in run.events:
        if e.get("kind") != "oom":
            continue
        kinds = {
            k: b
            for k, v in ((e.get("owners") or {}).get("bytes_by_kind") or {}).items()
            if (b := num(v)) is not None
        }
        held = ", ".join(f"{k} {units.size(b)}" for k, b in sorted(kinds.items(), key=lambda kv: -kv[1]))
        asked, free, limit = (
            num(e.get(k)) for k in ("requested_bytes", "device_free_bytes", "device_limit_bytes")
        )
        evidence = e.get("evidence")
        evidence = evidence if isinstance(evidence, list) else []
        rows.append(
            [
                esc(_when(e.get("ts"))),
                esc(e.get("rank")),
                esc(e.get("step", "-")),
                '<span class="state-firing">fatal</span>' if e.get("fatal") else "caught, went on",
                esc(e.get("site") or "-"),
                esc(
                    " ".join(
                        x
                        for x in (
                            f"asked {units.size(asked)}" if asked is not None else "",
                            f"free {units.size(free)}" if free is not None else "",
                            f"of {units.size(limit)}" if limit is not None else "",
                        )
                        if x
                    )
                    or "-"
                ),
                esc(held or "-"),
                f"<pre>{esc(str(e.get('message') or ''))[:2000]}</pre>",
                "<br>".join(_evidence_link(p, run.run_dir, out_dir) for p in evidence) or "-",
            ]
        )
    headers = ["time", "rank", "after steps", "outcome", "where", "request", "held by", "message", "evidence"]
    return _table(headers, rows, "ooms")


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
    facts = [f"job <b>{esc(job)}</b>", f"{len(run.ranks)} rank(s)"]
    if shape:
        facts.append(esc(shape))
    for key in ("world_size", "backend", "device", "torch_version", "agent_version"):
        if key in topo:
            facts.append(f"{esc(key)} {esc(topo[key])}")
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
        cells = [esc(rank), esc(_fmt_s(a.get("step_seconds_p50")))]
        for p in phases:
            share = num(shares.get(p))
            cells.append(esc(_fmt_s(p50.get(p))) + ("" if share is None else f" ({share:.0%})"))
        other = num(ev.get("other_share"))
        cells += [
            "-" if other is None else f"{other:.0%}",
            f"<b>{esc(a.get('verdict') or '-')}</b>",
            esc(", ".join(f"{k}={units.evidence(k, v)}" for k, v in ev.items() if k not in ("shares",))),
        ]
        rows.append(cells)
    if not rows:
        return ""
    heads = ["rank", "step p50", *(f"{p} p50 (share)" for p in phases), "other", "verdict", "evidence"]
    return _table(heads, rows) + slow_rank_note(run)


def slow_rank_note(run: Run) -> str:
    """The job's one slow rank named across the ranks (``verdict.slow_rank_across``), or nothing."""
    from hpar_agent.collectors.verdict import slow_rank_across

    slow = slow_rank_across(
        (r, s.get("pp_stage"), (s.get("components") or {}).get("anatomy") or {})
        for r, s in sorted(run.summaries.items())
    )
    if slow is None:
        return ""
    ev = ", ".join(f"{k}={units.evidence(k, v)}" for k, v in slow.items() if k != "rank" and v is not None)
    return f"<p><b>One slow rank: rank {esc(slow['rank'])}</b> ({esc(ev)})</p>"


def render(run: Run, out_dir: Path, compare: Path | None = None) -> str:
    """The page as a string; ``out_dir`` is where it will live (evidence links are relative to it)."""
    import plotly.graph_objects as go
    from plotly.offline import get_plotlyjs

    samples = collective_samples(run)
    coll_rows = collective_rows([{"rank": r, **s} for r, s in sorted(run.summaries.items())])
    figures: dict[str, Any] = {}
    sections: list[str] = [
        f"<h1>hpar-agent run report</h1>{_header(run)}",
        ""
        if run.trainer or run.trainer_steps
        else "<p class='meta'>A run of your own script (no trainer.json: losses are the training script's "
        "to log). Everything below is what the agent observed: step time, pipeline, collectives, "
        "torch.compile, memory and alerts.</p>",
        "<h2>Ranks</h2>",
        ranks_table(run),
    ]

    def section(title: str, fid: str, fig: go.Figure | None, extra: str = "", none: str = "no data") -> None:
        sections.append(f"<h2>{esc(title)}</h2>")
        if fig is not None:
            figures[fid] = json.loads(fig.to_json())
            sections.append(f'<div id="{fid}" class="plot"></div>')
        else:
            sections.append(f'<p class="none">{esc(none)}</p>')
        sections.append(extra)

    anatomy = anatomy_table(run)
    culprits = culprits_list(run)
    if culprits:
        sections += ["<h2>Culprits</h2>", culprits]
    gp_fig = goodput_view.figure(run.summaries)
    if gp_fig is not None:
        line = goodput_view.closing_line(run.summaries.values()) or ""
        section("Where the time went", "fig-goodput", gp_fig, f"<p>{esc(line)}</p>")
    if anatomy:
        sections += ["<h2>Where the step time goes</h2>", anatomy]
    if compare is not None:
        from hpar_agent.tools.compare import html_table

        sections += [
            f"<h2>Compared with the baseline {esc(compare.name)}</h2>",
            html_table(compare, run.run_dir),
        ]
    alerts = [e for e in run.events if e.get("kind") == "alert"]
    sections.append("<h2>Alerts</h2>")
    sections.append(alerts_table(run, out_dir) if alerts else '<p class="none">no alerts fired</p>')
    if any(e.get("kind") == "oom" for e in run.events):
        sections += ["<h2>Out of memory</h2>", oom_table(run, out_dir)]
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
        "Collectives",
        "fig-collectives",
        fig_collectives(samples),
        collectives_table(run, samples, coll_rows),
        none="no collective.* spans",
    )
    skew = fig_collective_ranks(coll_rows)
    if skew is not None:
        figures["fig-collective-ranks"] = json.loads(skew.to_json())
        sections.append('<div id="fig-collective-ranks" class="plot"></div>')
    compile_events = any(e.get("kind") in COMPILE_KINDS for e in run.events)
    section(
        "torch.compile",
        "fig-compile",
        fig_compile(run),
        compile_table(run) if compile_events else "",
        none="no compile events",
    )
    if run.problems:
        sections.append("<h2>Unreadable input</h2><ul>")
        sections += [f"<li>{esc(p)}</li>" for p in run.problems]
        sections.append("</ul>")
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>hpar-agent report: {esc(run.run_dir.name)}</title><style>{_CSS}</style>"
        f"<script>{get_plotlyjs()}</script></head>\n<body data-plots-expected='{len(figures)}'>\n{body}\n"
        f"<script type='application/json' id='hpar-figures'>{_script_json(figures)}</script>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def build_report(
    run_dir: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    compare: str | os.PathLike[str] | None = None,
    run: Run | None = None,
) -> Path:
    """Write the report (default ``RUN_DIR/report.html``) and return its path; raises on failure.
    ``compare``: a baseline run directory shown side by side; ``run``: the run, if already loaded."""
    run_path = Path(run_dir)
    if not run_path.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_path}")
    out = Path(output) if output else run_path / "report.html"
    if compare is not None and not Path(compare).is_dir():
        raise FileNotFoundError(f"run directory not found: {compare}")
    private_dir(str(out.parent), chosen=True)  # a missing one is created 0700
    page = render(run or load_run(run_path), out.parent, Path(compare) if compare is not None else None)
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
EXIT_CODES = {
    0: "the page was written (unreadable files are named on stderr and in the page)",
    2: "bad usage or input: not a run directory, nothing in it readable, or the page cannot be written",
    3: "error in the tool",
}
EPILOG = "exit status: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())


def _error(text: str) -> int:
    print(f"hpar-agent report: error: {text}", file=sys.stderr)
    return 2


def main(run_dir: str, output: str | None = None, compare: str | None = None) -> int:
    """The ``hpar-agent report`` command: print where the page is (exit status: ``EXIT_CODES``)."""
    path = Path(run_dir)
    for name, where in ((str(run_dir), path), (f"--compare {compare}", compare)):
        if where is not None and (why := not_a_directory(where)):
            return _error(f"{name}: {why}")
    if not any(next(path.glob(g), None) for g in RUN_FILES):
        return _error(f"{run_dir}: has no summary/events/traces/trainer files")
    try:
        run = load_run(path)
        for p in run.problems:
            print(f"hpar-agent report: warning: {p}", file=sys.stderr)
        if not (run.summaries or run.events or run.spans or run.trainer or run.trainer_steps):
            return _error(f"{run_dir}: none of its files could be read (see the warnings above)")
        out = build_report(run_dir, output, compare, run=run)
    except OSError as exc:
        return _error(f"cannot write the page: {exc}")
    except ImportError as exc:
        print(f"hpar-agent report: {exc}; reinstall hpar-agent (plotly is a dependency)", file=sys.stderr)
        return 3
    except Exception:
        traceback.print_exc()
        print(
            "hpar-agent report: internal error (exit 3); please report it with the traceback", file=sys.stderr
        )
        return 3
    print(f"report: {out}")
    return 0


__all__ = ["EXIT_CODES", "Run", "build_report", "load_run", "main", "render", "write_report"]
