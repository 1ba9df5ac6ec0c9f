"""What the GPU tests read back: registry samples, event-log alerts, local trace spans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def sample_sum(agent: Any, sample: str, **labels: str) -> float:
    """Sum of a sample over every series of the agent's registry whose labels include ``labels``."""
    return sum(
        s.value
        for fam in agent.registry.collect()
        for s in fam.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def alert_events(run_dir: str | Path, alert: str, state: str = "firing") -> list[dict[str, Any]]:
    """Every ``alert`` event in ``state`` of the run's event logs."""
    out = []
    for path in Path(run_dir).glob("events.rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "alert" and rec.get("alert") == alert and rec.get("state") == state:
                out.append(rec)
    return out


def spans(run_dir: str | Path, name: str | None = None) -> list[dict[str, Any]]:
    """The spans of the run's local trace files (OTLP/JSON), optionally only those named ``name``."""
    out = []
    for path in Path(run_dir).glob("traces.rank*.jsonl"):
        for line in path.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    out += [sp for sp in ss.get("spans", []) if name is None or sp["name"] == name]
    return out


def attribute(span: dict[str, Any], key: str) -> Any:
    """A span attribute's value (OTLP/JSON: ``{"key": k, "value": {"intValue": ...}}``)."""
    for kv in span.get("attributes", []):
        if kv["key"] == key:
            v = kv["value"]
            return int(v["intValue"]) if "intValue" in v else next(iter(v.values()), None)
    return None
