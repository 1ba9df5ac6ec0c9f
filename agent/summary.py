"""The end-of-run summary the demo prints, from the per-rank ``summary.rank<R>.json`` files."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def load_rank_summaries(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(run_dir.glob("summary.rank*.json"), key=lambda p: int(p.stem.split("rank")[-1])):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells[1:]]
    return lines


def render_summary(
    trainer: dict[str, Any], ranks: list[dict[str, Any]], run_dir: Path, wall: float, rc: int
) -> str:
    lines = ["", "=== hpar-agent demo summary ==="]
    losses = [v for v in trainer.get("losses", []) if v is not None]
    if losses:
        lines.append(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps")
    times = trainer.get("step_times") or []
    if len(times) > 1:
        lines.append(f"step time (rank 0, after step 0): median {_fmt_s(statistics.median(times[1:]))}")
    lines.append(f"trainer exit code {rc}; wall time {wall:.1f} s")
    if ranks:
        lines.append("")
        lines.append("ranks:")
        rows = []
        for r in ranks:
            comps = r.get("components", {})
            steps = comps.get("steps", {})
            pipe = comps.get("pipeline", {})
            bubble = pipe.get("bubble_ratio")
            rows.append([
                r.get("rank"), r.get("pp_stage"), steps.get("steps", 0), _fmt_s(steps.get("step_seconds_p50")),
                "-" if bubble is None else f"{bubble:.2f}", sum(r.get("errors", {}).values()),
                r.get("metrics_url") or "-",
            ])  # fmt: skip
        lines += _table(["rank", "stage", "steps", "step p50", "bubble", "agent errors", "metrics"], rows)
    for section in _component_sections(ranks):
        lines += ["", *section]
    lines += ["", f"outputs: {run_dir}", "  events.rank<R>.jsonl (event log), summary.rank<R>.json, trainer.json"]
    return "\n".join(lines)


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
            lines.append(f"  rank {r.get('rank')}: {json.dumps(digest, default=str)[:300]}")
    return lines if len(lines) > 1 else []


RENDERERS: dict[str, Any] = {}
