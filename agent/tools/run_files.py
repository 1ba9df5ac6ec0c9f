"""A run directory as the report reads it: the files the agent and the trainer leave there.

``events.rank<R>.jsonl``, ``summary.rank<R>.json``, ``traces.rank<R>.jsonl`` (OTLP/JSON, one
ExportTraceServiceRequest per line), ``trainer.rank<R>.json`` and ``trainer.json``, all optional and
read defensively (their shapes evolve, and a killed process leaves a torn last line): what cannot be
read is listed in ``Run.problems``, never raised.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpar_agent import catalogue as cat

_RANK_RE = re.compile(r"\.rank(\d+)\.")


def num(v: Any) -> float | None:
    """A finite number as a float; None for anything else (bools, text, NaN)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


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
    run.events.sort(key=lambda e: num(e.get("ts")) or 0.0)
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
