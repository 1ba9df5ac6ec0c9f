"""The Agent: owns the components, the agent thread, the exporters and the agent's own health."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from hpar_agent import gil, health
from hpar_agent._version import __version__
from hpar_agent.alert_callbacks import Alert, AlertCallbacks
from hpar_agent.collectors.memory import MemoryCollector, NvmlCollector
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.collectors.topology import TopologyWatch
from hpar_agent.component import Component
from hpar_agent.config import AgentConfig
from hpar_agent.context import AgentContext
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.events import EventLog
from hpar_agent.families import Families
from hpar_agent.gil import Yielder
from hpar_agent.lifecycle import AtExit, ExceptHook, SignalFlush, forget_in_child
from hpar_agent.rankstate import RankState
from hpar_agent.safefiles import RUNS_DIR, UnsafePathError, default_run_dir, private_dir
from hpar_agent.span_schedule import SpanScheduler
from hpar_agent.spans import Child, StepRecord
from hpar_agent.topology import LOCAL_JOB_PREFIX, Topology, detect
from hpar_agent.torch_compat import pipelining

log = logging.getLogger("hpar_agent")

_current: Agent | None = None
_lock = threading.Lock()


class Agent:
    """One per process. Use ``hpar_agent.attach()``; ``Agent`` is also a context manager."""

    def __init__(
        self,
        model: Any = None,
        *,
        optimizer: Any = None,
        mesh: Any = None,
        config: AgentConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.config = AgentConfig.load(config, overrides)
        self.model = model
        self.optimizer = optimizer
        self.mesh = mesh
        self.enabled = not self.config.disable
        self.topology: Topology = Topology()
        self.device: Any = None  # torch.device of this rank, fixed at start (see hpar_agent.device)
        self.components: list[Component] = []
        self.registry = CollectorRegistry(auto_describe=True)
        self.families = Families(["0", "0"])
        self.errors: Counter[str] = Counter()
        self.collect_seconds: dict[str, float] = {}
        self._logged: set[tuple[str, str]] = set()
        self._step_hooks: list[Component] = []
        self.span_schedule = SpanScheduler()  # completed steps and child spans until they are due
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_lock = threading.Lock()
        self._final_pass = False  # the pass running now is a final one (detach, flush)
        self._waited = 0.0  # seconds passes spent in ``_wait`` (not work: left out of collect_seconds)
        self.events = EventLog(None, 0)
        self.metrics_url: str | None = None
        self.run_dir = ""
        self.server: Any = None
        self._signals: SignalFlush | None = None
        self._excepthook: ExceptHook | None = None
        self._at_exit: AtExit | None = None
        self.tracing: Any = None
        self.started = False
        self.flops_per_token: float | None = None  # agent.report_flops: the MFU inputs
        self.peak_flops: float | None = None
        self.alert_callbacks = AlertCallbacks(self.record_error)
        self._context: AgentContext | None = None

    @property
    def context(self) -> AgentContext:
        """What components see of this agent; built on first use from the agent's state then (``start``
        builds it once the topology, families and event log are known)."""
        if self._context is None:
            self._context = AgentContext(
                config=self.config, topology=self.topology, families=self.families, events=self.events,
                record_error=self.record_error, spans=self, on_step_boundary=self.on_step_boundary,
                is_stopping=self._stop.is_set, wait=self._wait, dispatch_alert=self._dispatch_alert, device=self.device,
                model=self.model, optimizer=self.optimizer, mesh=self.mesh, run_dir=self.run_dir,
                components=self.components, redetect=self.redetect,
            )  # fmt: skip
        return self._context

    def _dispatch_alert(self, alert: Alert) -> None:
        self.alert_callbacks.dispatch(alert)  # read at call time: a forked child gets fresh callbacks

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Agent:
        """Detect the topology, install every component and start the agent thread and endpoint."""
        if not self.enabled or self.started:
            return self
        self.started = True
        from hpar_agent.device import resolve_device

        topo = detect(self.model, self.mesh, self.config)
        self.device = resolve_device(self.model, self.mesh, topo.local_rank)
        self.topology = topo = dataclasses.replace(topo, device=str(self.device))
        self.families = Families([str(topo.rank), str(topo.pp_stage)])
        self.run_dir = self.config.run_dir or os.path.join(RUNS_DIR, topo.job_id)
        try:
            if self.config.run_dir:
                private_dir(self.run_dir, chosen=True)
            else:
                default_run_dir(topo.job_id)  # 0700, not a link, ours: the parent too
        except OSError as exc:
            self.record_error("agent", exc)
            if isinstance(exc, UnsafePathError):
                self.run_dir = ""  # write no file rather than into a planted link
        self.events = self._event_log(topo.rank)
        self.events.emit("attach", topology=topo.info_labels(), agent_version=__version__)
        self._context = None  # built from the attached state
        for comp in default_components(self.config):
            self.add_component(comp)
        self.registry.register(health.AgentCollector(self))
        self._start_tracing()
        self._start_endpoint()
        self._thread = threading.Thread(target=self._run, name="hpar-agent", daemon=True)
        self._thread.start()
        self._at_exit = AtExit(self.stop)  # flush traces and write the summary if the user never detaches
        self._at_exit.install()
        self._signals = SignalFlush(self)
        self.guard("agent", self._signals.install)  # SIGTERM/SIGINT: flush, then what they did before
        self._excepthook = ExceptHook(self)
        self._excepthook.install()  # an uncaught exception: how the rank ended (rankstate, RankGone)
        return self

    def _event_log(self, rank: int) -> EventLog:
        if not (self.config.event_log and self.run_dir):
            return EventLog(None, rank)
        try:
            return EventLog(
                os.path.join(self.run_dir, f"events.rank{rank}.jsonl"), rank,
                max_bytes=self.config.log_max_bytes,
                on_error=lambda exc: self.record_error("events", exc),
            )  # fmt: skip
        except OSError as exc:
            self.record_error("events", exc)
            return EventLog(None, rank)

    def redetect(self, *, wait: bool = True, in_pass: bool = False) -> bool:
        """Detect this rank's topology again and apply what changed; True when something did.

        ``TopologyWatch`` calls it when a process group, a data-parallel wrapper or a mesh was built
        (on the training thread, ``wait`` False: not while a pass runs), in the next pass (``in_pass``:
        the pass holds the lock), and before the default group is destroyed (``wait``: for a pass in
        progress, at most a few seconds, else the topology stays as it is). The sources: the mesh given
        to ``attach``, else the job's mesh the program built; the wrapper the program built around the
        model given (or any, with none given), else that model. A new rank or stage relabels every
        series (the families' common labels), a new rank moves the event log to
        ``events.rank<R>.jsonl`` (and a local traces file to ``traces.rank<R>.jsonl``), a new local
        rank the endpoint to its port; spans built from then on carry the new topology."""
        if self._context is None:  # never started
            return False
        if in_pass:
            return self._redetect()
        if not self._tick_lock.acquire(timeout=5.0 if wait else 0):
            return False
        try:
            return self._redetect()
        finally:
            self._tick_lock.release()

    def _redetect(self) -> bool:
        from hpar_agent import topology_watch as watch
        from hpar_agent.torch_compat.parallel import world_size

        old = self.topology
        world = world_size()
        if world is None and old.backend != "none":
            return False  # the group is gone (exit): what it said stays, the environment would not say it
        model = _outermost(self.model, watch.wrapper())
        mesh = self.mesh if self.mesh is not None else watch.mesh(world)
        keep_job = None if world is not None and old.job_id.startswith(LOCAL_JOB_PREFIX) else old.job_id
        new = detect(model, mesh, self.config, job_id=keep_job)
        device = self.device
        if new.local_rank != old.local_rank:
            from hpar_agent.device import resolve_device

            device = resolve_device(model, mesh, new.local_rank)
        new = dataclasses.replace(new, device=str(device))
        if new == old:
            return False
        self._apply_topology(old, new, device)
        return True

    def _apply_topology(self, old: Topology, new: Topology, device: Any) -> None:
        self.topology, self.device = new, device
        ctx = self.context
        ctx.topology, ctx.device = new, device
        self.families.common = [str(new.rank), str(new.pp_stage)]
        if new.rank != old.rank:
            events, self.events = self.events, self._event_log(new.rank)
            self.events.recent = events.recent  # the records of this process so far, whatever file
            ctx.events = self.events
            self.guard("events", events.close)
        if new.local_rank != old.local_rank and self.server is not None:
            from hpar_agent.exporters.prometheus import close_endpoint

            self.guard("prometheus", close_endpoint, self.server)
            self.server = self.metrics_url = None
            self._start_endpoint()
        if self.tracing is not None and not self.guard("tracing", self.tracing.retopologize, new):
            tracing, self.tracing = self.tracing, None  # a new rank's local traces file
            self.guard("tracing", tracing.shutdown, 2.0)
            self._start_tracing()
        changed = {k: v for k, v in new.info_labels().items() if old.info_labels().get(k) != v}
        if new.rank != old.rank:
            changed["rank"] = str(new.rank)
        if new.pp_stage != old.pp_stage:
            changed["pp_stage"] = str(new.pp_stage)
        self.events.emit("topology", topology=new.info_labels(), changed=changed)
        for comp in self.components:
            try:
                comp.on_topology(old, new)
            except Exception as exc:
                self.record_error(comp.name, exc)

    def add_component(self, comp: Component) -> None:
        try:
            comp.install(self.context)
        except Exception as exc:
            comp.up = False
            self.record_error(comp.name, exc)
        self.components.append(comp)
        if type(comp).step_hook is not Component.step_hook:
            self._step_hooks.append(comp)

    def stop(self, timeout: float = 5.0) -> None:
        """Remove every hook, stop the thread, flush traces (bounded) and close the endpoint."""
        if not self.started:
            return
        self.started = False
        if self._at_exit is not None:
            self._at_exit.uninstall()
        if self._signals is not None:
            self.guard("agent", self._signals.uninstall)
        if self._excepthook is not None:
            self._excepthook.uninstall()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.tick(final=True)  # final drain so the last steps reach the exporters
        except Exception as exc:
            self.record_error("agent", exc)
        self.alert_callbacks.stop()
        for comp in reversed(self.components):
            try:
                comp.uninstall()
            except Exception as exc:
                self.record_error(comp.name, exc)
        if self.tracing is not None:
            try:
                self.tracing.shutdown(timeout)
            except Exception as exc:
                self.record_error("tracing", exc)
        if self.server is not None:
            from hpar_agent.exporters.prometheus import close_endpoint

            close_endpoint(self.server)
            self.server = None
        self.write_summary()
        self.guard("events", self.events.emit, "detach")
        self.guard("events", self.events.close)

    def flush(self, timeout: float = 5.0) -> None:
        """Export finished steps and queued spans, and write the summary, within about ``timeout``;
        the agent keeps running (a signal handler calls this before the previous handler)."""
        if not self.started:
            return
        if self._tick_lock.acquire(timeout=timeout / 2):  # not if this thread was stopped mid-tick
            self._tick_lock.release()
            self.guard("agent", self.tick, True)
        if self.tracing is not None:
            self.guard("tracing", self.tracing.flush, timeout / 2)
        self.write_summary()

    def summary(self) -> dict[str, Any]:
        """Everything the demo and the run report show for this rank."""
        return health.summary(self)

    def write_summary(self) -> None:
        """Write ``summary.rank<R>.json`` into the run directory (read by ``hpar-agent demo``)."""
        health.write_summary(self)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        detach_agent(self)

    # ------------------------------------------------------------------------------------ training API
    def step(self, tokens: int | None = None) -> None:
        """Mark a step boundary (for loops without an optimizer step) and optionally report tokens."""
        steps = self.context.find(StepCollector)
        if steps is not None:
            steps.mark(tokens=tokens, explicit=True)

    def report_tokens(self, tokens: int) -> None:
        """Tokens processed in the current step (feeds ``hpar_tokens_total``)."""
        steps = self.context.find(StepCollector)
        if steps is not None:
            steps.tokens_pending += tokens

    def report_flops(self, per_token: float | None = None, peak: float | None = None) -> None:
        """Model FLOPs this rank performs per token it reports, and its accelerator's peak FLOP/s: the
        two gauges an MFU panel divides by (the agent cannot know either; None leaves a value as is,
        a non-finite or negative one is ignored)."""
        for attr, value in (("flops_per_token", per_token), ("peak_flops", peak)):
            if value is not None:
                try:
                    v = float(value)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(v) and v >= 0:
                    setattr(self, attr, v)

    def watch_pipeline(self, stages: Iterable[Any] = (), schedule: Any = None) -> None:
        """Time every forward/backward chunk of these PipelineStages, or of the schedule's stages."""
        pipe = self.context.find(PipelineCollector)
        if pipe is None:
            return
        stages = list(stages)
        if schedule is not None and not stages:
            stages = pipelining.schedule_stages(schedule)
        self.guard("pipeline", pipe.watch, [s for s in stages if s is not None], schedule)

    def on_alert(self, callback: Callable[[Alert], Any]) -> None:
        """Call ``callback(alert)`` on every alert transition (``alert.state``: firing, resolved), on a
        worker thread of its own: a slow or raising callback never blocks training nor the detectors."""
        self.alert_callbacks.add(callback)

    def active_alerts(self) -> list[Alert]:
        """The alerts active on this rank now, with their value, details and evidence."""
        det = self.context.find(DetectorsComponent)
        return det.active_alerts() if det is not None else []

    def component(self, name: str) -> Component | None:
        """The component whose ``name`` (its ``component`` label) is ``name``."""
        for c in self.components:
            if c.name == name:
                return c
        return None

    # ------------------------------------------------------------------------------------ internals
    def record_error(self, component: str, exc: BaseException) -> None:
        """Count an exception of a component and log it once per (component, type)."""
        self.errors[component] += 1
        key = (component, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            log.warning("hpar_agent: %s failed (%s: %s); training continues", component, key[1], exc)

    def guard(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.record_error(component, exc)
            return None

    def on_step_boundary(self, step: int, t_ns: int) -> None:
        """Training thread: fan the step boundary out to components' O(µs) step hooks."""
        for comp in self._step_hooks:
            try:
                comp.step_hook(step, t_ns)
            except Exception as exc:
                self.record_error(comp.name, exc)

    @property
    def tracing_on(self) -> bool:
        """Whether spans go anywhere: components build no ``SpanRecord`` otherwise."""
        return self.tracing is not None

    def add_span(self, span: Child) -> None:
        """Agent thread: a child span of ``span.step``'s trace, exported when that step completes."""
        self.span_schedule.add_span(span)

    @property
    def stopping(self) -> bool:
        """True from ``stop()`` on: the final tick reads every source in full."""
        return self._stop.is_set()

    def _until_next_tick(self) -> float:
        """Seconds to the next multiple of the interval on the wall clock. Every rank's agent then
        works at the same instants: a synchronous job stalls whenever any one rank stalls, so passes
        at random phases would add up over the ranks, aligned ones overlap."""
        iv = self.config.interval
        return iv - time.time() % iv

    def _run(self) -> None:
        while not self._stop.wait(self._until_next_tick()):
            try:
                self.tick()
            except Exception as exc:  # never let the thread die
                self.record_error("agent", exc)

    def tick(self, final: bool = False) -> None:
        """One agent-thread pass: poll every component, then finish completed steps. The pass hands
        the GIL back to the training thread every millisecond or so of work (``gil.Yielder``)."""
        with self._tick_lock, gil.running(Yielder()) as handback:
            self._final_pass = final
            try:
                self._pass(time.time(), final, handback)
            finally:
                self._final_pass = False

    def _wait(self, seconds: float) -> None:
        """``AgentContext.wait``: on the stop event, so ``stop()`` ends it at once; not at all on a final
        pass, which must end soon (a flush on a signal has a few seconds in all)."""
        if seconds > 0 and not self._final_pass:
            t0 = time.perf_counter()
            self._stop.wait(seconds)
            self._waited += time.perf_counter() - t0

    def _pass(self, now: float, final: bool, handback: Yielder) -> None:
        """Poll, then each completed step to every component, then the once-a-pass work and the export."""
        for comp in self.components:
            t0, waited = time.perf_counter(), self._waited
            try:
                comp.poll(now)
            except Exception as exc:
                self.record_error(comp.name, exc)
            self.collect_seconds[comp.name] = time.perf_counter() - t0 - (self._waited - waited)
            handback()
        steps = self.context.find(StepCollector)
        completed: list[StepRecord] = steps.take_completed() if steps is not None else []
        takers = [c for c in self.components if _overrides(c, "on_step")]  # a no-op call per step otherwise
        for rec in completed:
            for comp in takers:
                try:
                    comp.on_step(rec)
                except Exception as exc:
                    self.record_error(comp.name, exc)
            self.span_schedule.add_step(rec)
            handback()
        for comp in self.components:
            try:
                comp.end_pass()
            except Exception as exc:
                self.record_error(comp.name, exc)
        self._export_steps(final, handback)

    def _export_steps(self, final: bool, handback: Yielder) -> None:
        """Hand completed steps with their child spans to tracing when they are due (``span_schedule``:
        every span source delivered the spans before the step's end, or waited long enough)."""
        now = time.time_ns()
        waits = not final and self.tracing is not None  # without tracing no step waits for anything
        mark = self.span_schedule.watermark(self.components, now, self.record_error) if waits else now
        for rec in self.span_schedule.due(now, mark, final):
            if self.tracing is not None:
                self.guard("tracing", self.tracing.export_step, rec)
                handback()

    def _start_endpoint(self) -> None:
        if self.config.metrics_port < 0:
            return
        from hpar_agent.exporters.endpoint_security import WebConfigError
        from hpar_agent.exporters.prometheus import open_endpoint

        try:
            self.server, self.metrics_url = open_endpoint(
                self.registry, self.config, self.topology.local_rank
            )
        except WebConfigError as exc:  # security fails closed: no endpoint rather than a weaker one
            self.errors["prometheus"] += 1
            log.error("hpar_agent: no metrics endpoint on this rank: %s (training goes on)", exc)
        except Exception as exc:
            self.record_error("prometheus", exc)

    def _start_tracing(self) -> None:
        if self.config.traces == "none" or self.config.trace_every == 0:
            return
        try:
            from hpar_agent.exporters.otel import Tracing
        except ImportError as exc:
            self.record_error("tracing", exc)
            return
        try:
            self.tracing = Tracing(self.context)
        except Exception as exc:
            self.record_error("tracing", exc)



def _overrides(comp: Component, method: str) -> bool:
    """Whether ``comp`` has its own ``method`` rather than ``Component``'s no-op (an instance attribute
    counts as its own)."""
    return getattr(getattr(comp, method), "__func__", None) is not getattr(Component, method)


def _outermost(given: Any, wrapper: Any) -> Any:
    """The model to read the topology from: the wrapper the program built when it wraps the model given
    to ``attach`` (a framework's DDP around the user's module) or none was given, else the model."""
    if given is None or wrapper is None or wrapper is given:
        return given if wrapper is None else wrapper
    try:
        return wrapper if any(m is given for m in wrapper.modules()) else given
    except Exception:
        return given


def default_components(config: AgentConfig) -> list[Component]:
    """The components ``attach()`` installs, in poll order (the topology first: a pass that re-detects it
    polls the others with the new one; the detectors last: they read the others)."""
    from hpar_agent.collectors.anatomy import AnatomyCollector
    from hpar_agent.collectors.collectives import CollectiveCollector
    from hpar_agent.collectors.compile import CompileCollector
    from hpar_agent.collectors.gradsync import GradSyncCollector
    from hpar_agent.collectors.oom import OomCollector

    comps: list[Component] = [TopologyWatch(), RankState(), StepCollector(), PipelineCollector(), AnatomyCollector()]
    comps += [CollectiveCollector(), GradSyncCollector(), NvmlCollector(), MemoryCollector(), OomCollector()]
    comps.append(CompileCollector())
    if config.detectors:
        comps.append(DetectorsComponent())
    return comps


# ---------------------------------------------------------------------------------------- module API
def attach_agent(
    model: Any = None, *, optimizer: Any = None, mesh: Any = None, config: AgentConfig | None = None, **overrides: Any
) -> Agent:
    global _current
    with _lock:
        if _current is not None and _current.started:
            warnings.warn("hpar_agent.attach() called twice; returning the running agent", stacklevel=3)
            return _current
        agent = Agent(model, optimizer=optimizer, mesh=mesh, config=config, **overrides)
        if not agent.enabled:
            return agent
        _current = agent
    try:
        agent.start()
    except Exception as exc:  # attach must never break training
        agent.record_error("agent", exc)
    return agent


def detach_agent(agent: Agent | None = None) -> None:
    global _current
    with _lock:
        target = agent or _current
        if target is None:
            return
        if target is _current:
            _current = None
    target.stop()


def running() -> Agent | None:
    """The running agent, or None; unlike ``current()`` it never attaches (zero-code mode's triggers)."""
    return _current


def current() -> Agent | None:
    """The running agent, or None. In a process ``hpar-agent run`` started, the first call attaches
    when nothing did yet (``autoattach``): ``hpar_agent.current().step()`` marks steps in a loop with
    no optimizer and no process group."""
    if _current is None:
        zerocode = sys.modules.get("hpar_agent.autoattach")  # imported only where the shim armed it
        if zerocode is not None and getattr(zerocode, "ARMED", False):
            zerocode.attach_on_use()
    return _current


def _after_fork_in_child() -> None:
    global _current, _lock
    target, _current = _current, None
    _lock = threading.Lock()  # may have been held by a parent thread at fork time
    if target is not None:
        forget_in_child(target)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["Agent", "Alert", "attach_agent", "current", "detach_agent"]
