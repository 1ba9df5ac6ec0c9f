"""The Agent and the public API: a small surface, step boundaries from the optimizer hook or explicit
steps, attach/detach hygiene, an inert agent when disabled, errors counted not raised, only catalogued
names exported, passes at shared wall-clock instants."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
import warnings

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import hpar_agent
from hpar_agent.catalogue import METRICS_BY_NAME
from tests.unit.conftest import train_linear


def test_public_api_is_small():
    assert sorted(hpar_agent.__all__) == [
        "Agent",
        "AgentConfig",
        "__version__",
        "attach",
        "current",
        "detach",
    ]


def test_steps_from_global_optimizer_hook(attach):
    model = torch.nn.Linear(4, 4)
    agent = attach(model)
    train_linear(4)
    agent.tick()
    assert agent.registry.get_sample_value("hpar_steps_total", {"rank": "0", "pp_stage": "0"}) == 4
    count = agent.registry.get_sample_value(
        "hpar_step_duration_seconds_count", {"rank": "0", "pp_stage": "0"}
    )
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
    train_linear(2)  # optimizer steps after an explicit step() are not counted twice
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
    assert first.loop.thread is not None and not first.loop.thread.is_alive()
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
    assert agent.metrics_url is None and agent.loop.thread is None
    assert len(_global_optimizer_post_hooks) == before


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
    assert (
        agent.registry.get_sample_value(
            "hpar_agent_errors_total", {"rank": "0", "pp_stage": "0", "component": "broken"}
        )
        == 2
    )


def test_exposition_uses_only_catalogued_names(attach):
    agent = attach()
    train_linear(2)
    agent.tick()
    for family in agent.registry.collect():
        for sample in family.samples:
            base = sample.name
            for suffix in ("_bucket", "_sum", "_count", "_created"):
                if base.endswith(suffix) and base[: -len(suffix)] in METRICS_BY_NAME:
                    base = base[: -len(suffix)]
            assert base in METRICS_BY_NAME, sample.name
            assert sample.labels.get("rank") == "0" and sample.labels.get("pp_stage") == "0"


def test_disabled_import_costs_nothing():
    code = (
        "import os, sys; os.environ['HPAR_DISABLE']='1'; import hpar_agent; a = hpar_agent.attach();"
        "import threading; assert threading.active_count() == 1; assert not a.started; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_agent_ticks_at_the_same_wall_clock_instants(attach, monkeypatch):
    agent = attach(interval=2.0)
    monkeypatch.setattr("time.time", lambda: 1000.5)
    assert agent.loop.until_next_tick() == pytest.approx(1.5)  # every rank: next multiple of 2 s


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

    for fam in (
        GaugeMetricFamily("hpar_step_phase_ratio", "dup"),
        CounterMetricFamily("hpar_agent_errors", "dup"),
    ):
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            agent.registry.register(Exports(fam))
    agent.registry.register(Exports(GaugeMetricFamily("user_metric", "a name of its own")))  # no collision
    assert (
        agent.registry.get_sample_value(
            "hpar_agent_component_up", {"rank": "0", "pp_stage": "0", "component": "steps"}
        )
        == 1
    )


def test_single_process_topology(attach):
    agent = attach(torch.nn.Linear(2, 2))
    topo = agent.topology
    assert (topo.rank, topo.world_size, topo.dp, topo.tp, topo.pp, topo.pp_stage) == (0, 1, 1, 1, 1, 0)
    assert topo.job_id
    info = agent.registry.get_sample_value(
        "hpar_rank_info", {**_info_labels(agent), "rank": "0", "pp_stage": "0"}
    )
    assert info == 1.0
