"""Span records: what components hand the tracing exporter, built on the agent thread from timestamps
the hooks recorded (so no OTel call ever runs on the training thread)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(slots=True)
class SpanRecord:
    name: str
    start_ns: int  # epoch nanoseconds
    end_ns: int
    step: int  # the training step the span belongs to (its trace)
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, epoch ns, attrs)
    anomalous: bool = False  # forces the step's trace to be kept


class LazySpan(NamedTuple):
    """A child span made only when its step's trace is kept. Most steps' traces are not (one in
    ``trace_every``), and a source with tens of spans a step (every collective) built a record and
    an attribute dict for each: hand over the raw fields and the function that makes the record."""

    step: int
    build: Callable[[Any], SpanRecord]
    args: Any
    anomalous: bool = False


Child = SpanRecord | LazySpan


def realize(child: Child) -> SpanRecord:
    """The record of a child span, built now when it is lazy."""
    return child.build(child.args) if isinstance(child, LazySpan) else child


@dataclass(slots=True)
class StepRecord:
    """One completed step on this rank, with the spans of its children."""

    step: int
    start_ns: int
    end_ns: int
    children: list[Child] = field(default_factory=list)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    anomalous: bool = False
    attributes: dict[str, Any] = field(default_factory=dict)  # extra train.step attributes
    detailed: bool = True  # the hooks recorded its per-step detail (``StepCollector.stride``)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9
