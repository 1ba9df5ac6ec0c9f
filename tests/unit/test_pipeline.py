"""The pipeline collector: chunk bookkeeping never raises into the schedule, chunks of a step without
detail are not timed, and chunk spans carry the CUDA stream handle beside its name."""

from __future__ import annotations

import time

import torch

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.spans import realize


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


def test_an_evaluations_chunks_are_no_steps_and_end_its_host_time(tmp_path):
    """A forward chunk without grad, or of a schedule with no backward (``schedule.eval()``), is no
    training chunk: it is kept only as the end of the step's evaluation, even on a step without detail
    (which it gives the detail), and that step gets no bubble ratio."""
    from types import SimpleNamespace

    from hpar_agent.spans import StepRecord

    agent = Agent(metrics_port=-1, traces="none", run_dir=str(tmp_path))
    agent.start()
    try:
        pipe, steps = agent.component("pipeline"), agent.component("steps")
        stage = SimpleNamespace(device=None, stage_index=1, has_backward=True)
        forward = pipe._wrap(stage, lambda *a, **k: "ran", "forward")
        steps.detailed = False
        steps.count = 4
        with torch.no_grad():
            assert forward(0) == "ran"  # an evaluation under no_grad
        assert steps.detailed
        stage.has_backward = False  # schedule.eval() with grad on
        assert forward(1) == "ran"
        stage.has_backward = True
        t_eval = time.time_ns()
        assert forward(0) == "ran"  # the step's own training chunk
        pipe.poll(time.time())
        assert 0 < pipe.eval_end_ns[4] <= t_eval
        assert pipe.phase_by_step[4].keys() == {"forward"} and pipe.first_forward_ns == {}  # stage 1
        assert sum(h.count for h in pipe.hists.values()) == 1  # the evaluation's chunks are not timed
        s = 10**9
        pipe.on_step(StepRecord(step=4, start_ns=s, end_ns=3 * s))
        assert pipe.bubbles == [] and pipe.last_bubble is None
        pipe.busy_by_step[5] = 1.0
        pipe.on_step(StepRecord(step=5, start_ns=3 * s, end_ns=5 * s))
        assert pipe.bubbles == [(5, 0.5)]
    finally:
        agent.stop()


class _Stream:
    stream_id, cuda_stream = 3, 0x7F3A00001000


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object) -> None:
        assert stream is _STREAM

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 2.0  # ms


_STREAM = _Stream()


def test_chunk_spans_carry_the_stream_handle_beside_its_name(tmp_path, monkeypatch) -> None:

    from hpar_agent.collectors.pipeline import PipelineCollector

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _STREAM)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    class Stage:
        device, stage_index = torch.device("cuda", 0), 1

        def forward_one_chunk(self, chunk: int) -> str:
            return "out"

    ag = Agent(None, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    ag.outputs.tracing = object()  # spans on (tracing_on), no exporter needed: add_span only queues
    pipe = PipelineCollector()
    ag.add_component(pipe)
    stage = Stage()
    pipe.watch([stage])
    assert stage.forward_one_chunk(0) == "out"
    pipe.poll(time.time())
    (span,) = [realize(s) for spans in ag.span_schedule.pending.values() for s in spans]
    assert span.attributes[cat.ATTR_STREAM] == "cuda:3"
    assert span.attributes[cat.ATTR_STREAM_HANDLE] == 0x7F3A00001000
    assert span.end_ns - span.start_ns == 2_000_000
    pipe.uninstall()
