"""A histogram accumulated on the agent thread and rendered on scrape, with exemplars.

prometheus_client's own Histogram is built for instrumenting the caller's thread; here observations
arrive in batches from drained buffers and each bucket keeps the trace id of its latest observation as
an OpenMetrics exemplar, so a dashboard can jump from a slow bucket to its trace.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from prometheus_client.samples import Exemplar


class Histogram:
    __slots__ = ("bounds", "count", "counts", "exemplars", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last is +Inf
        self.exemplars: list[Exemplar | None] = [None] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, trace_id: str | None = None, ts: float | None = None) -> None:
        i = bisect.bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        self.count += 1
        if trace_id:
            self.exemplars[i] = Exemplar({"trace_id": trace_id}, value, ts)

    def buckets(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        acc = 0
        for i, le in enumerate([*self.bounds, math.inf]):
            acc += self.counts[i]
            key = "+Inf" if le == math.inf else repr(float(le))
            ex = self.exemplars[i]
            out.append((key, acc, ex) if ex is not None else (key, acc))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (what histogram_quantile approximates)."""
        if not self.count:
            return math.nan
        target = q * self.count
        acc = 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= target:
                return self.bounds[i] if i < len(self.bounds) else math.inf
        return math.inf
