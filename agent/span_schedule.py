"""When a completed step's trace is complete enough to export.

A step's child spans can arrive after the step itself: collective spans come from periodic
flight-recorder reads, compile spans wait for their metrics. So a completed step waits until every span
source's watermark (``Component.span_watermark_ns``: the time before which it has delivered every span)
has passed the step's end, ``SPAN_WAIT_NS`` at the latest, and at most ``MAX_UNEXPORTED`` steps wait (a
fast loop must not queue without bound). The final tick hands over every step. Agent thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from hpar_agent.spans import Child, StepRecord

#: A completed step's trace waits at most this long for late child spans (FR reads are periodic).
SPAN_WAIT_NS = 30 * 10**9
#: ... and at most this many steps wait (a fast loop must not queue without bound).
MAX_UNEXPORTED = 4096
#: Child spans kept per step: a runaway source cannot grow one trace without bound.
MAX_SPANS_PER_STEP = 4096
#: Spans of a step this far behind the last exported one are dropped: their step is gone.
KEEP_BEHIND = 64


class SpanScheduler:
    """Holds completed steps and their child spans until the steps are due (see the module docstring)."""

    def __init__(
        self,
        wait_ns: int = SPAN_WAIT_NS,
        max_unexported: int = MAX_UNEXPORTED,
        max_spans_per_step: int = MAX_SPANS_PER_STEP,
    ) -> None:
        self.wait_ns = wait_ns
        self.max_unexported = max_unexported
        self.max_spans_per_step = max_spans_per_step
        self.pending: dict[int, list[Child]] = {}  # step -> child spans not exported yet
        self.unexported: deque[StepRecord] = deque()  # completed steps whose spans may still come

    def add_span(self, span: Child) -> None:
        """A child span of ``span.step``'s trace, handed over with that step."""
        pending = self.pending.setdefault(span.step, [])
        if len(pending) < self.max_spans_per_step:
            pending.append(span)

    def add_step(self, rec: StepRecord) -> None:
        """A completed step, in step order."""
        self.unexported.append(rec)

    def watermark(
        self, sources: Iterable[Any], now_ns: int, on_error: Callable[[str, BaseException], Any]
    ) -> int:
        """The earliest ``span_watermark_ns`` of the sources that are up (``now_ns`` when none holds
        back); a source that raises is reported through ``on_error(name, exc)`` and ignored."""
        mark = now_ns
        for comp in sources:
            try:
                wm = comp.span_watermark_ns() if comp.up else None
            except Exception as exc:
                on_error(comp.name, exc)
                wm = None
            mark = min(mark, wm) if wm is not None else mark
        return mark

    def due(self, now_ns: int, mark_ns: int, final: bool = False) -> list[StepRecord]:
        """Take the steps to export now, oldest first, with their child spans attached: those that
        ended by ``mark_ns``, waited ``wait_ns``, or overflow the queue; every step when ``final``."""
        queue, out = self.unexported, []
        while queue and (
            final
            or queue[0].end_ns <= mark_ns
            or queue[0].end_ns < now_ns - self.wait_ns
            or len(queue) > self.max_unexported
        ):
            rec = queue.popleft()
            rec.children.extend(self.pending.pop(rec.step, ()))
            out.append(rec)
        if out:
            last = out[-1].step
            for s in [s for s in self.pending if s < last - KEEP_BEHIND]:
                del self.pending[s]
        return out
