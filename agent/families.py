"""Build Prometheus metric families from the catalogue, with the common labels filled in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from hpar_agent.catalogue import metric
from hpar_agent.histogram import Histogram


class Families:
    """Factory bound to this rank's common label values (rank, pp_stage)."""

    def __init__(self, common: Sequence[str]) -> None:
        self.common = list(common)

    def counter(self, name: str) -> CounterMetricFamily:
        spec = metric(name)
        assert spec.type == "counter", name
        return CounterMetricFamily(spec.family, spec.help, labels=spec.all_labels)

    def gauge(self, name: str) -> GaugeMetricFamily:
        spec = metric(name)
        assert spec.type == "gauge", name
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.all_labels)

    def histogram(self, name: str) -> HistogramMetricFamily:
        spec = metric(name)
        assert spec.type == "histogram", name
        return HistogramMetricFamily(spec.name, spec.help, labels=spec.all_labels)

    def histograms(self, name: str, hists: Mapping[Any, Histogram]) -> HistogramMetricFamily:
        """A histogram family from ``{label value(s): Histogram}`` in label order; empty ones left out."""
        fam = self.histogram(name)
        for key, hist in sorted(hists.items()):
            if hist.count:
                values = key if isinstance(key, tuple) else (key,)
                fam.add_metric(self.labels(*values), hist.buckets(), hist.sum)
        return fam

    def empty(self, name: str) -> Metric:
        """The family of ``name`` without samples (what a collector's ``describe`` yields)."""
        spec = metric(name)
        if spec.type == "info":
            return InfoMetricFamily(spec.family, spec.help, labels=spec.all_labels)
        return {"counter": self.counter, "gauge": self.gauge, "histogram": self.histogram}[spec.type](name)

    def info(self, name: str, labels: dict[str, str]) -> InfoMetricFamily:
        spec = metric(name)
        fam = InfoMetricFamily(spec.family, spec.help, labels=spec.all_labels)
        fam.add_metric(self.common, labels)
        return fam

    def labels(self, *values: object) -> list[str]:
        return [*self.common, *(str(v) for v in values)]

    def add(self, fam: Metric, values: Iterable[object], value: float) -> None:
        """Add one sample to a counter/gauge family with the common labels prepended."""
        fam.add_metric(self.labels(*values), value)  # type: ignore[attr-defined]
