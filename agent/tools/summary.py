"""The end-of-run summary the demo prints, from the per-rank ``summary.rank<R>.json`` files."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hpar_agent.tools import goodput_view, units
from hpar_agent.tools.run_files import read_summaries


def load_rank_summaries(run_dir: Path, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """The readable summaries in rank order; what cannot be read goes to ``problems`` (named)."""
    found = read_summaries(run_dir, [] if problems is None else problems)
    return [found[r] for r in sorted(found)]


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return lines


def _steps(rank: dict[str, Any]) -> int:
    return int(rank.get("components", {}).get("steps", {}).get("steps", 0) or 0)


def never_stepped(trainer: dict[str, Any], ranks: list[dict[str, Any]]) -> bool:
    """No rank finished a step: nothing to plot, and no detector had anything to judge."""
    return not any(v is not None for v in trainer.get("losses", [])) and not any(_steps(r) for r in ranks)


def _span(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def render_summary(
    trainer: dict[str, Any],
    ranks: list[dict[str, Any]],
    run_dir: Path,
    wall: float,
    rc: int,
    *,
    nproc: int | None = None,
    failures: dict[int, str] | None = None,
    torchrun_tail: list[str] | None = None,
    exit_codes: dict[int, int] | None = None,
) -> str:
    """The summary; with ``nproc`` it names the ranks that wrote no summary, with ``failures``
    (``{rank: first error line}``) the failed ranks, and claims nothing for ranks it has not heard from."""
    lines = ["", "=== hpar-agent demo summary ==="]
    losses = [v for v in trainer.get("losses", []) if v is not None]
    if losses:
        lines.append(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps")
    times = trainer.get("step_times") or []
    if len(times) > 1:
        lines.append(
            f"step time (rank 0, after step 0): median {units.seconds(statistics.median(times[1:]))}"
        )
    lines.append(f"trainer exit code {rc}; wall time {wall:.1f} s")
    codes = exit_codes or {}
    failed = sorted({*(failures or {}), *(r for r, c in codes.items() if c > 0)})
    if failed:
        lines.append(f"FAILED ranks: {_span(failed)}")
        for rank in failed:
            code = f" (exit {codes[rank]})" if rank in codes else ""
            lines.append(f"  rank {rank}{code}: {(failures or {}).get(rank, 'no error line in its stderr')}")
        stopped = sorted(r for r, c in codes.items() if c < 0 and r not in failed)
        if stopped:
            lines.append(f"stopped by torchrun after the failure: ranks {_span(stopped)}")
    elif rc:
        last = [t for t in (torchrun_tail or []) if t.strip()][-1:]
        lines.append("FAILED: no rank logged an error" + (f"; torchrun: {last[0][:200]}" if last else ""))
    if rc:
        lines.append(f"  rank logs: {run_dir / 'logs'} (torchrun.log, <run>/attempt_0/<rank>/stderr.log)")
    present = [r.get("rank") for r in ranks]
    missing = [r for r in range(nproc or 0) if r not in present]
    if missing:
        lines.append(f"no summary from ranks: {_span(missing)} (they ended before the agent wrote one)")
    stepped = not never_stepped(trainer, ranks)
    if not stepped:
        lines.append("the run never stepped: no step, alert or report to show")
    if ranks:
        lines.append("")
        lines.append("ranks:")
        rows = []
        for r in ranks:
            comps = r.get("components", {})
            steps = comps.get("steps", {})
            pipe = comps.get("pipeline", {})
            bubble = pipe.get("bubble_ratio")
            rows.append(
                [
                    r.get("rank"),
                    r.get("pp_stage"),
                    steps.get("steps", 0),
                    units.seconds(steps.get("step_seconds_p50")),
                    "-" if bubble is None else f"{bubble:.2f}",
                    sum(r.get("errors", {}).values()),
                    r.get("metrics_url") or "-",
                ]
            )
        lines += _table(["rank", "stage", "steps", "step p50", "bubble", "agent errors", "metrics"], rows)
    stage_rows = _stage_rows(ranks)
    if stage_rows:
        lines += ["", "pipeline stages (chunk time p50, slowest rank of the stage):"]
        lines += _table(["stage", "ranks", "forward p50", "backward p50"], stage_rows)
    for section in _component_sections(ranks):
        if section[0].startswith("alerts: none fired") and (missing or not stepped):
            if not stepped:
                continue  # detectors that never saw a step have nothing to say
            section = [
                f"alerts: none fired on ranks {_span([p for p in present if p is not None])}; "
                f"ranks {_span(missing)} wrote no summary"
            ]
        lines += ["", *section]
    lines += ["", f"outputs: {run_dir}", f"  {_outputs(run_dir)}"]
    return "\n".join(lines)


#: What a run directory may hold, as the summary names it.
OUTPUTS = [
    ("events.rank*.jsonl", "events.rank<R>.jsonl (event log)"),
    ("summary.rank*.json", "summary.rank<R>.json"),
    ("traces.rank*.jsonl", "traces.rank<R>.jsonl (OTLP/JSON spans)"),
    ("trainer.json", "trainer.json"),
    ("logs", "logs/ (torchrun and rank logs)"),
]


def _outputs(run_dir: Path) -> str:
    """The outputs that exist (a crashed run must not point at files it never wrote)."""
    found = []
    for pattern, label in OUTPUTS:
        n = len(list(run_dir.glob(pattern)))
        if n:
            found.append(f"{label} x{n}" if "<R>" in label else label)
    return ", ".join(found) or "nothing was written"


def _stage_rows(ranks: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per pipeline stage (virtual stages too) from ``components.pipeline.chunk_seconds_p50``."""
    stages: dict[int, dict[str, list[float]]] = {}
    members: dict[int, list[Any]] = {}
    for r in ranks:
        p50 = (r.get("components", {}).get("pipeline") or {}).get("chunk_seconds_p50") or {}
        for key, secs in p50.items():
            stage, _, phase = str(key).partition("/")
            try:
                index = int(stage)
            except ValueError:
                continue
            stages.setdefault(index, {}).setdefault(phase, []).append(secs)
            if r.get("rank") not in members.setdefault(index, []):
                members[index].append(r.get("rank"))
    return [
        [
            index,
            ",".join(map(str, members[index])),
            *(units.seconds(max(phases[p])) if phases.get(p) else "-" for p in ("forward", "backward")),
        ]
        for index, phases in sorted(stages.items())
    ]


def _component_sections(ranks: list[dict[str, Any]]) -> list[list[str]]:
    """Sections for components beyond steps/pipeline, rendered by the renderer registered for them."""
    sections = []
    names: list[str] = []
    for r in ranks:
        for name in r.get("components", {}):
            if name not in names and name not in ("steps", "pipeline"):
                names.append(name)
    for name in names:
        render = RENDERERS.get(name, _render_generic)
        body = render(name, ranks)
        if body:
            sections.append(body)
    return sections


def _render_generic(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    lines = [f"{name}:"]
    for r in ranks:
        digest = r.get("components", {}).get(name)
        if digest:
            lines.append(f"  rank {r.get('rank')}: {json.dumps(units.rounded(digest), default=str)[:300]}")
    return lines if len(lines) > 1 else []


def _render_compile(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    """Per pipeline stage: graphs, breaks with reasons and user frames, recompiles, compile time."""
    by_stage: dict[Any, list[dict[str, Any]]] = {}
    for r in ranks:
        if r.get("components", {}).get(name):
            by_stage.setdefault(r.get("pp_stage"), []).append(r)
    if not by_stage:
        return []
    lines = ["torch.compile per stage:"]
    for stage, members in sorted(by_stage.items()):
        digests = [m["components"][name] for m in members]
        graphs = sorted({d.get("graphs", 0) for d in digests})
        secs = max(d.get("compile_seconds_total", 0.0) for d in digests)
        recompiles = sum(rc["count"] for d in digests for rc in d.get("recompiles", []))
        fingerprints = {d.get("fingerprint") for d in digests}
        lines.append(
            f"  stage {stage}: graphs {'/'.join(map(str, graphs))}, compile time up to {secs:.1f} s, "
            f"recompiles {recompiles} (all ranks), fingerprints {'equal' if len(fingerprints) == 1 else 'DIFFER'}"
        )
        breaks: dict[str, dict[str, Any]] = {}
        for d in digests:
            for b in d.get("graph_breaks", []):
                entry = breaks.setdefault(
                    b["reason"], {"count": 0, "frames": set(), "message": b.get("message", "")}
                )
                entry["count"] += b.get("count", 0)
                entry["frames"].update(b.get("user_frames", []))
        for key, b in sorted(breaks.items()):
            frames = ", ".join(sorted(b["frames"])[:3]) or "-"
            lines.append(f"    graph break {key} x{b['count']}: {str(b['message'])[:90]} at {frames}")
        reasons: dict[str, int] = {}
        for d in digests:
            for rc in d.get("recompiles", []):
                reasons[rc["reason"]] = reasons.get(rc["reason"], 0) + rc["count"]
        for key, n in sorted(reasons.items()):
            lines.append(f"    recompile ({key}) x{n}")
    return lines


#: Where the collective percentiles come from, said the same way by the terminal summary and the report.
COLLECTIVE_PERCENTILE_SOURCE = (
    "p50/p99: upper bound of the agent's latency-histogram bucket over every timed op "
    "(what histogram_quantile gives in Prometheus), worst rank"
)


def collective_rows(ranks: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(pg, op) -> count, timed, bytes, p50/p99 (worst rank), busbw (best rank) and the per-rank p50s.

    The one source of collective percentiles: the terminal summary and the report both print these
    (the report's span box plots only show the traced steps' samples)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in ranks:
        for t in r.get("components", {}).get("collectives", {}).get("table", []):
            row = rows.setdefault(
                (str(t["pg"]), str(t["op"])),
                {"count": 0, "timed": 0, "bytes": 0, "p50": None, "p99": None, "busbw": None, "rank_p50": {}},
            )
            row["count"] += int(t.get("count") or 0)
            row["timed"] += int(t.get("timed") or 0)
            row["bytes"] += int(t.get("bytes") or 0)
            for key, src, pick in (
                ("p50", "p50_s", max),
                ("p99", "p99_s", max),
                ("busbw", "busbw_bytes_per_s", max),
            ):
                v = t.get(src)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    row[key] = v if row[key] is None else pick(row[key], v)
            if isinstance(t.get("p50_s"), int | float) and isinstance(r.get("rank"), int):
                row["rank_p50"][r["rank"]] = t["p50_s"]
    return dict(sorted(rows.items()))


def _render_collectives(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    rows = collective_rows(ranks)
    if not rows:
        return []
    table = []
    for (pg, op), row in rows.items():
        bw = row["busbw"]
        table.append(
            [
                pg,
                op,
                row["count"],
                row["timed"],
                units.seconds(row["p50"]),
                units.seconds(row["p99"]),
                f"{bw / 1e9:.2f} GB/s" if bw else "-",
            ]
        )
    return [
        f"collectives (all ranks; {COLLECTIVE_PERCENTILE_SOURCE}):",
        *_table(["pg", "op", "count", "timed", "p50", "p99", "busbw"], table),
    ]


def _render_detectors(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    fired = []
    for r in ranks:
        for alert, st in r.get("components", {}).get(name, {}).items():
            if st.get("fired"):
                evidence = ", ".join(Path(e).name for e in st.get("evidence", [])) or "-"
                fired.append(
                    [
                        alert,
                        r.get("rank"),
                        r.get("pp_stage"),
                        st.get("fired"),
                        st.get("last_fired_step"),
                        evidence,
                    ]
                )
    if not fired:
        n = len({a for r in ranks for a in r.get("components", {}).get(name, {})})
        return [f"alerts: none fired ({n} detectors ran on every rank)"] if n else []
    return ["alerts:", *_table(["alert", "rank", "stage", "times", "step", "evidence"], fired)]


def _render_memory(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in ranks:
        d = r.get("components", {}).get(name, {})
        last = d.get("post_step_last", {})
        if last:
            rows.append(
                [
                    r.get("rank"),
                    *(units.size(last[k]) if k in last else "-" for k in ("rss", "allocator", "nvml")),
                ]
            )
    return (
        ["memory after the last step:", *_table(["rank", "rss", "allocator", "nvml"], rows)] if rows else []
    )


def _render_anatomy(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    """Where the step time goes per rank (phase medians and shares) and the bottleneck verdict."""
    from hpar_agent.catalogue import STEP_PHASES

    rows, clock = [], "cpu"
    digests = [r.get("components", {}).get(name) or {} for r in ranks]
    phases = [p for p in STEP_PHASES if any(p in (d.get("phase_seconds_p50") or {}) for d in digests)]
    for r in ranks:
        a = r.get("components", {}).get(name) or {}
        if not a.get("verdict"):
            continue
        clock = a.get("clock", clock)
        p50 = a.get("phase_seconds_p50") or {}
        ev = a.get("evidence") or {}
        shares = ev.get("shares") or {}
        cells = [r.get("rank"), units.seconds(a.get("step_seconds_p50"))]
        cells += [f"{units.seconds(p50[p])} {shares.get(p, 0):.0%}" if p in p50 else "-" for p in phases]
        cells += [f"{ev.get('other_share', 0):.0%}", a["verdict"]]
        rows.append(cells)
    if not rows:
        return []
    note = " (GPU stream time, from CUDA events)" if clock == "cuda-events" else ""
    lines = [
        f"where the step time goes (p50 and share of step time, after warm-up){note}:",
        *_table(["rank", "step p50", *phases, "other", "bottleneck"], rows),
    ]
    lines += _slow_rank_line(ranks, name)
    held = _holding(ranks, name)
    if held and len(held) < len(rows):
        lines.append(f"  rank {', '.join(held)} holds the others back: they wait for it inside collectives")
    for r in ranks:
        a = r.get("components", {}).get(name) or {}
        if a.get("verdict") == "unknown":
            lines.append(f"  rank {r.get('rank')}: unknown: {(a.get('evidence') or {}).get('reason', '')}")
    return lines


def _slow_rank_line(ranks: list[dict[str, Any]], name: str = "anatomy") -> list[str]:
    """The job's one slow rank, named across the ranks' summaries (``verdict.slow_rank_across``)."""
    from hpar_agent.collectors.verdict import slow_rank_across

    slow = slow_rank_across(
        (r.get("rank"), r.get("pp_stage"), r.get("components", {}).get(name) or {}) for r in ranks
    )
    if slow is None:
        return []
    ev = ", ".join(f"{k}={units.evidence(k, v)}" for k, v in slow.items() if k != "rank" and v is not None)
    return [f"  one slow rank: rank {slow['rank']} ({ev})"]


def _render_goodput(name: str, ranks: list[dict[str, Any]]) -> list[str]:
    """Each rank's share of its wall time that trained, and the largest causes of the rest."""
    lines = [f"{name}:"]
    for r in ranks:
        line = goodput_view.closing_line([r])
        if line:
            lines.append(f"  rank {r.get('rank')}: {line}")
    return lines if len(lines) > 1 else []


RENDERERS: dict[str, Any] = {
    "anatomy": _render_anatomy,
    "compile": _render_compile,
    "collectives": _render_collectives,
    "detectors": _render_detectors,
    "memory": _render_memory,
    "goodput": _render_goodput,
    "nvml": lambda _name, _ranks: [],
}


def _holding(ranks: list[dict[str, Any]], name: str) -> list[str]:
    """The ranks that hold the others back: those bound by their own input or host work, and the slow
    rank a slow-rank or waits-for-slow-rank verdict names (a rank waiting for it is a victim, not named)."""
    out: set[int] = set()
    for r in ranks:
        a = r.get("components", {}).get(name) or {}
        verdict, ev = a.get("verdict"), a.get("evidence") or {}
        if verdict in ("input-bound", "host-bound"):
            out.add(int(r.get("rank", -1)))
        elif verdict in ("slow-rank", "waits-for-slow-rank"):
            slow = ev.get("slow_rank")
            out.add(int(slow) if isinstance(slow, int) else int(r.get("rank", -1)))
    return [str(r) for r in sorted(out)]
