"""Span-export scheduling (``span_schedule``): late child spans, bounds, and the final flush."""

from __future__ import annotations

from types import SimpleNamespace

from hpar_agent.agent import Agent
from hpar_agent.agent_thread import AgentThread
from hpar_agent.component import Component
from hpar_agent.span_schedule import KEEP_BEHIND, SpanScheduler
from hpar_agent.spans import SpanRecord, StepRecord

S = 10**9


def _step(n: int, end_ns: int) -> StepRecord:
    return StepRecord(n, end_ns - S, end_ns)


def _span(step: int, name: str = "collective.all_reduce") -> SpanRecord:
    return SpanRecord(name, step * S, step * S + 1, step)


def test_a_late_child_span_waits_for_the_watermark_to_pass_the_step_end():
    sched = SpanScheduler(wait_ns=30 * S)
    sched.add_step(_step(0, 100 * S))
    assert sched.due(now_ns=101 * S, mark_ns=99 * S) == []  # a source has not read past the step's end
    sched.add_span(_span(0))  # the FR read that delivers the step's collective
    (rec,) = sched.due(now_ns=102 * S, mark_ns=100 * S)
    assert rec.step == 0 and [s.name for s in rec.children] == ["collective.all_reduce"]
    assert not sched.pending and not sched.unexported


def test_a_step_waits_at_most_wait_ns():
    sched = SpanScheduler(wait_ns=30 * S)
    sched.add_step(_step(0, 100 * S))
    sched.add_step(_step(1, 120 * S))
    assert sched.due(now_ns=130 * S, mark_ns=0) == []  # watermark stuck (a hung read)
    assert [r.step for r in sched.due(now_ns=131 * S, mark_ns=0)] == [0]  # 30 s after its end
    assert [r.step for r in sched.due(now_ns=151 * S, mark_ns=0)] == [1]


def test_the_queue_and_each_steps_spans_are_bounded():
    sched = SpanScheduler(max_unexported=3, max_spans_per_step=2)
    for n in range(5):
        sched.add_step(_step(n, (100 + n) * S))
    for _ in range(5):
        sched.add_span(_span(4))
    assert [r.step for r in sched.due(now_ns=105 * S, mark_ns=0)] == [0, 1]  # oldest go past the bound
    assert len(sched.unexported) == 3 and len(sched.pending[4]) == 2


def test_final_hands_over_every_step_and_old_orphan_spans_are_dropped():
    sched = SpanScheduler()
    sched.add_span(_span(0))  # its step never completed on this rank
    sched.add_step(_step(KEEP_BEHIND + 1, 500 * S))
    sched.add_step(_step(KEEP_BEHIND + 2, 501 * S))
    sched.add_span(_span(KEEP_BEHIND + 2))
    out = sched.due(now_ns=502 * S, mark_ns=0, final=True)
    assert [(r.step, len(r.children)) for r in out] == [(KEEP_BEHIND + 1, 0), (KEEP_BEHIND + 2, 1)]
    assert 0 not in sched.pending  # more than KEEP_BEHIND steps behind the last exported one


class _Source(Component):
    def __init__(self, name: str, mark: int | None, up: bool = True, fail: bool = False) -> None:
        super().__init__()
        self.name, self.mark, self.up, self.fail = name, mark, up, fail

    def span_watermark_ns(self) -> int | None:
        if self.fail:
            raise RuntimeError("broken source")
        return self.mark


def test_watermark_is_the_earliest_source_that_is_up_and_a_failing_one_is_reported():
    errors: list[tuple[str, str]] = []
    sources = [
        _Source("a", 50),
        _Source("b", None),
        _Source("down", 10, up=False),
        _Source("bad", 1, fail=True),
    ]
    assert SpanScheduler().watermark(sources, 100, lambda n, e: errors.append((n, str(e)))) == 50
    assert errors == [("bad", "broken source")]
    assert SpanScheduler().watermark([], 100, lambda n, e: None) == 100


def test_agent_holds_a_step_for_a_lagging_source_and_flushes_it_on_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(AgentThread, "_run", lambda self: None)  # only the test's own ticks
    agent = Agent(metrics_port=-1, traces="file", run_dir=str(tmp_path), trace_every=1, job_id="j")
    agent.start()
    exported: list[tuple[int, list[str]]] = []
    agent.outputs.tracing = SimpleNamespace(
        export_step=lambda r: exported.append((r.step, [s.name for s in r.children])), shutdown=lambda t: None
    )
    lagging = _Source("lagging", 0)  # has delivered nothing yet
    agent.add_component(lagging)
    try:
        agent.step()
        agent.step()  # step 0 completes
        agent.add_span(_span(0, "late.child"))
        agent.tick()
        assert exported == []  # waits for the lagging source
    finally:
        agent.stop()
    assert exported == [(0, ["late.child"]), (1, [])]  # stop also ends the step in progress
