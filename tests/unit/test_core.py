"""Agent core: public API, config precedence, attach/detach hygiene, endpoint and topology."""

from __future__ import annotations

import logging
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.request
import warnings

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import hpar_agent
from hpar_agent import AgentConfig
from hpar_agent.catalogue import ENV_VARS, METRICS_BY_NAME


def _train(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    return model, opt


@pytest.fixture
def attach(tmp_path):
    agents = []

    def _attach(model=None, **kw):
        kw.setdefault("metrics_port", 0)
        kw.setdefault("metrics_addr", "127.0.0.1")
        kw.setdefault("traces", "none")
        kw.setdefault("run_dir", str(tmp_path))
        agent = hpar_agent.attach(model, **kw)
        agents.append(agent)
        return agent

    yield _attach
    hpar_agent.detach()
    for a in agents:
        a.stop()


def test_public_api_is_small():
    assert sorted(hpar_agent.__all__) == ["Agent", "AgentConfig", "__version__", "attach", "current", "detach"]


def test_steps_from_global_optimizer_hook(attach):
    model = torch.nn.Linear(4, 4)
    agent = attach(model)
    _train(4)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 4
    count = agent.registry.get_sample_value("hpar_step_duration_seconds_count", {"rank": "0", "pp_stage": "0"})
    assert count == 4


class _Wrapped(torch.optim.Optimizer):
    """An optimizer wrapper as accelerate's AcceleratedOptimizer is: an Optimizer subclass that never
    ran ``Optimizer.__init__`` (its own ``step`` runs no torch hook) and steps ``self.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure=None):  # type: ignore[override]
        return self.optimizer.step(closure)


def test_steps_of_the_optimizer_a_given_wrapper_steps(attach):
    """``attach(optimizer=wrapper)`` counts the steps of the optimizer the wrapper steps (only that one
    runs the hooks), and only those."""
    model = torch.nn.Linear(4, 4)
    opt = _Wrapped(torch.optim.SGD(model.parameters(), lr=0.1))
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    agent = attach(model, optimizer=opt)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        other.step()  # stepped first: without the unwrapping it would define the step
        opt.step()
    agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 3


def test_explicit_step_wins_over_optimizer_hook(attach):
    agent = attach()
    agent.step(tokens=128)
    _train(2)  # optimizer steps after an explicit step() are not counted twice
    agent.step(tokens=128)
    agent.tick()
    labels = {"rank": "0", "pp_stage": "0"}
    assert agent.registry.get_sample_value("hpar_steps_total", labels) == 2
    assert agent.registry.get_sample_value("hpar_tokens_total", labels) == 256


def test_attach_twice_warns_and_returns_running_agent(attach):
    first = attach()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = attach()
    assert second is first
    assert any("twice" in str(w.message) for w in caught)


def test_detach_removes_hooks_and_reattach_serves(attach):
    before = len(_global_optimizer_post_hooks)
    first = attach()
    assert len(_global_optimizer_post_hooks) == before + 1
    url1 = first.metrics_url
    hpar_agent.detach()
    assert len(_global_optimizer_post_hooks) == before
    assert first._thread is not None and not first._thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(url1, timeout=2)
    second = attach()
    assert second is not first
    body = urllib.request.urlopen(second.metrics_url, timeout=5).read().decode()
    assert "hpar_rank_info" in body


def test_disable_env_is_a_noop(monkeypatch, attach):
    monkeypatch.setenv("HPAR_DISABLE", "1")
    before = len(_global_optimizer_post_hooks)
    agent = attach()
    assert not agent.enabled and not agent.started
    assert agent.metrics_url is None and agent._thread is None
    assert len(_global_optimizer_post_hooks) == before


def test_precedence_explicit_over_env_over_default(monkeypatch):
    monkeypatch.setenv("HPAR_INTERVAL", "2.5")
    monkeypatch.setenv("HPAR_TRACE_EVERY", "7")
    cfg = AgentConfig.load(AgentConfig(trace_every=3))
    assert cfg.interval == 2.5  # env over default
    assert cfg.trace_every == 3  # explicit config over env
    assert AgentConfig.load(None, {"interval": 0.5}).interval == 0.5  # explicit kwarg over env
    assert AgentConfig.load().metrics_port == 9470  # default


def test_bad_env_value_warns_once_and_uses_default(monkeypatch, caplog):
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


def test_port_in_use_falls_back_to_next_port(attach):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = attach(metrics_port=port)
        assert agent.metrics_url is not None
        assert f":{port}/" not in agent.metrics_url
        assert b"hpar_steps_total" in urllib.request.urlopen(agent.metrics_url, timeout=5).read()


def test_port_in_use_without_fallback_serves_nothing_and_training_goes_on(attach, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="hpar_agent"):
            agent = attach(metrics_port=port, port_fallback=False)
        assert agent.metrics_url is None
        assert "in use" in caplog.text
        _train(2)
        agent.tick()
        assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 2


def test_single_process_topology(attach):
    agent = attach(torch.nn.Linear(2, 2))
    topo = agent.topology
    assert (topo.rank, topo.world_size, topo.dp, topo.tp, topo.pp, topo.pp_stage) == (0, 1, 1, 1, 1, 0)
    assert topo.job_id
    info = agent.registry.get_sample_value("hpar_rank_info", {**_info_labels(agent), "rank": "0", "pp_stage": "0"})
    assert info == 1.0


def _info_labels(agent):
    labels = agent.topology.info_labels()
    labels["agent_version"] = hpar_agent.__version__
    labels["gpu_index"] = labels["gpu_uuid"] = ""  # a CPU rank: empty, still present for joins
    labels.update(agent.component("nvml").binding.labels())  # CPU/NUMA binding (hpar_agent.affinity)
    return labels


def test_report_flops_exports_the_mfu_inputs(attach):
    agent = attach(torch.nn.Linear(2, 2))
    get = agent.registry.get_sample_value
    assert get("hpar_model_flops_per_token", {"rank": "0", "pp_stage": "0"}) is None  # absent until reported
    agent.report_flops(per_token=6 * 123, peak=989e12)
    agent.report_flops(per_token=float("nan"), peak=-1)  # ignored: keeps the good values
    assert get("hpar_model_flops_per_token", {"rank": "0", "pp_stage": "0"}) == 6 * 123
    assert get("hpar_peak_flops", {"rank": "0", "pp_stage": "0"}) == 989e12


def test_errors_in_a_component_are_counted_not_raised(attach):
    agent = attach()

    class Broken(hpar_agent.agent.Component):
        name = "broken"

        def poll(self, now):
            raise RuntimeError("boom")

    agent.add_component(Broken())
    agent.tick()
    agent.tick()
    assert agent.registry.get_sample_value(
        "hpar_agent_errors_total", {"rank": "0", "pp_stage": "0", "component": "broken"}
    ) == 2


def test_exposition_uses_only_catalogued_names(attach):
    agent = attach()
    _train(2)
    agent.tick()
    for family in agent.registry.collect():
        for sample in family.samples:
            base = sample.name
            for suffix in ("_bucket", "_sum", "_count", "_created"):
                if base.endswith(suffix) and base[: -len(suffix)] in METRICS_BY_NAME:
                    base = base[: -len(suffix)]
            assert base in METRICS_BY_NAME, sample.name
            assert sample.labels.get("rank") == "0" and sample.labels.get("pp_stage") == "0"


def test_every_env_var_maps_to_a_config_field():
    fields = set(AgentConfig.__dataclass_fields__)
    for var in ENV_VARS:
        assert var.name.startswith("HPAR_")
        assert var.field in fields, var.name


def test_disabled_import_costs_nothing():
    code = (
        "import os, sys; os.environ['HPAR_DISABLE']='1'; import hpar_agent; a = hpar_agent.attach();"
        "import threading; assert threading.active_count() == 1; assert not a.started; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls_endpoint_serves_https(attach, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    agent = attach(tls_cert=str(cert), tls_key=str(key))
    assert agent.metrics_url.startswith("https://")
    ctx = ssl.create_default_context(cafile=str(cert))
    body = urllib.request.urlopen(agent.metrics_url, timeout=5, context=ctx).read().decode()
    assert "hpar_rank_info" in body
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        AgentConfig(tls_cert=str(cert))


def test_stream_label_values_are_capped():
    from hpar_agent.streams import MAX_STREAMS, OTHER, StreamCap

    cap = StreamCap()
    names = [cap(f"cuda:{i}") for i in range(3 * MAX_STREAMS)]
    assert names[:MAX_STREAMS] == [f"cuda:{i}" for i in range(MAX_STREAMS)]
    assert set(names[MAX_STREAMS:]) == {OTHER}
    assert cap("cuda:0") == "cuda:0"  # a name seen before keeps its label


def test_agent_ticks_at_the_same_wall_clock_instants(attach, monkeypatch):
    agent = attach(interval=2.0)
    monkeypatch.setattr("time.time", lambda: 1000.5)
    assert agent._until_next_tick() == pytest.approx(1.5)  # every rank: next multiple of 2 s


def test_a_second_collector_of_an_agent_metric_cannot_register(attach):
    """The agent's collector describes every catalogued family: prometheus_client refuses a collector
    that would export one of those names a second time."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    agent = attach(metrics_port=-1)

    class Exports:
        def __init__(self, fam):
            self.fam = fam

        def collect(self):
            yield self.fam

    for fam in (GaugeMetricFamily("hpar_step_phase_ratio", "dup"), CounterMetricFamily("hpar_agent_errors", "dup")):
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            agent.registry.register(Exports(fam))
    agent.registry.register(Exports(GaugeMetricFamily("user_metric", "a name of its own")))  # no collision
    assert agent.registry.get_sample_value("hpar_agent_component_up", {"rank": "0", "pp_stage": "0", "component": "steps"}) == 1


def test_pipeline_chunk_bookkeeping_never_raises_into_the_schedule():
    """A failure in the chunk wrapper's own bookkeeping is counted; the chunk runs and returns as if
    unwrapped."""
    from types import SimpleNamespace

    from hpar_agent.collectors.pipeline import PipelineCollector

    c = PipelineCollector()
    errors: list[BaseException] = []
    c.record_error = errors.append  # type: ignore[method-assign]

    class Broken:
        def put(self, item: object) -> None:
            raise RuntimeError("buffer broke")

    c.buffer = Broken()  # type: ignore[assignment]
    wrapped = c._wrap(SimpleNamespace(device=None, stage_index=0), lambda *a, **k: ("ran", a), "forward")
    assert wrapped(3) == ("ran", (3,))
    assert len(errors) == 1 and "buffer broke" in str(errors[0])


def test_pipeline_chunks_of_a_step_without_detail_are_not_timed(tmp_path):
    """On a fast loop's steps without detail (``StepCollector.stride``) the chunk runs untouched."""
    from types import SimpleNamespace

    from hpar_agent.agent import Agent

    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    agent.start()
    try:
        pipe, steps = agent.component("pipeline"), agent.component("steps")
        wrapped = pipe._wrap(SimpleNamespace(device=None, stage_index=0), lambda *a, **k: "ran", "forward")
        steps.detailed = False
        assert wrapped(0) == "ran" and len(pipe.buffer) == 0
        steps.detailed = True
        assert wrapped(1) == "ran" and len(pipe.buffer) == 1
    finally:
        agent.stop()
