"""One source for every threshold: the detectors' parameters, the numbers the Prometheus rules compare
with and the docs tables all come from ``hpar_agent.thresholds``; every alert a rule defines is in the
catalogue. Needs no promtool (reads the rule files as YAML)."""

from __future__ import annotations

import re
from pathlib import Path

from hpar_agent import catalogue as cat
from hpar_agent import thresholds as th
from hpar_agent.collectors.verdict import DEFAULTS as ANATOMY
from hpar_agent.detectors.component import ALL_DETECTORS
from scripts.gen_docs import _num, params_table, thresholds_table
from tests.deploy._tools import ROOT, rule_docs

#: an ordered comparison with a number (``== 1`` on a 0/1 state is not a threshold)
_COMPARED = re.compile(r"(?:>=|<=|>|<)\s*(-?\d+(?:\.\d+)?(?:e-?\d+)?)")


def _alert_rules() -> list[dict]:
    return [r for r in rule_docs() if "alert" in r]


def compared_numbers(expr: str) -> list[float]:
    return [float(x) for x in _COMPARED.findall(expr)]


def test_compared_numbers_reads_the_expression_in_order() -> None:
    expr = "a < 0.3 and on (x) sum(increase(b[5m])) >= 10 and c offset 10m > 0 and up == 1"
    assert compared_numbers(expr) == [0.3, 10.0, 0.0]


def test_detectors_take_their_defaults_from_the_table() -> None:
    assert set(th.DETECTOR_DEFAULTS) == set(cat.ALERT_NAMES)
    for cls in ALL_DETECTORS:
        assert cls.defaults is th.DETECTOR_DEFAULTS[cls.name], cls.name
        assert cls.threshold_param in cls.defaults, cls.name
    assert {f"anatomy.{k}": v for k, v in th.ANATOMY_DEFAULTS.items()} == ANATOMY


def test_every_rule_compares_with_the_numbers_of_the_table() -> None:
    seen = set()
    for r in _alert_rules():
        signal = r["labels"]["signal"]
        if signal == "detector":
            assert compared_numbers(r["expr"]) == [], r["alert"]  # hpar_alert_active == 1 only
            continue
        key = (r["alert"], signal)
        if not compared_numbers(r["expr"]):  # a 0/1 state (the agent's verdict): no number to compare
            assert key not in th.RULE_THRESHOLDS, key
            continue
        assert key in th.RULE_THRESHOLDS, f"{key}: a rule threshold missing from hpar_agent.thresholds"
        assert compared_numbers(r["expr"]) == list(th.RULE_THRESHOLDS[key].values()), key
        seen.add(key)
    assert seen == set(th.RULE_THRESHOLDS), "thresholds of rules that do not exist"


def test_rules_measuring_what_a_detector_measures_use_its_number() -> None:
    d = th.DETECTOR_DEFAULTS
    assert (
        th.RULE_THRESHOLDS[("CollectiveLatencyHigh", "p99_latency")]["slo_s"]
        == d["CollectiveLatencyHigh"]["slo_s"]
    )
    assert (
        th.RULE_THRESHOLDS[("GradSyncIncomplete", "grad_sync_coverage")]["min_coverage"]
        == d["GradSyncIncomplete"]["min_coverage"]
    )
    assert (
        th.RULE_THRESHOLDS[("RecompileStorm", "recompiles")]["max_recompiles"]
        == d["RecompileStorm"]["max_recompiles"]
    )
    assert (
        th.RULE_THRESHOLDS[("InputBound", "data_wait_ratio")]["input_share"]
        == th.ANATOMY_DEFAULTS["input_share"]
    )


def test_every_rule_alert_is_in_the_catalogue_with_its_severity() -> None:
    specs = {a.name: a for a in cat.ALL_ALERTS}
    names = set()
    for r in _alert_rules():
        assert r["alert"] in specs, f"rule alert {r['alert']} is not in the catalogue"
        assert r["labels"]["severity"] == specs[r["alert"]].severity, r["alert"]
        names.add(r["alert"])
    assert names == set(specs), "catalogued alerts without a rule"
    assert not {a.name for a in cat.RULE_ALERTS} & set(cat.ALERT_NAMES)  # no hpar_alert_active for these


def test_the_docs_table_shows_every_threshold() -> None:
    page = (ROOT / "docs" / "alerts.md").read_text()
    table = thresholds_table()
    assert table in page, "run: python scripts/gen_docs.py"
    for (alert, signal), params in th.RULE_THRESHOLDS.items():
        for p, v in params.items():
            assert f"| `{alert}` | `{p}` | {_num(v)} | rule signal={signal} |" in table
    for alert, params in th.DETECTOR_DEFAULTS.items():
        for p, v in params.items():
            assert f"| `{alert}` | `{p}` | {_num(v)} | detector |" in table


def test_the_rules_file_is_the_one_checked() -> None:
    assert Path(ROOT / "deploy" / "prometheus" / "rules" / "hpar-alerts.yml").exists()


def test_config_accepts_exactly_the_parameters_of_the_table() -> None:
    from hpar_agent.config import threshold_problems

    ok = {f"{a}.{p}": v for a, params in th.DETECTOR_DEFAULTS.items() for p, v in params.items()}
    ok |= {f"anatomy.{p}": v for p, v in th.ANATOMY_DEFAULTS.items()}  # the anatomy's verdict shares
    assert threshold_problems(ok) == []
    assert len(threshold_problems({"anatomy.loader_share": 0.1, "Hang.timeout": 5})) == 2


def test_each_detector_declares_its_parameters_once_and_the_docs_table_is_generated() -> None:
    """A detector's parameters (name, default, meaning) are ``thresholds.DETECTOR_PARAMS``' only: its
    docstring holds no second table, and the table of its section in docs/alerts.md is generated."""
    page = (ROOT / "docs" / "alerts.md").read_text()
    assert set(th.DETECTOR_PARAMS) == {cls.name for cls in ALL_DETECTORS}
    for cls in ALL_DETECTORS:
        params = th.DETECTOR_PARAMS[cls.name]
        assert len({p.name for p in params}) == len(params) and all(p.help for p in params), cls.name
        assert "| param | default |" not in (cls.__doc__ or ""), cls.name
        assert params_table(cls.name) in page, "run: python scripts/gen_docs.py"
    assert params_table("detectors") in page
