"""Generated Grafana dashboards: byte-identical regeneration, Grafana's schema, and their queries."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy._tools import (
    DASHBOARDS,
    ROOT,
    allowed_names,
    dashboard_queries,
    expand_macros,
    metric_names,
    npm_tools,
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
    assert {"hpar_collective_duration_seconds_bucket", "hpar_pp_bubble_ratio", "hpar_dynamo_recompiles_total",
            "hpar_memory_post_step_bytes", "hpar_step_duration_seconds_bucket"} <= used  # fmt: skip


def test_dashboards_have_variables_and_exemplar_latency_panels() -> None:
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        names = [v["name"] for v in d["templating"]["list"]]
        assert names[:4] == ["datasource", "job", "rank", "pp_stage"], path.name
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
                assert any("gpu" in t["expr"] or "allocator" in t["expr"] for t in p["targets"]), p["title"]
    assert "GPU memory used / total (NVML)" in marked and "Allocator bytes by kind" in marked


@pytest.mark.skipif(not (shutil.which("npm") and shutil.which("check-jsonschema")),
                    reason="npm (for @grafana/schema) or check-jsonschema not installed")  # fmt: skip
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
