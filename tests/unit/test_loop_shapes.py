"""The step anatomy on loops of other shapes than forward, backward, step: an optimizer that runs the
forward and backward inside its step (a closure: Lightning's automatic optimization, LBFGS), and a model
that returns a mapping (Hugging Face's ``ModelOutput``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hpar_agent
from hpar_agent.collectors.phases import BWD0, BWD1, FWD0, FWD1, OPT0, cpu_phases, gpu_phases

SLEEP = 0.05


class Sleepy(torch.nn.Module):
    """Forward and backward each take at least ``SLEEP``; ``as_dict``: returns {"loss", "logits"}."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.as_dict = as_dict

    def forward(self, x: torch.Tensor) -> Any:
        time.sleep(SLEEP)
        h = self.lin(x)
        h.register_hook(lambda g: time.sleep(SLEEP))  # inside the model's backward
        out = h * 2.0
        return {"loss": out.sum(), "logits": out} if self.as_dict else out


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    a = hpar_agent.attach(
        metrics_port=-1, traces="none", run_dir=str(tmp_path), detectors=False, detail_rate=0.0
    )
    yield a
    hpar_agent.detach()


def _phases(agent: Any) -> dict[str, Any]:
    agent.tick()
    comp = agent.component("anatomy")
    for _step, step_s, phases, _loader in comp.history:  # disjoint parts of the step
        assert sum(phases.values()) <= step_s + 1e-6, (step_s, phases)
    return dict(comp.summary())


def test_a_closure_optimizer_s_forward_and_backward_are_not_its_optimizer_phase(agent: Any) -> None:
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    a = _phases(agent)
    p50 = a["phase_seconds_p50"]
    assert a["model"] == {"class": "Sleepy", "found_by": "optimizer step"}, a
    assert p50["forward"] >= SLEEP and p50["backward"] >= SLEEP, p50
    assert a["verdict"] == "compute-bound", a


@pytest.mark.parametrize("loss_from", ["loss", "logits"])
def test_a_mapping_output_s_backward_is_timed(agent: Any, loss_from: str) -> None:
    """The backward starts at the output's loss, or at its logits when the loop makes its own loss."""
    model = Sleepy(as_dict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        out = model(torch.randn(2, 4))
        (out["loss"] if loss_from == "loss" else out["logits"].pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    p50 = _phases(agent)["phase_seconds_p50"]
    assert p50["backward"] >= SLEEP, p50


def test_the_optimizer_phase_starts_after_a_closure_s_backward_on_both_clocks() -> None:
    """Synthetic: the optimizer's pre-hook at 1 ms, its closure's forward 2-5 ms and backward 5-9 ms, the
    step's end at 10 ms: the optimizer phase is 9-10 ms, on the CPU clock and from CUDA events."""

    class Ev:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, other: Ev) -> float:
            return other.ms - self.ms

    ms = 1_000_000
    marks = [(OPT0, 1), (FWD0, 2), (FWD1, 5), (BWD0, 5), (BWD1, 9)]
    phases, _spans, _loader = cpu_phases(0, 10 * ms, [(c, t * ms, 0, None) for c, t in marks])
    assert phases["optimizer"] == pytest.approx(0.001) and phases["forward"] == pytest.approx(0.003)
    gpu, _spans, _loader, step_s = gpu_phases(0, [(c, t * ms, 0, Ev(t)) for c, t in marks], Ev(0), Ev(10))
    assert gpu["optimizer"] == pytest.approx(0.001) and gpu["backward"] == pytest.approx(0.004)
    assert step_s == pytest.approx(0.01)
