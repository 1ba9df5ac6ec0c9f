"""AgentConfig: explicit argument > environment > default; every setting range- and type-checked by its
declaration (a ValueError for an explicit value, one warning and the default for an environment value);
thresholds checked against the detector catalogue; removed settings ignored with one warning."""

from __future__ import annotations

import logging
import re

import pytest

import hpar_agent
from hpar_agent import AgentConfig
from hpar_agent import config as config_mod
from hpar_agent.config import SETTINGS, setting
from hpar_agent.topology import detect


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(config_mod, "_warned", set())


@pytest.mark.parametrize(
    ("name", "raw", "field", "default"),
    [
        ("HPAR_INTERVAL", "inf", "interval", 1.0),
        ("HPAR_INTERVAL", "1e11", "interval", 1.0),
        ("HPAR_INTERVAL", "1e-9", "interval", 1.0),
        ("HPAR_INTERVAL", "nan", "interval", 1.0),
        ("HPAR_FR_INTERVAL", "inf", "fr_interval", 5.0),
        ("HPAR_METRICS_ADDR", "garbage addr!", "metrics_addr", "0.0.0.0"),
        ("HPAR_METRICS_ADDR", "300.1.2.3.4/8", "metrics_addr", "0.0.0.0"),
        ("HPAR_JOB_ID", "../../etc", "job_id", ""),
        ("HPAR_BUFFER_SIZE", "0", "buffer_size", 65536),
        ("HPAR_DP", "0", "dp", None),
        ("HPAR_PP_STAGE", "-1", "pp_stage", None),
        ("HPAR_EVENT_LOG", "maybe", "event_log", True),
        ("HPAR_TRACE_EVERY", "2.5", "trace_every", 10),
        ("HPAR_TRACES", "jaeger", "traces", "auto"),
    ],
)
def test_bad_env_value_warns_once_and_uses_default(name, raw, field, default, caplog):
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        for _ in range(3):
            cfg = AgentConfig.load(environ={name: raw})
            assert getattr(cfg, field) == default
    assert sum(name in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval": float("inf")},
        {"interval": 1e-9},
        {"interval": "1"},  # wrong type: ValueError, not TypeError
        {"metrics_port": "9470"},
        {"metrics_port": True},
        {"metrics_addr": "garbage addr!"},
        {"metrics_addr": 0},
        {"event_log": "yes"},
        {"job_id": "a/b"},
        {"pp": 2, "pp_stage": 2},
        {"thresholds": {"Hang.timeout_s": "abc"}},
        {"thresholds": {"Hang.timeout_s": -1}},
        {"thresholds": {"Hang.timeout_s": float("nan")}},
        {"thresholds": {"Hang.warmup_steps": 2.5}},  # a count: a whole number
        {"thresholds": {"Straggler.max_lag_ratio": 1.5}},  # a share: 0..1
        {"thresholds": {"ReplicaDivergence.every_steps": 0}},  # a divisor: at least 1
        {"thresholds": {"Hang.timeout": 5}},
        {"thresholds": {"NoSuchAlert.timeout_s": 5}},
        {"thresholds": {"detectors.nope": 5}},
        {"thresholds": {5: 5}},
        {"thresholds": ["Hang.timeout_s"]},
    ],
)
def test_bad_explicit_value_raises_value_error(kwargs):
    with pytest.raises(ValueError):
        AgentConfig.load(overrides=kwargs, environ={})


def test_removed_settings_are_ignored_with_one_warning(caplog):
    """A job that still sets a removed setting runs: the env var or keyword is ignored, said once."""
    removed = {
        "HPAR_FR_READER": "process",
        "HPAR_FR_COMPLETE": "0",
        "HPAR_FR_FILL": "2",
        "HPAR_WORK_IN_WAITS": "x",
        "HPAR_HELPER_SCHED": "nice",
        "HPAR_LOG_BACKUPS": "-1",
    }
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        for _ in range(2):
            cfg = AgentConfig.load(overrides={"fr_reader": "inline", "interval": 2.0}, environ=removed)
    assert cfg == AgentConfig(interval=2.0)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == len(removed) and all("removed" in m for m in said)
    assert any("HPAR_FR_READER" in m and "fr_reader" in m for m in said)


def test_unknown_names_get_one_warning_with_the_closest_setting(caplog):
    """A misspelled variable is not silently ignored: one line per process names each unknown
    HPAR_* variable with the setting it was probably meant to be; the tools' variables are known."""
    env = {
        "HPAR_METRIC_PORT": "9000",
        "HPAR_INTERVALL": "2",
        "hpar_trace_every": "5",
        "HPAR_ZQX": "1",
        "HPAR_AUTOATTACH": "1",
        "HPAR_DIAGNOSE_RUN": "7-1",
        "HPAR_DETECTORS": "0",
        "PATH": "/bin",
    }
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        for _ in range(3):
            cfg = AgentConfig.load(environ=env)
    assert cfg == AgentConfig(detectors=False)  # the misspelled ones set nothing
    (said,) = [r.getMessage() for r in caplog.records]
    assert "HPAR_METRIC_PORT (did you mean HPAR_METRICS_PORT?)" in said
    assert "HPAR_INTERVALL (did you mean HPAR_INTERVAL?)" in said
    assert "hpar_trace_every (did you mean HPAR_TRACE_EVERY?)" in said
    assert "HPAR_ZQX" in said and "HPAR_ZQX (" not in said  # nothing close: no guess
    assert "AUTOATTACH" not in said and "DIAGNOSE" not in said and "DETECTORS" not in said


def test_valid_values_are_accepted():
    cfg = AgentConfig.load(
        overrides={
            "interval": 0.5,
            "metrics_addr": "::1",
            "thresholds": {
                "Hang.timeout_s": 0,
                "CollectiveLatencyHigh.slo_s.all_gather": 0.2,
                "detectors.stale_s": 10,
            },
        },
        environ={"HPAR_METRICS_ADDR": "node-1.example", "HPAR_INTERVAL": "2"},
    )
    assert cfg.interval == 0.5 and cfg.metrics_addr == "::1"
    assert AgentConfig.load(environ={"HPAR_METRICS_ADDR": "node-1.example"}).metrics_addr == "node-1.example"


def test_tls_pair_from_env_is_accepted(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    cfg = AgentConfig.load(environ={"HPAR_TLS_CERT": str(cert), "HPAR_TLS_KEY": str(key)})
    assert (cfg.tls_cert, cfg.tls_key) == (str(cert), str(key))
    # half a pair is kept as given: the endpoint refuses it (serves nothing), never plain HTTP instead
    alone = AgentConfig.load(environ={"HPAR_TLS_CERT": str(cert)})
    assert alone.tls_cert == str(cert) and alone.tls_key is None
    missing = AgentConfig.load(environ={"HPAR_TLS_CERT": "/nonexistent.pem", "HPAR_TLS_KEY": str(key)})
    assert missing.tls_cert == "/nonexistent.pem"  # not replaced by the default (no TLS)


def test_bad_threshold_never_turns_detectors_off(tmp_path):
    import hpar_agent

    with pytest.raises(ValueError, match=r"Hang\.timeout_s"):
        hpar_agent.attach(thresholds={"Hang.timeout_s": "abc"}, metrics_port=-1, run_dir=str(tmp_path))
    agent = hpar_agent.attach(
        thresholds={"Hang.timeout_s": 7}, metrics_port=-1, traces="none", run_dir=str(tmp_path)
    )
    try:
        det = agent.component("detectors")
        assert det is not None and det.up
    finally:
        hpar_agent.detach()


def test_pp_stage_beyond_the_pipeline_is_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        topo = detect(config=AgentConfig(pp_stage=999, job_id="j"))
    assert topo.pp_stage == 0
    assert any("pp_stage=999" in r.getMessage() for r in caplog.records)
    assert detect(config=AgentConfig(pp=4, pp_stage=3, job_id="j")).pp_stage == 3


def test_precedence_explicit_over_env_over_default(monkeypatch):
    monkeypatch.setenv("HPAR_INTERVAL", "2.5")
    monkeypatch.setenv("HPAR_TRACE_EVERY", "7")
    cfg = AgentConfig.load(AgentConfig(trace_every=3))
    assert cfg.interval == 2.5  # env over default
    assert cfg.trace_every == 3  # explicit config over env
    assert AgentConfig.load(None, {"interval": 0.5}).interval == 0.5  # explicit kwarg over env
    assert AgentConfig.load().metrics_port == 9470  # default


def test_bad_env_values_read_from_os_environ_warn_and_use_defaults(monkeypatch, caplog):
    monkeypatch.setenv("HPAR_INTERVAL", "fast")
    monkeypatch.setenv("HPAR_METRICS_PORT", "-7")
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        cfg = AgentConfig.load()
    assert cfg.interval == 1.0 and cfg.metrics_port == 9470
    text = caplog.text
    assert "HPAR_INTERVAL" in text and "HPAR_METRICS_PORT" in text


def test_bad_explicit_value_raises_clear_error():
    with pytest.raises(ValueError, match="interval must be a finite number"):
        hpar_agent.attach(interval=0)
    with pytest.raises(ValueError, match="unknown hpar_agent option"):
        hpar_agent.attach(no_such_option=1)
    assert hpar_agent.agent.current() is None


def _text(value: object) -> str:
    if isinstance(value, dict):  # HPAR_THRESHOLDS' form
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_each_variable_reads_back_its_default_as_its_type(caplog):
    """Every declared variable parses its default's text to the default itself, of the field's type,
    without a warning: the loader reads each type from the declaration, none by a special case."""
    env = {s.env: _text(s.default) for s in SETTINGS if s.env and s.default is not None}
    assert len(env) >= 15
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        cfg = AgentConfig.load(environ=env)
    assert caplog.records == []
    for s in SETTINGS:
        assert getattr(cfg, s.name) == s.default and type(getattr(cfg, s.name)) is type(s.default), s.name


@pytest.mark.parametrize(
    ("name", "raw", "field", "value"),
    [
        ("HPAR_DP", "", "dp", None),  # an optional integer: empty means unset
        ("HPAR_DP", " 4 ", "dp", 4),
        ("HPAR_EVENT_LOG", "off", "event_log", False),
        ("HPAR_DISABLE", "YES", "disable", True),
        ("HPAR_INTERVAL", "2", "interval", 2.0),
        ("HPAR_METRICS_PORT", "-1", "metrics_port", -1),
        ("HPAR_LOG_MAX_BYTES", "0", "log_max_bytes", 0),
        ("HPAR_WEB_CONFIG", "", "web_config", ""),  # text is kept as given: the endpoint judges it
        ("HPAR_RUN_DIR", " runs/a ", "run_dir", "runs/a"),
    ],
)
def test_each_variable_is_read_by_its_declared_type(name, raw, field, value):
    cfg = AgentConfig.load(environ={name: raw})
    assert getattr(cfg, field) == value and type(getattr(cfg, field)) is type(value)


def test_a_bad_value_is_told_in_the_words_of_its_declaration(caplog):
    """The words of a setting's bounds are the error's and the warning's (and the docs' values column)."""
    interval = next(s for s in SETTINGS if s.name == "interval")
    with pytest.raises(ValueError, match=re.escape(f"interval must be {interval.want}, got 0")):
        AgentConfig(interval=0)
    with caplog.at_level(logging.WARNING, logger="hpar_agent"):
        AgentConfig.load(environ={"HPAR_DP": "0"})
    assert "dp must be 1..1048576, got 0" in caplog.text


def test_every_field_is_declared_once_and_typed_from_its_annotation():
    import dataclasses

    declared = {s.name: s for s in SETTINGS}
    assert list(declared) == [f.name for f in dataclasses.fields(AgentConfig)]
    assert [s.name for s in SETTINGS if not s.env] == []  # thresholds too: HPAR_THRESHOLDS
    assert (declared["dp"].kind, declared["dp"].optional) == (int, True)
    assert (declared["interval"].kind, declared["thresholds"].kind) == (float, dict)
    envs = [s.env for s in SETTINGS if s.env]
    assert len(envs) == len(set(envs)) and all(e.startswith("HPAR_") for e in envs)


def test_a_field_without_a_declaration_is_refused():
    """A field added without setting() fails at import, not silently without a variable or docs."""
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class Partial:
        ok: int = setting(1, env="HPAR_OK", help="declared")
        bare: int = 2

    with pytest.raises(TypeError, match=r"Partial\.bare is not declared with setting\(\)"):
        config_mod._declared(Partial)


def test_hpar_thresholds_is_read_and_validated_like_every_setting(caplog, tmp_path):
    """``HPAR_THRESHOLDS`` sets detector parameters without code; a bad one is warned with the closest
    real name and the defaults are used; what it sets is what the detectors and the summary use."""
    from hpar_agent.agent import Agent
    from hpar_agent.detectors.component import DetectorsComponent

    env = {"HPAR_THRESHOLDS": " Straggler.max_lag_ratio=0.3, RankGone.silent_s=9,detectors.stale_s=40 "}
    cfg = AgentConfig.load(environ=env)
    assert cfg.thresholds == {
        "Straggler.max_lag_ratio": 0.3,
        "RankGone.silent_s": 9.0,
        "detectors.stale_s": 40.0,
    }
    assert AgentConfig.load(environ=env, overrides={"thresholds": {"Hang.timeout_s": 5}}).thresholds == {
        "Hang.timeout_s": 5
    }  # an explicit argument wins
    for text, said in (
        ("Straggler.max_lag_ratoi=0.3", "did you mean Straggler.max_lag_ratio?"),
        ("Hang.warmup_steps=1.5", "Hang.warmup_steps must be a whole number 0 or more"),
        ("Straggler.max_lag_ratio=abc", "Straggler.max_lag_ratio must be a number, got 'abc'"),
        ("Straggler.max_lag_ratio", "expected <Alert>.<param>=value"),
    ):
        caplog.clear()
        config_mod._warned.clear()
        with caplog.at_level(logging.WARNING, logger="hpar_agent"):
            assert AgentConfig.load(environ={"HPAR_THRESHOLDS": text}).thresholds == {}
        assert said in caplog.text and "HPAR_THRESHOLDS" in caplog.text, caplog.text
    agent = Agent(None, config=cfg, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    det = DetectorsComponent()
    agent.add_component(det)  # wired by hand, as tests.unit.harness does: no thread, no endpoint
    params = agent.summary()["components"]["detectors"]
    assert params["Straggler"]["params"]["max_lag_ratio"] == 0.3 and params["Straggler"]["threshold"] == 0.3
    assert params["RankGone"]["params"]["silent_s"] == 9.0 and det.crossrank.stale_s == 40.0
