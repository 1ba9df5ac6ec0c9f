"""A run directory as the report reads it: the files the agent and the trainer leave there.

``events.rank<R>.jsonl``, ``summary.rank<R>.json``, ``traces.rank<R>.jsonl`` (OTLP/JSON, one
ExportTraceServiceRequest per line), ``trainer.rank<R>.json`` and ``trainer.json``, all optional and
read defensively (their shapes evolve, and a killed process leaves a torn last line): regular files
only, bounded and strict JSON (``safe_read``), summaries checked against their schema
(``summary_schema``). What cannot be read is listed in ``Run.problems`` with the file's name, never
raised.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpar_agent import catalogue as cat
from hpar_agent.tools.safe_read import JSONL_LIMIT, Budget, Unreadable, read_json, read_jsonl
from hpar_agent.tools.summary_schema import SUMMARY, TRAINER, clean

_RANK_RE = re.compile(r"\.rank(\d+)\.")


def num(v: Any) -> float | None:
    """A finite number as a float; None for anything else (bools, text, NaN, an int past a float)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


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


def rank_files(run_dir: Path, prefix: str, ext: str) -> list[tuple[int, Path]]:
    out = [(r, p) for p in run_dir.glob(f"{prefix}.rank*.{ext}") if (r := _rank_of(p)) is not None]
    return sorted(out)


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
    return {a["key"]: _any_value(a.get("value")) for a in _dicts(items) if isinstance(a.get("key"), str)}


def _dicts(items: Any) -> list[dict[str, Any]]:
    """The objects of a JSON array (anything else in it, or a non-array, is left out)."""
    return [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []


def _spans_of(request: dict[str, Any], file_rank: int | None) -> Iterator[Span]:
    for rs in _dicts(request.get("resourceSpans")):
        res = rs.get("resource")
        res_rank = _attrs(res.get("attributes") if isinstance(res, dict) else None).get(
            cat.ATTR_RANK, file_rank
        )
        for ss in _dicts(rs.get("scopeSpans")):
            for sp in _dicts(ss.get("spans")):
                try:
                    start, end = int(sp["startTimeUnixNano"]), int(sp["endTimeUnixNano"])
                except (KeyError, TypeError, ValueError):
                    continue
                attrs = _attrs(sp.get("attributes"))
                rank = attrs.get(cat.ATTR_RANK, res_rank)
                yield Span(
                    str(sp.get("name", "")), rank if isinstance(rank, int) else None, start, end, attrs
                )


def read_doc(path: Path, schema: dict[str, Any], problems: list[str], budget: Budget | None = None) -> Any:
    """A JSON file cleaned against ``schema``, or None; every problem is noted with the file's name."""
    try:
        doc = read_json(path, budget=budget)
        notes = clean(doc, schema)
    except (Unreadable, ValueError) as exc:
        problems.append(f"{path.name}: {exc}")
        return None
    problems += [f"{path.name}: {n}" for n in notes]
    return doc


def read_summaries(
    run_dir: Path, problems: list[str], budget: Budget | None = None
) -> dict[int, dict[str, Any]]:
    """Every readable ``summary.rank<R>.json`` by the rank in its name (which its ``rank`` field is set to)."""
    out = {}
    for rank, path in rank_files(run_dir, "summary", "json"):
        doc = read_doc(path, SUMMARY, problems, budget)
        if doc is not None:
            doc["rank"] = rank
            out[rank] = doc
    return out


def iter_events(run_dir: Path, problems: list[str], budget: Budget | None = None) -> Iterator[dict[str, Any]]:
    """Every rank's events, file by file as read (a stream: an event log can be hundreds of MiB);
    ``rank`` is the one in the file's name."""
    for rank, path in rank_files(run_dir, "events", "jsonl"):
        for rec in read_jsonl(path, problems, JSONL_LIMIT, budget):
            rec["rank"] = rank
            yield rec


def read_events(run_dir: Path, problems: list[str], budget: Budget | None = None) -> list[dict[str, Any]]:
    """Every rank's events in time order; ``rank`` is the one in the file's name."""
    events = list(iter_events(run_dir, problems, budget))
    events.sort(key=lambda e: num(e.get("ts")) or 0.0)
    return events


def iter_spans(run_dir: Path, problems: list[str], budget: Budget | None = None) -> Iterator[Span]:
    """Every rank's spans, as read (a stream)."""
    for rank, path in rank_files(run_dir, "traces", "jsonl"):
        for req in read_jsonl(path, problems, JSONL_LIMIT, budget):
            yield from _spans_of(req, rank)


def read_spans(run_dir: Path, problems: list[str], budget: Budget | None = None) -> list[Span]:
    return list(iter_spans(run_dir, problems, budget))


def load_run(run_dir: str | os.PathLike[str], budget: Budget | None = None) -> Run:
    """Parse every file of the run that exists; missing or broken files only leave gaps."""
    run = Run(Path(run_dir))
    budget = budget or Budget()
    run.summaries = read_summaries(run.run_dir, run.problems, budget)
    run.events = read_events(run.run_dir, run.problems, budget)
    run.spans = read_spans(run.run_dir, run.problems, budget)
    for rank, path in rank_files(run.run_dir, "trainer", "json"):
        try:
            doc = read_json(path, budget=budget)
        except Unreadable as exc:
            run.problems.append(f"{path.name}: {exc}")
            continue
        steps = doc.get("steps") if isinstance(doc, dict) else None
        if isinstance(steps, list):
            run.trainer_steps[rank] = [
                r for r in steps if isinstance(r, dict) and isinstance(r.get("step"), int)
            ]
    trainer = run.run_dir / "trainer.json"
    if os.path.lexists(trainer):
        run.trainer = read_doc(trainer, TRAINER, run.problems, budget) or {}
    return run
