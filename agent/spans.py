"""Span records: what components hand the tracing exporter, built on the agent thread from timestamps
the hooks recorded (so no OTel call ever runs on the training thread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpanRecord:
    name: str
    start_ns: int  # epoch nanoseconds
    end_ns: int
    step: int  # the training step the span belongs to (its trace)
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)  # (name, epoch ns, attrs)
    anomalous: bool = False  # forces the step's trace to be kept


@dataclass(slots=True)
class StepRecord:
    """One completed step on this rank, with the spans of its children."""

    step: int
    start_ns: int
    end_ns: int
    children: list[SpanRecord] = field(default_factory=list)
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)
    anomalous: bool = False
    attributes: dict[str, Any] = field(default_factory=dict)  # extra train.step attributes

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9
