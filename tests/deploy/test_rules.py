"""Prometheus rules, their promtool tests, and the Prometheus / Alertmanager configs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from hpar_agent import catalogue
from tests.deploy._tools import ROOT, RULE_TESTS, RULES, allowed_names, metric_names, rule_docs, run

pytestmark = pytest.mark.skipif(
    not shutil.which("promtool"), reason="promtool not installed (apt: prometheus)"
)


def test_promtool_check_rules() -> None:
    res = run(["promtool", "check", "rules", *map(str, RULES)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_pass() -> None:
    res = run(["promtool", "test", "rules", *map(str, RULE_TESTS)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SUCCESS") + res.stderr.count("SUCCESS") == len(RULE_TESTS)


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The tests are not vacuous: raising the all_reduce SLO to 10 s must make them fail."""
    for src in (*RULES, *RULE_TESTS):
        sub = "rules" if src in RULES else "tests"
        (tmp_path / sub).mkdir(exist_ok=True)
        (tmp_path / sub / src.name).write_text(src.read_text().replace("> 0.085", "> 10"))
    res = run(["promtool", "test", "rules", *map(str, sorted((tmp_path / "tests").glob("*.yml")))])
    assert res.returncode != 0
    assert "CollectiveLatencyHigh" in res.stdout + res.stderr


def test_every_catalogue_alert_has_rules_with_its_severity_and_links() -> None:
    alerts = [r for r in rule_docs() if "alert" in r]
    by_name: dict[str, list[dict]] = {}
    for r in alerts:
        by_name.setdefault(r["alert"], []).append(r)
    for spec in catalogue.ALERTS:
        rules = by_name.get(spec.name)
        assert rules, f"no rule for catalogue alert {spec.name}"
        assert any(f'alert="{spec.name}"' in r["expr"] for r in rules), f"{spec.name}: no detector-fed rule"
        for r in rules:
            assert r["labels"]["severity"] == spec.severity, r
    extra = {"GpuMemoryNearFull", "GpuEccErrors", "HparAgentDown", "HparAgentErrors"}
    assert extra <= set(by_name)
    for r in alerts:
        ann, spec = r["annotations"], catalogue.ALERTS_BY_NAME[r["alert"]]
        # the annotations of the ecosystem's mixins, links from the alert's one catalogue entry
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}, r["alert"]
        assert ann["runbook_url"] == spec.runbook_url, r["alert"]
        assert ann["dashboard_url"] == spec.dashboard_url, r["alert"]
        assert r["labels"]["severity"] in {"warning", "critical"}


@pytest.mark.skipif(not shutil.which("amtool"), reason="amtool not installed (apt: prometheus-alertmanager)")
def test_the_documented_runbook_rewrites_work(tmp_path: Path) -> None:
    """docs/alerts.md's two ways to link your own copy of the docs: the Alertmanager template line
    (rendered by amtool) and the sed over the rule files."""
    text = (ROOT / "docs" / "alerts.md").read_text()
    want = "https://docs.example.com/hpar/alerts.md#hang"
    line = next(x for x in text.splitlines() if x.startswith("{{ reReplaceAll"))
    url = catalogue.ALERTS_BY_NAME["Hang"].runbook_url
    (tmp_path / "t.tmpl").write_text(
        '{{ define "t" }}' + line.replace(".Annotations.runbook_url", f'"{url}"') + "{{ end }}"
    )
    res = run(
        [
            "amtool",
            "template",
            "render",
            f"--template.glob={tmp_path}/t.tmpl",
            '--template.text={{ template "t" . }}',
        ]
    )
    assert res.returncode == 0 and res.stdout.strip() == want, res.stdout + res.stderr
    sed = re.search(r"`(sed -i [^`]+)`", text)
    assert sed
    shutil.copy(RULES[0].parent / "hpar-alerts.yml", tmp_path / "hpar-alerts.yml")
    assert run(["bash", "-c", sed.group(1)], cwd=tmp_path).returncode == 0
    urls = [
        r["annotations"]["runbook_url"]
        for g in yaml.safe_load((tmp_path / "hpar-alerts.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    ]
    assert want in urls and all(u.startswith("https://docs.example.com/hpar/alerts.md#") for u in urls)


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for t in yaml.safe_load(path.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {r["alert"] for r in rule_docs() if "alert" in r}
    assert names - firing == set(), "alerts without a firing test"
    assert names - silent == set(), "alerts without a not-firing test"


def test_every_recording_rule_is_tested() -> None:
    tested = {
        c["expr"]
        for path in RULE_TESTS
        for t in yaml.safe_load(path.read_text())["tests"]
        for c in t.get("promql_expr_test", [])
    }
    used_by_others = {n for r in rule_docs() for n in metric_names(r["expr"])}
    for r in rule_docs():
        if "record" in r and r["record"] not in used_by_others:
            assert r["record"] in tested, f"recording rule {r['record']} has no promql_expr_test"


def test_rule_expressions_use_only_catalogued_names() -> None:
    allowed = allowed_names()
    for r in rule_docs():
        unknown = metric_names(r["expr"]) - allowed
        assert not unknown, f"{r.get('alert') or r.get('record')}: not in the catalogue: {unknown}"


def test_prometheus_config_is_valid() -> None:
    res = run(["promtool", "check", "config", str(ROOT / "deploy" / "prometheus" / "prometheus.yml")])
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(RULES)} rule files found" in res.stdout


@pytest.mark.skipif(not shutil.which("amtool"), reason="amtool not installed (apt: prometheus-alertmanager)")
def test_alertmanager_config_is_valid_and_routes_by_severity() -> None:
    path = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
    res = run(["amtool", "check-config", str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    routes = {"critical": "hpar-pager", "warning": "hpar-team"}
    for severity, receiver in routes.items():
        res = run(
            [
                "amtool",
                "config",
                "routes",
                "test",
                f"--config.file={path}",
                "alertname=Hang",
                "job=hpar",
                f"severity={severity}",
            ]
        )
        assert res.stdout.strip() == receiver, res.stdout + res.stderr
    cfg = yaml.safe_load(path.read_text())
    assert cfg["route"]["group_by"] == ["job", "alertname"]
