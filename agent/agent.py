"""The Agent: owns the components, the agent thread, the outputs and the agent's own health."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from hpar_agent import health
from hpar_agent._version import __version__
from hpar_agent.agent_thread import AgentThread
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
from hpar_agent.lifecycle import ProcessHooks
from hpar_agent.outputs import Outputs
from hpar_agent.rankstate import RankState
from hpar_agent.span_schedule import SpanScheduler
from hpar_agent.spans import Child
from hpar_agent.topology import LOCAL_JOB_PREFIX, Topology, detect
from hpar_agent.torch_compat import pipelining

log = logging.getLogger("hpar_agent")

_current: Agent | None = None
_lock = threading.Lock()


class Agent:
    """One per process. Use ``hpar_agent.attach()``; ``Agent`` is also a context manager.

    It owns the components and what they see of it (``context``); its other jobs are held by parts:
    the agent thread and its passes (``loop``: ``agent_thread``), where results go (``outputs``: run
    directory, event log, endpoint, tracing) and its hooks on the process (``exits``: ``lifecycle``)."""

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
        self.started = False
        self.topology: Topology = Topology()
        self.device: Any = None  # torch.device of this rank, fixed at start (see hpar_agent.device)
        self.components: list[Component] = []
        self._step_hooks: list[Component] = []
        self.registry = CollectorRegistry(auto_describe=True)
        self.families = Families(["0", "0"])
        self.errors: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self.span_schedule = SpanScheduler()  # completed steps and child spans until they are due
        self.loop = AgentThread(self)
        self.outputs = Outputs(self.config, self.record_error, self.errors)
        self.exits = ProcessHooks(self)
        self.flops_per_token: float | None = None  # agent.report_flops: the MFU inputs
        self.peak_flops: float | None = None
        self.alert_callbacks = AlertCallbacks(self.record_error)
        self._context: AgentContext | None = None

    @property
    def context(self) -> AgentContext:
        """What components see of this agent; built on first use from the agent's state then (``start``
        builds it once the topology, families and event log are known)."""
        if self._context is None:
            out = self.outputs
            self._context = AgentContext(
                config=self.config,
                topology=self.topology,
                families=self.families,
                events=out.events,
                record_error=self.record_error,
                spans=self,
                on_step_boundary=self.on_step_boundary,
                is_stopping=self.loop.stop_event.is_set,
                wait=self.loop.wait,
                dispatch_alert=self._dispatch_alert,
                device=self.device,
                model=self.model,
                optimizer=self.optimizer,
                mesh=self.mesh,
                run_dir=out.run_dir,
                components=self.components,
                redetect=self.redetect,
            )
        return self._context

    # ------------------------------------------------------------------------------------ outputs
    @property
    def metrics_url(self) -> str | None:
        """The URL of this rank's metrics endpoint as really bound (None: no endpoint)."""
        return self.outputs.metrics_url

    @property
    def server(self) -> Any:
        """This rank's metrics endpoint (``exporters.prometheus``); None when it serves none."""
        return self.outputs.server

    @property
    def tracing(self) -> Any:
        """This rank's span pipeline (``exporters.otel.Tracing``); None when spans go nowhere."""
        return self.outputs.tracing

    @property
    def events(self) -> EventLog:
        """This rank's event log."""
        return self.outputs.events

    @property
    def run_dir(self) -> str:
        """This rank's run directory ("": none, and no file is written)."""
        return self.outputs.run_dir

    @property
    def collect_seconds(self) -> dict[str, float]:
        """component -> seconds its last poll took (``hpar_agent_collect_duration_seconds``)."""
        return self.loop.collect_seconds

    def _dispatch_alert(self, alert: Alert) -> None:
        self.alert_callbacks.dispatch(alert)  # read at call time: a forked child gets fresh callbacks

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Agent:
        """Detect the topology, install every component and start the agent thread and endpoint."""
        if not self.enabled or self.started:
            return self
        self.started = True
        from hpar_agent import topology_watch as watch
        from hpar_agent.device import resolve_device

        topo = detect(self.model, self.mesh, self.config, stages=watch.stages())
        self.device = resolve_device(self.model, self.mesh, topo.local_rank)
        self.topology = topo = dataclasses.replace(topo, device=str(self.device))
        self.families = Families([str(topo.rank), str(topo.pp_stage)])
        out = self.outputs
        out.open_run_dir(topo.job_id)
        out.events = out.event_log(topo.rank)
        out.events.emit("attach", topology=topo.info_labels(), agent_version=__version__)
        self._context = None  # built from the attached state
        for comp in default_components(self.config):
            self.add_component(comp)
        self.registry.register(health.AgentCollector(self))
        out.start_tracing(self.context)
        out.start_endpoint(self.registry, topo.local_rank)
        self.loop.start()
        self.exits.install()
        return self

    def redetect(self, *, wait: bool = True, in_pass: bool = False) -> bool:
        """Detect this rank's topology again and apply what changed; True when something did.

        ``TopologyWatch`` calls it when a process group, a data-parallel wrapper, a mesh or a pipeline
        stage was built, or a schedule's stages first seen (on the training thread, ``wait`` False:
        not while a pass runs), in the next pass (``in_pass``:
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
        if not self.loop.lock.acquire(timeout=5.0 if wait else 0):
            return False
        try:
            return self._redetect()
        finally:
            self.loop.lock.release()

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
        new = detect(model, mesh, self.config, job_id=keep_job, stages=watch.stages())
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
        self.outputs.move(old, new, ctx, self.registry)
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
        self.exits.uninstall()
        self.loop.stop(timeout)
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
        self.outputs.close_exporters(timeout)
        self.write_summary()
        self.guard("events", self.events.emit, "detach")
        self.guard("events", self.events.close)

    def flush(self, timeout: float = 5.0) -> None:
        """Export finished steps and queued spans, and write the summary, within about ``timeout``;
        the agent keeps running (a signal handler calls this before the previous handler)."""
        if not self.started:
            return
        if self.loop.lock.acquire(timeout=timeout / 2):  # not if this thread was stopped mid-tick
            self.loop.lock.release()
            self.guard("agent", self.tick, True)
        if self.tracing is not None:
            self.guard("tracing", self.tracing.flush, timeout / 2)
        self.write_summary()

    def forget_in_child(self) -> None:
        """After fork, in the child (a DataLoader worker, a ``multiprocessing`` fork), which inherits the
        agent's objects but none of its threads: each part forgets what it holds of the parent's
        (``lifecycle``). Takes no lock another thread may have held at fork time."""
        self.started = False
        self.enabled = False
        self.exits.forget_in_child()
        self.loop.forget_in_child()
        self.outputs.forget_in_child()
        # the callbacks' worker thread did not survive the fork; its lock may have been held
        self.alert_callbacks = AlertCallbacks(self.record_error)

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
        """Time every forward/backward chunk of these PipelineStages, or of the schedule's stages (the
        stages a program builds after attach, or a schedule runs, are timed without it)."""
        pipe = self.context.find(PipelineCollector)
        if pipe is None:
            return
        stages = list(stages)
        if schedule is not None and not stages:
            stages = pipelining.schedule_stages(schedule)
        if any(s is not None for s in stages):
            from hpar_agent import topology_watch

            topology_watch.notify("stage", [s for s in stages if s is not None])  # where this rank sits
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
        return self.outputs.tracing is not None

    def add_span(self, span: Child) -> None:
        """Agent thread: a child span of ``span.step``'s trace, exported when that step completes."""
        self.span_schedule.add_span(span)

    @property
    def stopping(self) -> bool:
        """True from ``stop()`` on: the final tick reads every source in full."""
        return self.loop.stopping

    def tick(self, final: bool = False) -> None:
        """One agent-thread pass (``AgentThread.tick``): poll every component, then finish completed steps."""
        self.loop.tick(final)


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
    from hpar_agent.collectors.goodput import GoodputCollector
    from hpar_agent.collectors.gpu_health import GpuHealthCollector
    from hpar_agent.collectors.gradsync import GradSyncCollector
    from hpar_agent.collectors.mfu import MfuCollector
    from hpar_agent.collectors.oom import OomCollector

    comps: list[Component] = [
        TopologyWatch(),
        RankState(),
        StepCollector(),
        PipelineCollector(),
        AnatomyCollector(),
    ]
    comps += [CollectiveCollector(), GradSyncCollector(), NvmlCollector(), MemoryCollector(), OomCollector()]
    comps += [GpuHealthCollector(), MfuCollector()]
    comps.append(CompileCollector())
    if config.detectors:
        comps.append(DetectorsComponent())
    comps.append(GoodputCollector())  # last: it reads the others' conclusions of the pass
    return comps


# ---------------------------------------------------------------------------------------- module API
def attach_agent(
    model: Any = None,
    *,
    optimizer: Any = None,
    mesh: Any = None,
    config: AgentConfig | None = None,
    **overrides: Any,
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
        target.forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["Agent", "Alert", "attach_agent", "current", "detach_agent"]
