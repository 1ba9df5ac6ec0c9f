"""The agent thread: one pass over the components every interval, at the same wall-clock instants on
every rank, and the final pass at detach."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from hpar_agent import gil
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.config import AgentConfig
from hpar_agent.context import AgentContext
from hpar_agent.gil import Yielder
from hpar_agent.span_schedule import SpanScheduler
from hpar_agent.spans import StepRecord


class PassHost(Protocol):
    """What a pass reads of the agent (``Agent``)."""

    config: AgentConfig
    components: list[Component]
    span_schedule: SpanScheduler

    @property
    def context(self) -> AgentContext: ...

    @property
    def tracing(self) -> Any: ...

    def record_error(self, component: str, exc: BaseException) -> None: ...

    def guard(self, component: str, fn: Callable[..., Any], *args: Any) -> Any: ...


class AgentThread:
    """The thread ``hpar-agent``, its passes and their lock (a re-detection waits for the pass in
    progress), and the seconds each component's poll took."""

    def __init__(self, agent: PassHost) -> None:
        self.agent = agent
        self.stop_event = threading.Event()  # set from ``Agent.stop`` on
        self.lock = threading.Lock()  # held by a pass
        self.thread: threading.Thread | None = None
        #: component -> seconds its last poll took (its waits left out)
        self.collect_seconds: dict[str, float] = {}
        self._final = False  # the pass running now is a final one (detach, flush)
        self._waited = 0.0  # seconds passes spent in ``wait`` (not work: left out of collect_seconds)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="hpar-agent", daemon=True)
        self.thread.start()

    def stop(self, timeout: float) -> None:
        """End the thread (a pass in progress finishes first, within ``timeout``)."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)

    def forget_in_child(self) -> None:
        """After fork, in the child: the thread did not survive it."""
        self.thread = None

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def until_next_tick(self) -> float:
        """Seconds to the next multiple of the interval on the wall clock. Every rank's agent then
        works at the same instants: a synchronous job stalls whenever any one rank stalls, so passes
        at random phases would add up over the ranks, aligned ones overlap."""
        iv = self.agent.config.interval
        return iv - time.time() % iv

    def _run(self) -> None:
        while not self.stop_event.wait(self.until_next_tick()):
            try:
                self.tick()
            except Exception as exc:  # never let the thread die
                self.agent.record_error("agent", exc)

    def tick(self, final: bool = False) -> None:
        """One pass: poll every component, then finish completed steps. The pass hands the GIL back to
        the training thread every millisecond or so of work (``gil.Yielder``)."""
        with self.lock, gil.running(Yielder()) as handback:
            self._final = final
            try:
                self._pass(time.time(), final, handback)
            finally:
                self._final = False

    def wait(self, seconds: float) -> None:
        """``AgentContext.wait``: on the stop event, so ``stop()`` ends it at once; not at all on a final
        pass, which must end soon (a flush on a signal has a few seconds in all)."""
        if seconds > 0 and not self._final:
            t0 = time.perf_counter()
            self.stop_event.wait(seconds)
            self._waited += time.perf_counter() - t0

    def _pass(self, now: float, final: bool, handback: Yielder) -> None:
        """Poll, then each completed step to every component, then the once-a-pass work and the export."""
        agent = self.agent
        for comp in agent.components:
            t0, waited = time.perf_counter(), self._waited
            try:
                comp.poll(now)
            except Exception as exc:
                agent.record_error(comp.name, exc)
            self.collect_seconds[comp.name] = time.perf_counter() - t0 - (self._waited - waited)
            handback()
        steps = agent.context.find(StepCollector)
        completed: list[StepRecord] = steps.take_completed() if steps is not None else []
        takers = [c for c in agent.components if _overrides(c, "on_step")]  # a no-op call per step otherwise
        for rec in completed:
            for comp in takers:
                try:
                    comp.on_step(rec)
                except Exception as exc:
                    agent.record_error(comp.name, exc)
            agent.span_schedule.add_step(rec)
            handback()
        for comp in agent.components:
            try:
                comp.end_pass()
            except Exception as exc:
                agent.record_error(comp.name, exc)
        self._export_steps(final, handback)

    def _export_steps(self, final: bool, handback: Yielder) -> None:
        """Hand completed steps with their child spans to tracing when they are due (``span_schedule``:
        every span source delivered the spans before the step's end, or waited long enough)."""
        agent = self.agent
        now = time.time_ns()
        waits = not final and agent.tracing is not None  # without tracing no step waits for anything
        mark = agent.span_schedule.watermark(agent.components, now, agent.record_error) if waits else now
        for rec in agent.span_schedule.due(now, mark, final):
            tracing = agent.tracing
            if tracing is not None:
                agent.guard("tracing", tracing.export_step, rec)
                handback()


def _overrides(comp: Component, method: str) -> bool:
    """Whether ``comp`` has its own ``method`` rather than ``Component``'s no-op (an instance attribute
    counts as its own)."""
    return getattr(getattr(comp, method), "__func__", None) is not getattr(Component, method)
