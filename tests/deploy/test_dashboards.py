"""Generated Grafana dashboards: byte-identical regeneration, Grafana's schema, and their queries."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hpar_agent import catalogue as cat
from tests.deploy._tools import (
    DASHBOARDS,
    ROOT,
    allowed_names,
    dashboard_queries,
    expand_macros,
    metric_names,
    npm_tools,
    rule_docs,
    run,
)

EXPECTED = {"overview.json", "collectives.json", "compile.json", "memory.json", "pipeline.json"}


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "hpar_dashboards_generate", ROOT / "dashboards" / "generate.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_dashboards_regenerate_byte_identical(tmp_path: Path) -> None:
    gen = _generator()
    assert {p.name for p in DASHBOARDS} == EXPECTED
    assert gen.main(["--check"]) == 0
    assert gen.main(["--out", str(tmp_path)]) == 0
    for p in DASHBOARDS:
        assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name
    (tmp_path / "memory.json").write_text("{}\n")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1


def test_panel_queries_parse_and_use_catalogued_names() -> None:
    allowed = allowed_names()
    used: set[str] = set()
    for path in DASHBOARDS:
        queries = dashboard_queries(json.loads(path.read_text()))
        assert len(queries) >= 5, path.name
        for title, expr in queries:
            names = metric_names(expand_macros(expr))  # raises on a parse error
            assert names, f"{path.name} / {title}: selects no metric"
            unknown = names - allowed
            assert not unknown, f"{path.name} / {title}: not in the catalogue: {unknown}"
            used |= names
    assert {
        "hpar_collective_duration_seconds_bucket",
        "hpar_pp_bubble_ratio",
        "hpar_dynamo_recompiles_total",
        "hpar_memory_post_step_bytes",
        "hpar_step_duration_seconds_bucket",
    } <= used


def test_each_alert_links_a_dashboard_that_shows_its_series() -> None:
    """An alert's dashboard_url names a shipped dashboard, and where a rule reads the exported series
    (not only the detector's hpar_alert_active), that dashboard draws at least one of them."""
    records = {r["record"]: r["expr"] for r in rule_docs() if "record" in r}

    def series(expr: str) -> set[str]:  # through recording rules, histogram suffixes dropped
        out: set[str] = set()
        for n in metric_names(expr):
            out |= series(records[n]) if n in records else {re.sub(r"_(bucket|sum|count)$", "", n)}
        return out

    shown = {}
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        shown[d["uid"]] = set().union(*(series(expand_macros(e)) for _, e in dashboard_queries(d)))
    for spec in cat.ALL_ALERTS:
        assert spec.dashboard in shown, f"{spec.name}: no dashboard with uid {spec.dashboard}"
        read = set().union(*(series(r["expr"]) for r in rule_docs() if r.get("alert") == spec.name))
        read -= {"hpar_alert_active"}
        if read:
            assert read & shown[spec.dashboard], f"{spec.name}: {spec.dashboard} shows none of {sorted(read)}"


def test_dashboards_have_variables_and_exemplar_latency_panels() -> None:
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[:4] == ["datasource", "job", "rank", "pp_stage"], path.name
        assert names[-2:] == ["job_id", "topn"], path.name
        assert d["schemaVersion"] >= 39, "not the Grafana 11 flavour of the SDK"
        for p in d["panels"]:
            for t in p.get("targets", []):
                assert t["datasource"]["uid"] == "${datasource}"
                if "_bucket" in t["expr"]:
                    assert t.get("exemplar") is True, (
                        f"{path.name} / {p['title']}: latency panel without exemplars"
                    )
                else:
                    assert 'rank=~"$rank"' in t["expr"] or 'job=~"$job"' in t["expr"], t["expr"]
    collectives = json.loads((ROOT / "dashboards" / "collectives.json").read_text())
    assert "pg" in [v["name"] for v in collectives["templating"]["list"]]


def test_gpu_panels_are_marked() -> None:
    gen = _generator()
    marked = []
    for path in DASHBOARDS:
        for p in json.loads(path.read_text())["panels"]:
            if p.get("description", "").endswith(gen.GPU_MARK):
                marked.append(p["title"])
                assert any(k in t["expr"] for k in ("gpu", "allocator", "hpar_mfu") for t in p["targets"]), p[
                    "title"
                ]
    assert "GPU memory used / total (NVML)" in marked and "Allocator bytes by kind" in marked


@pytest.mark.skipif(
    not (shutil.which("npm") and shutil.which("check-jsonschema")),
    reason="npm (for @grafana/schema) or check-jsonschema not installed",
)
def test_dashboards_validate_against_grafana_schema(tmp_path: Path) -> None:
    tools = npm_tools()
    assert tools
    schema = tools[1]
    res = run(["check-jsonschema", "--schemafile", str(schema), *map(str, DASHBOARDS)])
    assert res.returncode == 0, res.stdout + res.stderr
    broken = json.loads(DASHBOARDS[0].read_text())
    broken["panels"][1]["gridPos"]["h"] = "tall"
    bad = tmp_path / "broken.json"
    bad.write_text(json.dumps(broken))
    res = run(["check-jsonschema", "--schemafile", str(schema), str(bad)])
    assert res.returncode != 0, "the schema accepts a broken dashboard"


def _all_panels(path: Path) -> list[dict]:
    return [p for p in json.loads(path.read_text())["panels"] if p.get("targets")]


def test_per_rank_time_series_draw_only_the_worst_or_best_n() -> None:
    """At 1,024 ranks a panel drawing every rank is unreadable: every time series whose legend names a
    rank is a topk/bottomk over ``$topn`` fixed at the range's end; every rank is drawn only in
    heatmaps (one row per rank) and tables."""
    per_rank = 0
    for path in DASHBOARDS:
        for p in _all_panels(path):
            for t in p["targets"]:
                if p["type"] == "timeseries" and "{{rank}}" in t.get("legendFormat", ""):
                    per_rank += 1
                    assert re.search(
                        r"\b(topk|bottomk)\(\$topn, \w+_over_time\(.*@ end\(\)\)\)$", t["expr"]
                    ), f"{path.name} / {p['title']}: draws every rank: {t['expr']}"
                    assert "$topn" in p["title"] + p["description"], p["title"]
                if p["type"] == "stat":
                    assert "rank" not in t.get("legendFormat", ""), (
                        f"{path.name} / {p['title']}: a stat per rank"
                    )
    assert per_rank >= 20


def test_heatmaps_annotations_rank_table_mfu_and_job_id() -> None:
    boards = {p.stem: json.loads(p.read_text()) for p in DASHBOARDS}
    heatmaps = {
        name: [p["title"] for p in d["panels"] if p["type"] == "heatmap"] for name, d in boards.items()
    }
    assert heatmaps["overview"] == ["Step time by rank (heatmap)"]
    assert heatmaps["collectives"] == ["Collective latency by rank (heatmap)"]
    assert heatmaps["memory"] == ["Post-step memory by rank (heatmap)"]
    for d in boards.values():
        for p in d["panels"]:
            if p["type"] == "heatmap":
                assert p["options"]["calculate"] is False  # rows are ranks, not calculated buckets
                (t,) = p["targets"]
                assert t["legendFormat"] == "{{rank}}" and "group_left (job_id) hpar_rank_info" in t["expr"]
        annos = {a["name"]: a for a in d["annotations"]["list"]}
        assert "hpar_alerts_total" in annos["Alerts raised"]["expr"], d["uid"]
        assert "hpar_dynamo_compiles_total" in annos["Compiles"]["expr"], d["uid"]
        job_id = next(v for v in d["templating"]["list"] if v["name"] == "job_id")
        assert "hpar_rank_info" in job_id["query"] and "job_id)" in job_id["query"]
    overview = {p["title"]: p for p in boards["overview"]["panels"]}
    table = overview["Ranks: host and GPU"]
    (t,) = table["targets"]
    assert t["instant"] is True and t["format"] == "table"
    assert {"host", "gpu_uuid", "gpu_index", "job_id", "numa_node", "gpu_numa_node"} <= set(
        re.search(r"max by \(([^)]*)\)", t["expr"])[1].split(", ")
    )
    assert "DCGM_FI_DEV_GPU_UTIL * on (UUID)" in table["description"]
    assert "hpar_mfu{" in overview["MFU (model FLOPs utilization)"]["targets"][0]["expr"]
    assert "hpar_peak_flops" in overview["MFU reported by the training loop"]["targets"][0]["expr"]
    assert "hpar_tokens_total" in overview["Tokens per second"]["targets"][0]["expr"]
