"""``hpar-agent compare RUN_A RUN_B``: two runs side by side, and a regression gate for CI.

Reads only what the agent leaves in a run directory (``summary.rank<R>.json``, ``events.rank<R>.jsonl``,
and ``trainer.json`` when the reference trainer wrote one). Job-level figures take the slowest rank:
in synchronous training the job moves at its slowest rank's pace. Step and phase times are medians
after the agent's warm-up steps (compiles), so a compile-time change shows as compile time, not as
step time. Exit status: 0 when nothing checked regressed past ``--max-regression``, 1 when step time
(or a ``--phase`` named) did, 2 when a run directory holds no agent summaries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpar_agent.catalogue import STEP_PHASES
from hpar_agent.tools.summary import load_rank_summaries

#: rows checked against the threshold by default
DEFAULT_CHECKED = ("step",)


@dataclass
class Row:
    key: str  # what --phase names: step, data_wait, forward, ... (others are informational)
    label: str
    a: float | None
    b: float | None
    unit: str  # s | bytes | count
    lower_is_better: bool = True

    @property
    def change(self) -> float | None:
        """Relative change from A to B (0.12 = 12% more)."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / abs(self.a)


def _max(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(nums) if nums else None


def _alerts(run_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(run_dir.glob("events.rank*.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "alert" and rec.get("state") == "firing":
                out[str(rec.get("alert"))] = out.get(str(rec.get("alert")), 0) + 1
    return out


def digest(run_dir: Path) -> dict[str, Any]:
    """The job-level figures of one run (slowest rank for times, highest rank for memory)."""
    ranks = load_rank_summaries(run_dir)
    comps = [r.get("components", {}) for r in ranks]
    anat = [c.get("anatomy") or {} for c in comps]
    step = _max([a.get("step_seconds_p50") for a in anat]) or _max(
        [(c.get("steps") or {}).get("step_seconds_p50") for c in comps]
    )
    trainer: dict[str, Any] = {}
    tpath = run_dir / "trainer.json"
    if tpath.exists():
        try:
            trainer = json.loads(tpath.read_text())
        except (OSError, ValueError):
            trainer = {}
    times = trainer.get("step_times") or []
    collectives: dict[str, dict[str, float | None]] = {}
    for c in comps:
        for t in (c.get("collectives") or {}).get("table", []):
            key = f"{t.get('pg')}/{t.get('op')}"
            row = collectives.setdefault(key, {"count": 0.0, "p50_s": None})
            row["count"] = (row["count"] or 0.0) + float(t.get("count") or 0)
            row["p50_s"] = _max([row["p50_s"], t.get("p50_s")])
    memory = [
        (c.get("memory") or {}).get("rss_bytes") for c in comps
    ] + [v for c in comps for k, v in ((c.get("memory") or {}).get("allocator") or {}).items() if "peak" in k]
    return {
        "run_dir": str(run_dir),
        "ranks": len(ranks),
        "steps": _max([(c.get("steps") or {}).get("steps") for c in comps]),
        "step": step,
        "trainer_step": statistics.median(times[1:]) if len(times) > 1 else None,
        "phases": {p: _max([(a.get("phase_seconds_p50") or {}).get(p) for a in anat]) for p in STEP_PHASES},
        "verdicts": {r.get("rank"): (a.get("verdict"), a.get("evidence") or {}) for r, a in zip(ranks, anat, strict=True)},
        "collectives": collectives,
        "memory_peak": _max(memory),
        "compile": _max([(c.get("compile") or {}).get("compile_seconds_total") for c in comps]),
        "alerts": _alerts(run_dir),
        "final_loss": next((v for v in reversed(trainer.get("losses") or []) if v is not None), None),
    }


def rows(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    out = [Row("step", "step time p50 (slowest rank)", a["step"], b["step"], "s")]
    if a["trainer_step"] is not None or b["trainer_step"] is not None:
        out.append(Row("trainer_step", "trainer step time median (rank 0)", a["trainer_step"], b["trainer_step"], "s"))
    for p in STEP_PHASES:
        if a["phases"].get(p) is not None or b["phases"].get(p) is not None:
            out.append(Row(p, f"  {p} p50 (slowest rank)", a["phases"].get(p), b["phases"].get(p), "s"))
    for key in sorted(set(a["collectives"]) | set(b["collectives"])):
        ca, cb = a["collectives"].get(key, {}), b["collectives"].get(key, {})
        out.append(Row(f"collective:{key}", f"collectives {key} count", ca.get("count"), cb.get("count"), "count"))
        if ca.get("p50_s") is not None or cb.get("p50_s") is not None:
            out.append(Row(f"collective_p50:{key}", f"collectives {key} p50", ca.get("p50_s"), cb.get("p50_s"), "s"))
    out.append(Row("memory_peak", "memory peak (RSS / allocator, highest rank)", a["memory_peak"], b["memory_peak"], "bytes"))
    out.append(Row("compile", "compile time (slowest rank)", a["compile"], b["compile"], "s"))
    for name in sorted(set(a["alerts"]) | set(b["alerts"])):
        out.append(Row(f"alert:{name}", f"alert {name} fired", a["alerts"].get(name, 0), b["alerts"].get(name, 0), "count"))
    if a["final_loss"] is not None or b["final_loss"] is not None:
        out.append(Row("loss", "final loss", a["final_loss"], b["final_loss"], ""))
    return out


def regressions(table: list[Row], checked: tuple[str, ...], max_regression: float) -> list[Row]:
    """Checked rows that grew by more than ``max_regression`` (a missing figure is not a pass)."""
    bad = []
    for key in checked:
        row = next((r for r in table if r.key == key), None)
        if row is None or row.change is None or row.change > max_regression:
            bad.append(row or Row(key, key, None, None, "s"))
    return bad


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "bytes":
        return f"{v / 2**20:.0f} MiB"
    if unit == "count":
        return f"{v:.0f}"
    return f"{v:.4g}"


def _fmt_change(r: Row) -> str:
    c = r.change
    if c is None:
        return "new" if not r.a and r.b else "-"
    return f"{c:+.1%}"


def render_text(a: dict[str, Any], b: dict[str, Any], table: list[Row], bad: list[Row], checked: tuple[str, ...],
                max_regression: float) -> str:
    lines = [f"A: {a['run_dir']} ({a['ranks']} ranks, {a['steps'] or 0:.0f} steps)",
             f"B: {b['run_dir']} ({b['ranks']} ranks, {b['steps'] or 0:.0f} steps)", ""]
    cells = [["", "A", "B", "change"]] + [
        [r.label + (" *" if r.key in checked else ""), _fmt(r.a, r.unit), _fmt(r.b, r.unit), _fmt_change(r)] for r in table
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines += ["  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i]) for i in range(4)) for c in cells]
    lines.append("")
    for name, d in (("A", a), ("B", b)):
        verdicts = ", ".join(f"rank {r}: {v or '-'}" for r, (v, _ev) in sorted(d["verdicts"].items(), key=lambda kv: kv[0]))
        lines.append(f"bottleneck {name}: {verdicts or '-'}")
    lines.append("")
    if bad:
        for r in bad:
            what = "missing" if r.change is None else f"{r.change:+.1%}"
            lines.append(f"REGRESSION: {r.label.strip()} {what} (limit +{max_regression:.1%})")
    else:
        lines.append(f"ok: {', '.join(checked)} within +{max_regression:.1%}")
    return "\n".join(lines)


def html_table(a_dir: Path, b_dir: Path) -> str:
    """The side-by-side table for ``hpar-agent report RUN_A --compare RUN_B`` (escaped cells)."""
    import html

    a, b = digest(a_dir), digest(b_dir)
    body = "".join(
        f"<tr><td>{html.escape(r.label)}</td><td>{html.escape(_fmt(r.a, r.unit))}</td>"
        f"<td>{html.escape(_fmt(r.b, r.unit))}</td><td>{html.escape(_fmt_change(r))}</td></tr>"
        for r in rows(a, b)
    )
    head = f"<th></th><th>this run</th><th>{html.escape(b_dir.name)}</th><th>change</th>"
    return f'<table class="compare"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def parse_threshold(text: str) -> float:
    """``5%`` or ``0.05``: a relative change."""
    text = text.strip()
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if value < 0:
        raise ValueError("the threshold must be >= 0")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="the baseline run directory")
    p.add_argument("run_b", metavar="RUN_B", help="the run directory checked against it")
    p.add_argument("--max-regression", default="5%", help="allowed growth of step time and --phase (default 5%%)")
    p.add_argument("--phase", action="append", choices=STEP_PHASES, default=[],
                   help="also fail when this phase regressed (repeatable)")


def run(args: argparse.Namespace) -> int:
    try:
        limit = parse_threshold(args.max_regression)
    except ValueError as exc:
        print(f"hpar-agent compare: bad --max-regression {args.max_regression!r}: {exc}", file=sys.stderr)
        return 2
    dirs = [Path(args.run_a), Path(args.run_b)]
    for d in dirs:
        if not any(d.glob("summary.rank*.json")):
            print(f"hpar-agent compare: no summary.rank<R>.json in {d}", file=sys.stderr)
            return 2
    a, b = digest(dirs[0]), digest(dirs[1])
    checked = (*DEFAULT_CHECKED, *args.phase)
    table = rows(a, b)
    bad = regressions(table, checked, limit)
    print(render_text(a, b, table, bad, checked, limit))
    return 1 if bad else 0


__all__ = ["Row", "digest", "html_table", "parse_threshold", "regressions", "rows", "run"]
