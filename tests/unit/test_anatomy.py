"""Step anatomy: phases from the root-module, autograd and optimizer hooks, and the verdict they give."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import hpar_agent
from hpar_agent.collectors.anatomy import AnatomyCollector


class Slow(torch.nn.Module):
    """A model whose forward and backward take a known time (sleep inside autograd too)."""

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fwd_s = fwd_s
        self.bwd_s = bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fwd_s)
        h = self.lin(x)
        if h.requires_grad:  # not under no_grad (an evaluation)
            h.register_hook(lambda g: time.sleep(self.bwd_s))  # runs inside the model's backward
        return h * 2.0


@pytest.fixture
def agent(tmp_path):
    agents = []

    def _attach(model, **kw):
        a = hpar_agent.attach(
            model, metrics_port=-1, traces="none", run_dir=str(tmp_path), detectors=False, **kw
        )
        agents.append(a)
        return a

    yield _attach
    hpar_agent.detach()


class Sleepy(torch.utils.data.Dataset):
    """A dataset whose every item takes ``delay`` seconds: a loader that cannot keep up."""

    def __init__(self, delay: float, n: int = 64) -> None:
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.randn(2, 4)


def _loop(
    model: torch.nn.Module, steps: int, host_s: float = 0.0, opt_s: float = 0.0, load_s: float | None = None
) -> None:
    """``steps`` optimizer steps; ``host_s`` of host work after each, ``load_s``: batches from a
    DataLoader whose every item takes that long (else made in the loop)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if opt_s:
        opt.register_step_pre_hook(lambda *_: time.sleep(opt_s))
    batches = (
        iter(torch.utils.data.DataLoader(Sleepy(load_s, steps), batch_size=None))
        if load_s is not None
        else None
    )
    for _ in range(steps):
        x = next(batches) if batches is not None else torch.randn(2, 4)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(host_s)


def _partition(anatomy: AnatomyCollector) -> None:
    """Every finished step's phases are disjoint parts of it: they never add up to more than the step."""
    assert anatomy.history
    for _step, step_s, phases, _loader in anatomy.history:
        assert sum(phases.values()) <= step_s + 1e-6, (step_s, phases)


def test_phases_from_hooks_cover_the_time_spent(agent) -> None:
    """Each phase holds at least the sleep planted in it (a sleep never returns early), and the phases
    partition the step; no upper bound: a loaded machine stretches every phase."""
    model = Slow(0.05, 0.05)
    a = agent(model)
    _loop(model, 6, host_s=0.005, opt_s=0.02)
    a.tick()
    comp = a.component("anatomy")
    s = comp.summary()
    p50 = s["phase_seconds_p50"]
    assert set(p50) == {"data_wait", "host", "forward", "backward", "optimizer"}  # no comm timing on CPU
    assert p50["forward"] >= 0.05 and p50["backward"] >= 0.05 and p50["optimizer"] >= 0.02
    assert p50["host"] >= 0.005 and p50["data_wait"] == 0.0  # no data loader: no data wait
    _partition(comp)
    assert s["verdict"] == "compute-bound", s
    assert s["source"] == "module-hooks" and s["clock"] == "cpu"
    assert s["model"] == {"class": "Slow", "found_by": "attach(model)"}


def test_the_loader_wait_is_data_wait_and_the_rest_host(agent) -> None:
    """Between two steps the loop spends 0.1 s in the DataLoader and 0.1 s in its own host work: each
    phase holds its own sleep, and neither holds both."""
    model = Slow(0.0, 0.0)
    a = agent(model)
    _loop(model, 6, host_s=0.1, load_s=0.1)
    a.tick()
    comp = a.component("anatomy")
    p50 = comp.summary()["phase_seconds_p50"]
    assert p50["data_wait"] >= 0.1 and p50["host"] >= 0.1, p50
    _partition(comp)  # with the two lower bounds: neither phase holds the other's 0.1 s twice


def test_a_fast_loop_gets_phases_on_every_strideth_step_only(agent, monkeypatch) -> None:
    """With ``StepCollector.stride`` 3 the hooks record steps 0, 3, 6 only and the others get no
    phases (they are timed and counted all the same)."""
    from hpar_agent.agent_thread import AgentThread

    monkeypatch.setattr(
        AgentThread, "_run", lambda self: None
    )  # only this test's tick: a pass would reset the stride
    model = Slow(0.0, 0.0)
    a = agent(model)
    steps, anatomy = a.component("steps"), a.component("anatomy")
    steps.stride = 3  # what detail_stride gives a loop at 3x detail_rate; no tick before the loop ends
    _loop(model, 9)
    assert sorted({item[0] for item in anatomy.hooks.buffer._items}) == [0, 3, 6]  # what the hooks recorded
    a.tick()
    assert anatomy.hists["forward"].count == 3 and anatomy.hists["backward"].count == 3
    assert steps.total == 9


class Wrapper(torch.nn.Module):
    """A data-parallel wrapper's shape (DDP, DeepSpeed's engine): ``.module`` holds every parameter."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@pytest.mark.parametrize("through", ["model", "wrapped module"])
def test_an_evaluation_on_a_step_without_detail_gives_that_step_its_detail(
    agent, monkeypatch, through
) -> None:
    """With ``StepCollector.stride`` 3, step 4 has no detail; an evaluation (forwards without grad and
    0.2 s of their work) before it gives it the detail, and the evaluation is its host time, not its
    forward. Without it, the step would get the recent steps' shares: the 0.2 s counted as compute. The
    verdict leaves the step out: the evaluation is not the training step's bottleneck. The same when the
    root is a wrapper and the evaluation calls the module it wraps (``ddp.module(x)``, the HF Trainer's)."""
    from hpar_agent.agent_thread import AgentThread

    monkeypatch.setattr(AgentThread, "_run", lambda self: None)  # a pass would reset the stride
    inner = Slow(0.0, 0.0)
    model = inner if through == "model" else Wrapper(inner)
    a = agent(model)
    steps, anatomy = a.component("steps"), a.component("anatomy")
    steps.stride = 3
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(9):
        if i == 4:
            with torch.no_grad():
                inner(torch.randn(2, 4))
                time.sleep(0.2)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert sorted({item[0] for item in anatomy.hooks.buffer._items}) == [0, 3, 4, 6]
    a.tick()
    phases = {h[0]: h[2] for h in anatomy.history}
    assert sorted(phases) == [0, 3, 4, 6], phases
    assert phases[4]["host"] >= 0.2 and phases[4]["forward"] < 0.2, phases[4]  # the 0.2 s is not forward
    # the verdict judges the training steps after warm-up (3 and 6): the evaluation is the job's time
    assert anatomy.evaluated == {4} and anatomy.evidence["steps"] == 2, anatomy.evidence


class Frozen(torch.nn.Module):
    """A model with a frozen submodule named ``module`` run without grad inside its training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.module(x)
        return self.head(x)


def test_a_frozen_submodule_named_module_run_without_grad_is_no_evaluation(agent) -> None:
    """Only a wrapper's ``.module`` (holding every parameter) is watched for evaluations: a model's own
    submodule of that name runs without grad inside every training step."""
    model = Frozen()
    a = agent(model)
    _loop(model, 6)
    a.tick()
    anatomy = a.component("anatomy")
    assert anatomy.evaluated == set() and len(anatomy.history) == 6, (anatomy.evaluated, anatomy.history)


@pytest.mark.parametrize(
    ("median_s", "rate", "every", "stride"),
    [
        (0.2, 10.0, 10, 1),
        (0.043, 10.0, 10, 5),
        (0.043, 0.0, 10, 1),
        (0.055, 10.0, 10, 2),
        (0.004, 10.0, 10, 30),
        (0.043, 10.0, 0, 3),
        (0.043, 10.0, 4, 4),
    ],
)
def test_detail_stride_bounds_the_detailed_steps_a_second(median_s, rate, every, stride) -> None:
    from hpar_agent.collectors.steps import detail_stride

    assert detail_stride([median_s] * 20, rate, every) == stride
    assert detail_stride([median_s] * 3, rate, every) == 1  # too few steps to know the rate


def test_a_slow_data_loader_is_input_bound(agent) -> None:
    """0.2 s a batch in the DataLoader against a near-empty model: input-bound."""
    model = Slow(0.0, 0.0)
    a = agent(model)
    _loop(model, 6, load_s=0.2)
    a.tick()
    s = a.component("anatomy").summary()
    assert s["verdict"] == "input-bound", s
    assert s["phase_seconds_p50"]["data_wait"] >= 0.2 and s["evidence"]["loader_seconds_mean"] >= 0.2
    assert "data_wait" in s["evidence"]["reason"], s


def test_host_work_between_steps_is_host_bound_not_input_bound(agent) -> None:
    """0.2 s of host work after each optimizer step (logging, a checkpoint) with no data loader: the
    time is host, not a data wait; the verdict names neither input nor compute."""
    model = Slow(0.0, 0.0)
    a = agent(model)
    _loop(model, 6, host_s=0.2)
    a.tick()
    s = a.component("anatomy").summary()
    assert s["verdict"] == "host-bound", s
    assert s["phase_seconds_p50"]["host"] >= 0.2 and s["phase_seconds_p50"]["data_wait"] == 0.0
    assert s["evidence"]["loader_seconds_mean"] == 0.0


def test_dataloader_time_is_measured_and_the_patch_is_restored(agent) -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    orig = _BaseDataLoaderIter.__next__

    model = Slow(0.0, 0.0)
    a = agent(model)
    assert _BaseDataLoaderIter.__next__ is not orig
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in DataLoader(Sleepy(0.01, 8), batch_size=2):
        model(x).sum().backward()
        opt.step()
    a.tick()
    ev = a.component("anatomy").summary()["evidence"]
    assert ev["loader_seconds_mean"] >= 0.015  # two 10 ms items per batch
    hpar_agent.detach()
    assert _BaseDataLoaderIter.__next__ is orig


def test_hooks_are_removed_on_detach(agent) -> None:
    model = Slow(0.0, 0.0)
    agent(model)
    assert model._forward_pre_hooks and model._forward_hooks
    hpar_agent.detach()
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_hooks_are_silent_while_compiling(agent) -> None:
    model = torch.nn.Linear(4, 4)
    a = agent(model)
    comp = a.component("anatomy")
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(2, 4))  # the root's hooks run inside the traced region: nothing recorded
    assert [e for e in comp.hooks.buffer.drain() if e[1] == 0] == []
    comp.hooks._compiling = lambda: False  # the same call outside tracing records
    comp.hooks._fwd_pre(model, ())
    assert [e[1] for e in comp.hooks.buffer.drain()] == [0]


def test_hooks_traced_by_torch_compile_do_not_recompile_it_as_the_detail_toggles(agent, monkeypatch) -> None:
    """``attach(model)`` then ``torch.compile(model)``: the root's hooks are traced with the model; the
    detail stride toggling ``detailed`` from step to step must not make it compile again."""
    from torch._dynamo.utils import counters

    from hpar_agent.agent_thread import AgentThread

    monkeypatch.setattr(AgentThread, "_run", lambda self: None)  # no pass to reset the stride set below
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    a = agent(model)
    compiled, steps = torch.compile(model, backend="eager"), a.component("steps")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(torch.randn(2, 4)).sum().backward()
    opt.step()
    graphs = counters["stats"]["unique_graphs"]
    steps.stride = 2  # detailed on every other step from now on
    for _ in range(4):
        compiled(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert counters["stats"]["unique_graphs"] == graphs


def test_exported_series(agent) -> None:
    from prometheus_client import generate_latest

    model = Slow(0.0, 0.0)
    a = agent(model)
    _loop(model, 4, load_s=0.2)
    a.tick()
    text = generate_latest(a.registry).decode()
    assert 'hpar_step_phase_duration_seconds_count{phase="forward",pp_stage="0",rank="0"} 4.0' in text
    assert 'hpar_step_phase_duration_seconds_count{phase="host",pp_stage="0",rank="0"} 4.0' in text
    assert 'hpar_step_bottleneck{pp_stage="0",rank="0",verdict="input-bound"} 1.0' in text
    for other in ("compute-bound", "host-bound", "unknown"):
        assert f'hpar_step_bottleneck{{pp_stage="0",rank="0",verdict="{other}"}} 0.0' in text
    assert 'hpar_step_phase_ratio{phase="data_wait"' in text


def test_phase_spans_are_children_of_the_step() -> None:
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    ms = 1_000_000
    rec = StepRecord(step=5, start_ns=0, end_ns=100 * ms)
    # 1-8 ms in the loader, then host work to the forward at 10 ms; a second loader call inside the
    # backward (a prefetch) is loader time but no data wait
    events = [
        (0, 10 * ms, 0, None),
        (1, 40 * ms, 0, None),
        (2, 45 * ms, 0, None),
        (3, 85 * ms, 0, None),
        (4, 90 * ms, 0, None),
        (5, 1 * ms, 8 * ms, None),
        (5, 50 * ms, 52 * ms, None),
    ]
    phases, spans, loader = c.phases(rec, events)
    assert phases == pytest.approx(
        {"data_wait": 0.007, "host": 0.003, "forward": 0.03, "backward": 0.04, "optimizer": 0.01}
    )
    assert spans == [
        ("host", 0, 1 * ms),
        ("data_wait", 1 * ms, 8 * ms),
        ("host", 8 * ms, 10 * ms),
        ("forward", 10 * ms, 40 * ms),
        ("backward", 45 * ms, 85 * ms),
        ("optimizer", 90 * ms, 100 * ms),
    ]
    assert loader == pytest.approx(0.009)


class FakeEvent:
    """A CUDA event stand-in: completes when told, times in ms on a fake stream clock."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.done and other.done, "elapsed_time on an incomplete event would sync"
        return other.ms - self.ms


def test_cuda_events_give_stream_phases_and_wait_for_completion() -> None:
    """On CUDA the phases come from events: the CPU timestamps (launch times) are ignored, and a step
    is finished only once its end event has completed."""
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    ms = 1_000_000
    c._last_end_event = FakeEvent(0.0)  # the previous step's end on the stream
    end = FakeEvent(110.0, done=False)
    # host: 31 ms in the loader, then launches within 5 ms; the stream: idle 30 ms (input), fwd 30, bwd 40, opt 10
    events = [
        (0, 31 * ms, 0, FakeEvent(30.0)),
        (1, 32 * ms, 0, FakeEvent(60.0)),
        (2, 33 * ms, 0, FakeEvent(60.0)),
        (3, 34 * ms, 0, FakeEvent(100.0)),
        (4, 35 * ms, 0, FakeEvent(100.0)),
        (6, 36 * ms, 0, end),
        (5, 0, 31 * ms, None),
    ]
    c._events[3] = events  # as poll() leaves them
    c.on_step(StepRecord(step=3, start_ns=0, end_ns=36 * ms))
    assert c.history == [] and c.span_watermark_ns() == 0  # the end event is still pending
    end.done = True
    c._flush()
    ((step, step_s, phases, _loader),) = c.history
    assert step == 3 and step_s == pytest.approx(0.11)
    # the stream's 30 ms idle is the last 30 ms of the host's 31 ms to the forward, all in the loader
    assert phases == pytest.approx(
        {"data_wait": 0.03, "host": 0.0, "forward": 0.03, "backward": 0.04, "optimizer": 0.01}
    )
    assert c.clock == "cuda-events" and c._last_end_event is end and c.span_watermark_ns() is None
    assert c.verdict == "input-bound"  # 27% of the stream's step time idle, waiting for input


def test_cuda_phases_of_a_detailed_step_are_measured_from_the_undetailed_step_before() -> None:
    """A fast loop's step without detail records only its end event (the optimizer post-hook does when
    the next step is detailed): it gets no phases, and the next step's offsets start at that end."""
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    ms = 1_000_000
    c._last_end_event = FakeEvent(-500.0)  # an older step's end: measuring from it would add 500 ms
    prev_end = FakeEvent(0.0)
    c._events[2] = [(6, 1 * ms, 0, prev_end)]
    c.on_step(StepRecord(step=2, start_ns=0, end_ns=1 * ms, detailed=False))
    assert c.history == [] and c._last_end_event is prev_end
    end = FakeEvent(110.0)
    c._events[3] = [
        (0, 31 * ms, 0, FakeEvent(30.0)),
        (1, 32 * ms, 0, FakeEvent(60.0)),
        (2, 33 * ms, 0, FakeEvent(60.0)),
        (3, 34 * ms, 0, FakeEvent(100.0)),
        (4, 35 * ms, 0, FakeEvent(100.0)),
        (6, 36 * ms, 0, end),
    ]
    c.on_step(StepRecord(step=3, start_ns=1 * ms, end_ns=36 * ms))
    ((step, step_s, phases, _loader),) = c.history
    assert step == 3 and step_s == pytest.approx(0.11)
    assert phases["forward"] == pytest.approx(0.03) and phases["optimizer"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("prev", "nxt", "recorded"), [(True, False, True), (False, True, True), (False, False, False)]
)
def test_cuda_end_event_is_recorded_for_a_detailed_step_and_the_one_before(prev, nxt, recorded) -> None:
    from types import SimpleNamespace

    c = AnatomyCollector()
    opt = object()
    c.hooks._steps = SimpleNamespace(
        explicit=False, _optimizer_id=id(opt), count=5, prev_detailed=prev, detailed=nxt
    )
    c.hooks.event = lambda enable_timing: SimpleNamespace(record=lambda stream: None)
    c.hooks._stream = lambda: None
    c.hooks._opt_post(opt, (), {})
    assert [item[:2] for item in c.hooks.buffer.drain()] == ([(4, 6)] if recorded else [])  # (step, OPT1)


def test_cuda_stream_idle_of_a_host_bound_loop_is_not_data_wait() -> None:
    """A small model on an H200: the host reaches the forward 1 ms after the step boundary, but launches
    so slowly that the stream sits idle 30 ms. That is launch overhead, not input: the wait before the
    forward is the shorter of the two, none of it in a loader (host), and the verdict is not input-bound."""
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    ms = 1_000_000
    c._last_end_event = FakeEvent(0.0)
    end = FakeEvent(110.0)
    events = [
        (0, 1 * ms, 0, FakeEvent(30.0)),
        (1, 2 * ms, 0, FakeEvent(60.0)),
        (2, 3 * ms, 0, FakeEvent(60.0)),
        (3, 4 * ms, 0, FakeEvent(100.0)),
        (4, 5 * ms, 0, FakeEvent(100.0)),
        (6, 6 * ms, 0, end),
    ]
    c._events[3] = events
    c.on_step(StepRecord(step=3, start_ns=0, end_ns=6 * ms))
    ((_step, _s, phases, _loader),) = c.history
    assert phases["host"] == pytest.approx(0.001) and phases["data_wait"] == 0.0
    assert c.verdict is None  # judged once per pass, after its steps (as the agent's tick calls it)
    c.end_pass()
    assert c.verdict == "compute-bound"


def test_the_rank_straggler_names_is_the_slow_rank(tmp_path, monkeypatch) -> None:
    """slow-rank comes from the rank's own Straggler detector state (arrival lag at collectives)."""
    from prometheus_client import generate_latest

    from hpar_agent.agent_thread import AgentThread

    monkeypatch.setattr(
        AgentThread, "_run", lambda self: None
    )  # only this test's tick: the thread's would re-judge
    model = Slow(0.01, 0.01)
    a = hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    try:
        st = a.component("detectors").states["Straggler"]
        st.active, st.value, st.judged = True, 0.4, 2  # confirmed on two verdicts
        _loop(model, 4)
        a.tick()
        s = a.component("anatomy").summary()
        assert s["verdict"] == "slow-rank"
        assert s["evidence"]["slow_rank"] == 0 and s["evidence"]["straggler_lag_ratio"] == 0.4
        text = generate_latest(a.registry).decode()
        assert 'hpar_step_bottleneck{pp_stage="0",rank="0",verdict="slow-rank"} 1.0' in text
    finally:
        hpar_agent.detach()


def test_a_failing_hook_is_counted_not_raised(agent) -> None:
    model = Slow(0.0, 0.0)
    a = agent(model)
    comp = a.component("anatomy")

    def broken(**_kw):
        raise RuntimeError("no event today")

    comp.hooks.event = broken  # as if CUDA events failed
    _loop(model, 2)  # training goes on
    assert a.errors["anatomy"] >= 1


def test_cuda_events_are_recorded_on_the_ranks_device_stream() -> None:
    """Hooks run on threads whose current CUDA device is 0 (autograd's, the user's): each event is
    recorded on the stream of the rank's device, never on the thread's current one."""
    recorded = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            pass

        def record(self, stream: object = None) -> None:
            recorded.append(stream)

    c = AnatomyCollector()
    c.hooks.event, c.hooks._stream = Event, lambda: "stream-of-cuda:1"
    c.hooks._mark(0, 0)
    assert recorded == ["stream-of-cuda:1"]
    assert c.hooks.buffer.drain()[0][4] is not None


def test_exposed_communication_is_what_no_phase_covers() -> None:
    from hpar_agent.collectors.phases import exposed_ns

    busy = [(10, 40), (50, 80)]  # forward, backward
    # an op hidden by the backward, one sticking out of it, one in a gap, overlapping ops counted once
    comm = [(55, 60), (70, 90), (85, 95), (42, 48), (0, 5)]
    assert exposed_ns(comm, busy, 2, 92) == [(2, 5), (42, 48), (80, 92)]
    assert exposed_ns([], busy, 0, 100) == [] and exposed_ns([(0, 100)], [], 0, 100) == [(0, 100)]


def test_ddp_wait_after_backward_is_exposed_communication(tmp_path) -> None:
    """The host wait of the engine callbacks after the backward (DDP's bucket wait) is comm_exposed,
    and no comm_exposed is made up where no timing exists (single process, nothing timed)."""
    from hpar_agent.collectors.phases import BWD0, BWD1, FWD0, FWD1, OPT0, SYNC1
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    ms = 1_000_000
    c._events[1] = [
        (FWD0, 1 * ms, 0, None),
        (FWD1, 3 * ms, 0, None),
        (BWD0, 3 * ms, 0, None),
        (BWD1, 6 * ms, 0, None),
        (SYNC1, 9 * ms, 0, None),
        (OPT0, 9 * ms, 0, None),
    ]
    c.on_step(StepRecord(step=1, start_ns=0, end_ns=10 * ms))
    ((_step, _s, phases, _loader),) = c.history
    assert phases["comm_exposed"] == pytest.approx(0.003) and not c.comm_pending
    c._events[2] = [(FWD0, 11 * ms, 0, None), (FWD1, 13 * ms, 0, None), (OPT0, 14 * ms, 0, None)]
    c.on_step(StepRecord(step=2, start_ns=10 * ms, end_ns=15 * ms))
    assert "comm_exposed" not in c.history[-1][2]


def test_comm_exposed_waits_for_the_steps_collectives() -> None:
    """Timed collectives come with a later flight-recorder read: the step's comm_exposed (and the span
    watermark) waits until the collectives collector has read past the step's end."""
    from hpar_agent.collectors.phases import BWD0, BWD1, FWD0, FWD1
    from hpar_agent.spans import StepRecord

    b = time.time_ns()  # a step that just ended (after COMM_WAIT_NS it would not wait)

    class Coll:
        up, mark, stats = True, 0, SimpleNamespace(timed=1)
        intervals = {4: [(b + 5_000, b + 12_000), (b + 1_000, b + 2_000)]}

        def span_watermark_ns(self) -> int:
            return self.mark

        def comm_intervals(self, step: int) -> list[tuple[int, int]]:
            return self.intervals.pop(step, [])

    c, coll = AnatomyCollector(), Coll()
    c._coll = coll
    c._events[4] = [
        (FWD0, b + 1_000, 0, None),
        (FWD1, b + 3_000, 0, None),
        (BWD0, b + 3_000, 0, None),
        (BWD1, b + 8_000, 0, None),
    ]
    c.on_step(StepRecord(step=4, start_ns=b, end_ns=b + 10_000))
    assert "comm_exposed" not in c.history[0][2] and c.span_watermark_ns() == b
    coll.mark = b + 10_000  # read through the step's end
    c._flush()
    assert c.history[0][2]["comm_exposed"] == pytest.approx(2e-6)  # 8-10 µs: the rest hid under backward
    assert c.span_watermark_ns() is None and c.summary()["phase_seconds_p50"][
        "comm_exposed"
    ] == pytest.approx(2e-6)


def test_a_peer_the_straggler_exchange_names_is_the_slow_rank(tmp_path, monkeypatch) -> None:
    """On a rank that is not slow itself, the verdict says it waits for the peer its Straggler detector
    found the slowest past the threshold on two consecutive judgements (a victim, never slow-rank); the
    gauge carries the slow peer's rank."""
    from prometheus_client import generate_latest

    from hpar_agent.agent_thread import AgentThread

    monkeypatch.setattr(AgentThread, "_run", lambda self: None)
    model = Slow(0.01, 0.01)
    a = hpar_agent.attach(model, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    try:
        det = a.component("detectors")
        straggler = next(d for d in det.detectors if d.name == "Straggler")
        det.states["Straggler"].judged = 2  # the two verdicts that noted these
        straggler._note_slowest({0: -0.1, 3: 0.45})
        assert straggler.slowest is None  # once is not confirmed
        straggler._note_slowest({0: -0.1, 3: 0.5})
        assert straggler.slowest == (3, 0.5)
        _loop(model, 4)
        a.tick()
        ev = a.component("anatomy").summary()["evidence"]
        assert a.component("anatomy").verdict == "waits-for-slow-rank" and ev["slow_rank"] == 3, ev
        assert ev["reason"] == "waits for rank 3, which the Straggler detector names slow", ev
        text = generate_latest(a.registry).decode()
        assert 'hpar_step_slow_rank{pp_stage="0",rank="0"} 3.0' in text
        assert 'hpar_step_bottleneck{pp_stage="0",rank="0",verdict="slow-rank"} 0.0' in text
        straggler._note_slowest({0: 0.0, 3: 0.1})  # recovered
        assert straggler.slowest is None
    finally:
        hpar_agent.detach()


def test_anatomy_judges_once_per_pass(monkeypatch) -> None:
    from hpar_agent.collectors.anatomy import AnatomyCollector
    from hpar_agent.spans import StepRecord

    c = AnatomyCollector()
    judged: list[int] = []
    monkeypatch.setattr(c, "_judge", lambda: judged.append(len(c.history)))
    for i in range(50):
        c.on_step(StepRecord(step=i, start_ns=i * 10_000_000, end_ns=(i + 1) * 10_000_000))
    assert len(c.history) == 50 and judged == []
    c.end_pass()
    c.end_pass()  # nothing new: no second judgement
    assert judged == [50]


def test_a_pipeline_stage_mostly_waiting_is_unknown_and_the_reason_names_the_bubble() -> None:
    """A stage whose chunks are 40 % of the step (forward and backward from the schedule's chunks): the
    rest is its wait for the neighbouring stage, which the verdict's reason names."""
    from types import SimpleNamespace

    from hpar_agent.collectors.phases import OPT0
    from hpar_agent.spans import StepRecord

    ms = 1_000_000
    pipe = SimpleNamespace(
        wrapped=True, phase_by_step={}, first_forward_ns={}, intervals_by_step={}, eval_end_ns={}, bubbles=[]
    )
    c = AnatomyCollector()
    c._pipe = pipe
    for step in range(6):
        t = step * 100 * ms
        pipe.phase_by_step[step] = {"forward": 0.02, "backward": 0.02}
        pipe.bubbles.append((step, 0.6))
        c._events[step] = [(OPT0, t + 99 * ms, 0, None)]
        c.on_step(StepRecord(step=step, start_ns=t, end_ns=t + 100 * ms))
    c.end_pass()
    assert c.verdict == "unknown", c.evidence
    assert c.evidence["reason"] == (
        "the phases explain 41% of the step (anatomy.min_explained 60%); the rest is "
        "mostly the pipeline's bubble (60% of the step, hpar_pp_bubble_ratio): the "
        "stage waits for its neighbours"
    )
