"""Step anatomy: where each rank's step time goes, and the bottleneck verdict that follows from it.

Phases of step s (from the end of step s-1's optimizer step to the end of step s's): up to the first
forward ``data_wait`` (the part inside the data loader) and ``host`` (the rest: see ``phases``),
``forward``, ``backward``, ``optimizer`` (optimizer step pre-hook to the step boundary). What is left
(loss, clipping, a pipeline's bubble) is "other" in the summary; when the phases explain too little of
the step the verdict is ``unknown`` (``verdict.bottleneck``). ``comm_exposed``: communication time of
the step not hidden by any of those phases (``phases.exposed_ns``), where collective timing exists:
- timed collective intervals of the step from the collectives collector (NCCL flight-recorder durations,
  placed at enqueue), which may arrive a flight-recorder read after the step: the phase waits for them
  (``comm_pending``), at most ``COMM_WAIT_NS``. Pipeline p2p is left out: its waits are the schedule's
  bubble (``hpar_pp_bubble_ratio``), and would name every pipeline communication-bound;
- on the CPU clock, the host's wait in the autograd engine's final callbacks after the backward
  (DDP's reducer waits there for its last buckets, FSDP2/replicate reduce there; gloo records no
  durations): a second engine callback, queued by the backward-end callback and so run after theirs,
  closes it.
On CUDA the other phases are stream times placed from the step's start and the collectives sit at their
host enqueue time, so the overlap is approximate there (a host running ahead of the GPU shifts them).

Hooks, installed at attach, only append ``(step, code, epoch ns)`` to a bounded buffer:
- forward: pre-hook (prepended: the user's own pre-hooks count as forward) and post-hook on the
  model's ROOT module only (global module hooks would cost µs per submodule call): the model given to
  ``attach(model)``, else the one ``model_root`` finds (a wrapper built, or at an optimizer step);
- backward: at forward exit, a hook on the output tensor marks the start of that backward and queues
  an autograd-engine callback (``queue_callback``, as DDP does) that marks its end;
- optimizer: the global optimizer step pre-hook; the step boundary (post-hook) ends it;
- data loader: ``_BaseDataLoaderIter.__next__`` wrapped while attached (time inside the loader).
Pipeline schedules: forward/backward are the pipeline collector's chunk times (CUDA events there on a
GPU), data wait and host end at the first stage-0 forward chunk (CPU clock). Every hook is a no-op
while torch.compile traces, and on the steps a fast loop leaves without detail
(``StepCollector.stride``): those get no phases.

Clock: on CPU, wall clock. On CUDA wall-clock phases would be launch times (the time shows up wherever
the CPU next waits for the GPU, e.g. a loss ``.item()`` in the data wait), so each hook also records a
CUDA event on the current stream (plus one at the end of the optimizer step), and the agent thread
turns them into GPU-stream phases once the step's last event has completed (``query()``, never a
sync), as the pipeline collector does for chunks (``phases.gpu_phases``).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent import topology_watch as watch
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.collectors import model_root
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.phases import (
    BWD0,
    BWD1,
    FWD0,
    FWD1,
    LOAD,
    OPT0,
    OPT1,
    SYNC1,
    cpu_phases,
    exposed_ns,
    gpu_phases,
    host_waits,
)
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.collectors.verdict import bottleneck
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import SpanRecord, StepRecord
from hpar_agent.thresholds import ANATOMY_DEFAULTS
from hpar_agent.torch_compat import autograd, dataloader

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

MAX_WAITING = 256  # CUDA steps whose events have not completed yet
MAX_COMM_WAITING = 8192  # steps whose collectives have not all been read yet (FR reads are periodic)
COMM_WAIT_NS = 30 * 10**9  # then comm_exposed is computed from what was read (a hung op never completes)
BUSY_PHASES = ("data_wait", "host", "forward", "backward", "optimizer")  # disjoint from comm_exposed
PHASES = cat.STEP_PHASES
WARMUP_STEPS = 2  # left out of the verdict: the first steps compile and allocate
WINDOW = 64  # recent steps the shares and the verdict are computed over
MAX_OUTPUTS = 4  # items of a tuple/mapping output looked at for the tensors a backward starts from


def _grad_outputs(out: Any) -> list[Any]:
    """The tensors of a module's output that a backward runs through: the output, or of the first items
    of a tuple, list or mapping (Hugging Face's ``ModelOutput``: loss, logits) those with a grad_fn. The
    loop may call backward on any of them (its own loss from the logits), so each gets the hook; the
    first to run opens the backward, the first end closes it."""
    if getattr(out, "grad_fn", None) is not None:
        return [out]
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    return [t for t in itertools.islice(items, MAX_OUTPUTS) if getattr(t, "grad_fn", None) is not None]


class AnatomyCollector(Component):
    name = "anatomy"

    def __init__(self) -> None:
        super().__init__()
        self.buffer: BoundedBuffer[tuple[int, int, int, int, Any]] = BoundedBuffer("anatomy", 1 << 16)
        self.buffers = (self.buffer,)
        self._handles: list[Any] = []
        self._loader_patch: tuple[Any, Any] | None = None
        self._steps: Any = None
        self._pipe: Any = None
        self._coll: Any = None
        self._dist_on: Any = lambda: False
        #: steps awaiting their collectives: (rec, busy intervals, host waits, phases dict to complete)
        self.comm_pending: list[tuple[StepRecord, list[tuple[int, int]], list[tuple[int, int]], dict[str, float]]] = []
        self._compiling: Any = lambda: False
        self._queue_callback: Any = None
        self._events: dict[int, list[tuple[int, int, int, Any]]] = {}
        self._waiting: list[tuple[StepRecord, list[tuple[int, int, int, Any]]]] = []
        self._last_end_event: Any = None
        self._event: Any = None  # torch.cuda.Event on CUDA
        self._stream: Any = None  # current stream of the rank's device, on CUDA
        self.clock = "cpu"
        self.hists: dict[str, Histogram] = {p: Histogram(cat.LATENCY_BUCKETS) for p in PHASES}
        self.history: list[tuple[int, float, dict[str, float], float]] = []  # (step, step s, phases, loader s)
        self.verdict: str | None = None
        self._unjudged = False  # steps finished by on_step, judged in end_pass
        self.slow_rank: int | None = None  # the peer a slow-rank verdict names (None: this rank, or none)
        self.evidence: dict[str, Any] = {}
        self.shares: dict[str, float] = {}
        self.forward_source = "none"
        self.cuda = False
        self._module_cls: Any = None
        self.root: Any = None  # the module whose forward hooks time the forward and backward
        self.root_found_by = ""  # "attach(model)", "wrapper" or "optimizer step"
        self.root_class = ""
        self._root_handles: list[Any] = []
        self._silent_handles: list[Any] = []  # of roots dropped without their forward ever running: see _drop_root
        self._root_step = 0  # the step the root was taken at
        self._root_checks = 0  # optimizer steps left to find or confirm the root on (0: settled)
        self._rejected: list[Any] = []  # roots whose forward never ran in a whole step
        self._fired = False  # the root's forward ran (outside torch.compile) since it was taken

    # ------------------------------------------------------------------------------------ install
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        import torch

        self.buffer.capacity = ctx.config.buffer_size
        self._steps = ctx.find(StepCollector)
        self._pipe = ctx.find(PipelineCollector)
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available():
            self._dist_on = dist.is_initialized
        self._compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
        self._queue_callback = autograd.queue_callback()
        self._module_cls = torch.nn.Module
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        if getattr(ctx.device, "type", "") == "cuda":  # the rank's device (hpar_agent.device)
            self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        self._root_checks = model_root.MAX_CHECKS
        if isinstance(ctx.model, torch.nn.Module):
            self._adopt(ctx.model, "attach(model)")
        else:
            watch.listen(self._on_source)
            if watch.wrapper() is not None:
                self._on_source("wrapper")
        self._patch_loader()

    def _patch_loader(self) -> None:
        cls = dataloader.iterator_class()
        if cls is None:
            return
        orig = cls.__next__
        put, steps = self.buffer.put, self._steps

        def __next__(it: Any) -> Any:
            if steps is not None and not steps.detailed:
                return orig(it)
            t0 = time.time_ns()
            try:
                return orig(it)
            finally:
                put((steps.count if steps is not None else 0, LOAD, t0, time.time_ns(), None))

        __next__._hpar_orig = orig  # type: ignore[attr-defined]
        cls.__next__ = __next__
        self._loader_patch = (cls, orig)

    def uninstall(self) -> None:
        watch.unlisten(self._on_source)
        for h in [*self._handles, *self._root_handles, *self._silent_handles]:
            h.remove()
        self._handles.clear()
        self._root_handles.clear()
        self._silent_handles.clear()
        self.root, self._rejected = None, []  # the user's model is not the agent's to keep alive
        if self._loader_patch is not None:
            cls, orig = self._loader_patch
            if getattr(cls.__next__, "_hpar_orig", None) is orig:
                cls.__next__ = orig
            self._loader_patch = None

    # ------------------------------------------------------------------------------------ the model's root
    def _drop_root(self) -> None:
        """Stop timing the current root. Hooks that never ran in a whole step stay until detach, silent:
        they may sit inside code torch.compile traced with them, and removing them would recompile it."""
        if self.root is not None and not self._fired and self._root_step != self._step():
            self._silent_handles += self._root_handles
        else:
            for h in self._root_handles:
                h.remove()
        self._root_handles, self.root, self.root_found_by, self.root_class = [], None, "", ""

    def _adopt(self, module: Any, how: str) -> None:
        """Time the forward and backward of ``module`` from now on (training thread, rare)."""
        self._drop_root()
        self._root_handles = [
            module.register_forward_pre_hook(self._fwd_pre, prepend=True),
            # prepended: its output hook must precede FSDP's/replicate's (see _fwd_post)
            module.register_forward_hook(self._fwd_post, prepend=True),
        ]
        self.root, self.root_found_by, self._fired = module, how, False
        self.root_class = type(module).__name__
        self._root_step = self._step()
        self.forward_source = "module-hooks"
        device = self.ctx.device if self.ctx is not None else None
        try:
            on_cuda = next(module.parameters()).device.type == "cuda"
        except StopIteration:
            on_cuda = False
        self.cuda = on_cuda and getattr(device, "type", "") == "cuda"
        if self.cuda and self._event is None:
            import torch

            self._event = torch.cuda.Event
            self._stream = functools.partial(torch.cuda.current_stream, device)

    def _on_source(self, kind: str) -> None:
        """``topology_watch``: a data-parallel wrapper was built; it is the root while none was found at
        an optimizer step, or when it wraps the root (FSDP wraps the blocks, then the whole model)."""
        if kind != "wrapper" or self.root_found_by not in ("", "wrapper"):
            return
        try:
            new = model_root.outermost(self.root, watch.wrapper())
            if new is not None and new is not self.root:
                self._adopt(new, "wrapper")
        except Exception as exc:
            self.record_error(exc)

    def _check_root(self, optimizer: Any, frame: Any) -> None:
        """At an optimizer step while the root is not settled: keep a root whose forward ran and that
        holds the optimizer's parameters (or was given to ``attach``), else look for the model in the
        frames above (``model_root``): a model given to ``attach`` but called only through a wrapper
        that runs its hooks inside torch.compile (``torch.compile(model)``) is timed at that wrapper."""
        self._root_checks -= 1
        try:
            root = self.root
            if root is not None and not self._fired and self._root_step == self._step():
                return  # taken during this step: its forward runs from the next one
            if root is not None and self._fired and (
                self.root_found_by == "attach(model)" or model_root.holds(root, model_root.param_ids(optimizer))
            ):
                self._root_checks = 0  # confirmed
                return
            if root is not None:
                self._rejected.append(root)
            found = model_root.find_root(optimizer, self._module_cls, self._rejected, frame)
            if found is not None:
                self._adopt(found, "optimizer step")
            elif root is not None and self.root_found_by != "attach(model)":  # the user's choice stays
                self._drop_root()
        except Exception as exc:
            self._root_checks = 0
            self.record_error(exc)
        finally:
            if not self._root_checks:
                self._rejected.clear()

    # ------------------------------------------------------------------------------------ training thread
    def _step(self) -> int:
        steps = self._steps
        return steps.count if steps is not None else 0

    def _mark(self, step: int, code: int) -> None:
        """Append one timestamp (and on CUDA an event); never raises into the training loop."""
        try:
            ev = None
            if self._event is not None:
                ev = self._event(enable_timing=True)
                ev.record(self._stream())  # the rank's device's stream, not the thread's device 0
            self.buffer.put((step, code, time.time_ns(), 0, ev))
        except Exception as exc:
            self.record_error(exc)

    def _fwd_pre(self, module: Any, args: Any) -> None:
        steps = self._steps
        # compiling first: traced, the hook then reads nothing torch.compile would guard on (a guard on
        # ``detailed`` recompiles the model when the detail stride toggles it)
        if self._compiling() or (steps is not None and not steps.detailed):
            return
        self._fired = True
        self._mark(self._step(), FWD0)

    def _fwd_post(self, module: Any, args: Any, out: Any) -> None:
        steps = self._steps
        if self._compiling() or (steps is not None and not steps.detailed):
            return
        self._mark(self._step(), FWD1)
        try:
            # Tensor hooks, registered before FSDP/replicate's on the same output: tensor hooks run in
            # order, so our engine callback (the backward's end) is queued before their root
            # post-backward callback, whose gradient reduction then counts as communication.
            for t in _grad_outputs(out):
                t.register_hook(self._bwd_pre)
        except Exception as exc:  # never into the training loop
            self.record_error(exc)

    def _bwd_pre(self, grad_outputs: Any) -> None:
        self._mark(self._step(), BWD0)
        try:
            self._queue_callback(self._bwd_end)
        except Exception as exc:
            self.record_error(exc)

    def _bwd_end(self) -> None:
        self._mark(self._step(), BWD1)
        if self._event is None and self._dist_on():  # CPU clock: time DDP's wait (module docstring)
            try:
                self._queue_callback(self._sync_end)
            except Exception as exc:
                self.record_error(exc)

    def _sync_end(self) -> None:
        self._mark(self._step(), SYNC1)

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        steps = self._steps
        if steps is None:
            return
        oid = steps._optimizer_id
        if oid is not None and id(optimizer) != oid:
            return
        if self._root_checks:
            self._check_root(optimizer, sys._getframe(1))
        if steps.explicit or not steps.detailed:
            return
        self._mark(steps.count, OPT0)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """CUDA only: an event after the optimizer's kernels (the step collector's post-hook, installed
        first, has already counted the step); also after an undetailed step the next detailed one is
        measured from."""
        steps = self._steps
        if self._event is None or steps is None or steps.explicit or steps._optimizer_id != id(optimizer):
            return
        if not (steps.prev_detailed or steps.detailed):
            return
        self._mark(steps.count - 1, OPT1)

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        for step, code, t0, t1, ev in self.buffer.drain():
            self._events.setdefault(step, []).append((code, t0, t1, ev))
        self._flush()

    def on_step(self, rec: StepRecord) -> None:
        events = self._events.pop(rec.step, [])
        for s in [s for s in self._events if s < rec.step - WINDOW]:
            del self._events[s]
        self._waiting.append((rec, events))
        if len(self._waiting) > MAX_WAITING:
            del self._waiting[0]
            self._last_end_event = None
        self._unjudged |= self._flush(judge=False) > 0

    def end_pass(self) -> None:
        # the collectives read in this pass may complete steps' comm_exposed now
        if self.comm_pending and self._flush_comm():
            self._unjudged = True
        if self._unjudged:
            self._unjudged = False
            self._judge()

    def span_watermark_ns(self) -> int | None:
        marks = [q[0][0].start_ns for q in (self._waiting, self.comm_pending) if q]
        return min(marks) if marks else None

    def _flush(self, judge: bool = True) -> int:
        """Finish the steps in order, each once its CUDA events (if any) have completed; then judge
        once (not per step: a fast loop finishes thousands of steps per pass; ``on_step`` leaves the
        judging to ``end_pass``). Returns the steps finished."""
        finished = 0
        while self._waiting:
            rec, events = self._waiting[0]
            end = next((ev for code, _t0, _t1, ev in events if code == OPT1 and ev is not None), None)
            if end is not None and not end.query():
                break
            finished += 1
            del self._waiting[0]
            if not rec.detailed:  # its hooks recorded nothing but the end the next step is measured from
                self._last_end_event = end
                continue
            step_s = rec.duration_s
            piped = self._pipe is not None and bool(getattr(self._pipe, "wrapped", None))
            if end is not None and self._last_end_event is not None and not piped:
                try:
                    phases, spans, loader, step_s = gpu_phases(rec.start_ns, events, self._last_end_event, end)
                    self.clock = "cuda-events"
                except Exception as exc:  # an event not recorded (e.g. another device): CPU times
                    self.record_error(exc)
                    phases, spans, loader = self.phases(rec, events)
            else:
                phases, spans, loader = self.phases(rec, events)
            self._last_end_event = end
            self._finish(rec, phases, spans, loader, step_s)
            busy = [(t0, t1) for phase, t0, t1 in spans if phase in BUSY_PHASES]
            if piped:  # forward/backward spans are the pipeline's chunks
                busy += self._pipe.intervals_by_step.pop(rec.step, [])
            self.comm_pending.append((rec, busy, host_waits(events) if self._event is None else [], phases))
        finished += self._flush_comm()
        if finished and judge:
            self._unjudged = False
            self._judge()
        return finished

    def _flush_comm(self) -> int:
        """Complete ``comm_exposed`` of the steps whose collectives have all been read (in order)."""
        agent, done = self.ctx, 0
        if self._coll is None and agent is not None:  # installed after this component
            self._coll = agent.find(CollectiveCollector)
        coll = self._coll
        now, mark = time.time_ns(), None
        while self.comm_pending:
            rec, busy, waits, phases = self.comm_pending[0]
            if (coll is not None and coll.up and not (agent is not None and agent.stopping)
                    and len(self.comm_pending) <= MAX_COMM_WAITING and now - rec.end_ns < COMM_WAIT_NS):
                if mark is None:
                    mark = coll.span_watermark_ns()
                if mark is not None and mark < rec.end_ns:
                    break  # a timed op of this step may still come
            del self.comm_pending[0]
            done += 1
            comm = coll.comm_intervals(rec.step) if coll is not None else []
            if not comm and not waits and not getattr(coll, "timed", 0):
                continue  # no timing source on this rank: not measured (left out, not 0)
            parts = exposed_ns([*comm, *waits], busy, rec.start_ns, rec.end_ns)
            secs = sum(b - a for a, b in parts) / 1e9
            self.hists["comm_exposed"].observe(secs)
            phases["comm_exposed"] = secs  # the step's history entry holds this dict
            if agent is not None and agent.tracing_on:
                for t0, t1 in parts[:16]:
                    agent.add_span(SpanRecord(cat.SPAN_STEP_PHASES["comm_exposed"], t0, t1, rec.step))
        return done

    def _finish(self, rec: StepRecord, phases: dict[str, float], spans: list[tuple[str, int, int]],
                loader: float, step_s: float) -> None:
        for phase, secs in phases.items():
            self.hists[phase].observe(secs)
        self.history.append((rec.step, step_s, phases, loader))
        if len(self.history) > 2 * WINDOW:
            del self.history[:-WINDOW]
        ctx = self.ctx
        if ctx is not None and ctx.tracing_on:
            for phase, t0, t1 in spans[:32]:
                ctx.add_span(SpanRecord(cat.SPAN_STEP_PHASES[phase], t0, t1, rec.step))

    def phases(
        self, rec: StepRecord, events: list[tuple[int, int, int, Any]]
    ) -> tuple[dict[str, float], list[tuple[str, int, int]], float]:
        """Phase seconds of one step from CPU wall-clock times (``phases.cpu_phases``); under a pipeline
        schedule forward and backward are the stage's chunks, and only stage 0 waits for data."""
        pipe = self._pipe
        chunks = None
        if pipe is not None and getattr(pipe, "wrapped", None):
            self.forward_source = "pipeline-chunks"
            chunks = (pipe.phase_by_step.pop(rec.step, {}), pipe.first_forward_ns.pop(rec.step, None))
        return cpu_phases(rec.start_ns, rec.end_ns, events, chunks)

    def _judged_steps(self) -> list[tuple[int, float, dict[str, float], float]]:
        """The recent steps after warm-up, and of those the ones with a forward timed where there are
        any (under ``hpar-agent run`` the steps before the model was found have none)."""
        recent = self.history[-WINDOW:]
        hist = [h for h in recent if h[0] >= WARMUP_STEPS] or recent
        return [h for h in hist if "forward" in h[2]] or hist

    def _judge(self) -> None:
        hist = self._judged_steps()
        total = sum(h[1] for h in hist)
        if total <= 0:
            return
        sums = {p: sum(h[2].get(p, 0.0) for h in hist) for p in PHASES}
        seen = {p for h in hist for p in h[2]}
        self.shares = {p: sums[p] / total for p in PHASES if p in seen}
        th = self.ctx.config.thresholds if self.ctx is not None else {}
        straggler, lag, slow_rank = self._straggler()
        verdict = bottleneck(self.shares, straggler=straggler,
                             thresholds={k: float(th.get(f"anatomy.{k}", v)) for k, v in ANATOMY_DEFAULTS.items()})
        self.verdict = verdict.name
        rank = self.ctx.topology.rank if self.ctx is not None else 0
        self.evidence = {
            "steps": len(hist),
            "step_seconds_mean": total / len(hist),
            "shares": {p: round(v, 4) for p, v in self.shares.items()},
            "other_share": round(max(0.0, 1.0 - sum(self.shares.values())), 4),
            "loader_seconds_mean": sum(h[3] for h in hist) / len(hist),
            "reason": self._reason(verdict.name, verdict.reason, "forward" in seen, {h[0] for h in hist}),
        }
        if lag is not None:
            self.evidence["straggler_lag_ratio"] = round(lag, 4)
        self.slow_rank = slow_rank if self.verdict == "slow-rank" else None
        if self.verdict == "slow-rank":
            self.evidence["slow_rank"] = rank if slow_rank is None else slow_rank

    def _reason(self, verdict: str, reason: str, forward: bool, steps: set[int]) -> str:
        """The verdict's reason; an unknown one says where the rest of the step went where the agent
        knows: nowhere timed when no forward was, else a pipeline stage's bubble."""
        if verdict != "unknown":
            return reason
        if not forward:
            return self._no_forward()
        pipe = self._pipe
        bubbles = [b for step, b in getattr(pipe, "bubbles", ()) if step in steps]
        if self.forward_source == "pipeline-chunks" and bubbles:
            reason += (f"; the rest is mostly the pipeline's bubble ({sum(bubbles) / len(bubbles):.0%} of the step, "
                       "hpar_pp_bubble_ratio): the stage waits for its neighbours")
        return reason

    def _no_forward(self) -> str:
        """Why no step has a forward timed (the reason of an unknown verdict)."""
        if not self.root_class:
            return ("no forward timed: the model is not known (give it to attach(model); under hpar-agent run "
                    "a DDP/FSDP wrapper or the training loop's variables at an optimizer step name it)")
        return (f"no forward timed: the forward hooks of the model's root ({self.root_class}, from "
                f"{self.root_found_by}) never ran outside torch.compile")

    def _straggler(self) -> tuple[bool, float | None, int | None]:
        """Whether the job has one slow rank, its arrival lag at collectives and which rank (None: this
        one), as the Straggler detector concluded (``AgentContext.slow_rank``)."""
        sr = self.ctx.slow_rank if self.ctx is not None else None
        if sr is None or not (sr.here or sr.peer is not None):
            return False, None, None
        return True, sr.lag, None if sr.here else sr.peer

    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        yield f.histograms("hpar_step_phase_duration_seconds", self.hists)
        r = f.gauge("hpar_step_phase_ratio")
        for phase, share in self.shares.items():
            f.add(r, [phase], share)
        yield r
        b = f.gauge("hpar_step_bottleneck")
        if self.verdict is not None:
            for v in cat.VERDICTS:
                f.add(b, [v], 1.0 if v == self.verdict else 0.0)
        yield b
        sr = f.gauge("hpar_step_slow_rank")
        if self.verdict == "slow-rank":
            rank = self.ctx.topology.rank if self.ctx is not None else 0
            f.add(sr, [], float(rank if self.slow_rank is None else self.slow_rank))
        yield sr

    def summary(self) -> dict[str, Any]:
        hist = self._judged_steps()
        p50 = {}
        for p in PHASES:
            vals = [h[2][p] for h in hist if p in h[2]]
            if vals:
                p50[p] = statistics.median(vals)
        return {
            "clock": self.clock,
            "source": self.forward_source,
            "model": {"class": self.root_class, "found_by": self.root_found_by} if self.root_class else None,
            "phase_seconds_p50": p50,
            "step_seconds_p50": statistics.median([h[1] for h in hist]) if hist else None,
            "verdict": self.verdict,
            "evidence": self.evidence,
        }
