"""Per-stage, per-microbatch forward/backward compute time and the bubble ratio.

Every pipelining schedule (GPipe, 1F1B, interleaved) calls ``PipelineStage.forward_one_chunk`` and
``backward_one_chunk`` once per microbatch, so wrapping those two methods on the stage instances gives
(stage, microbatch, phase, time) for all of them. On CUDA the time comes from CUDA events resolved on
the agent thread with ``query()``; the training thread never synchronizes. On a fast loop only the
steps with detail (``StepCollector.stride``) are timed, and the bubble ratio is theirs.

A forward chunk run without grad or by a schedule with no backward (``schedule.eval()``, an evaluation
between steps) is no training step's: only its end is kept (``eval_end_ns``), where the anatomy ends the
step's host time; its step gets the detail whatever the stride, and no bubble ratio.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.catalogue import LATENCY_BUCKETS
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import LazySpan, SpanRecord, StepRecord
from hpar_agent.streams import StreamCap, stream_label
from hpar_agent.torch_compat import pipelining

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

_TAG = "_hpar_wrapped"
_METHODS = (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"))
BUBBLE_WARMUP_STEPS = (
    2  # steps left out of bubble_ratio_mean: the first ones run shape inference and compiles
)


#: One microbatch's chunk: (step, stage index, microbatch, phase, stream label, t0 epoch ns, t1 epoch ns
#: (0 on CUDA: from the events), start and end CUDA events or None, the cudaStream_t or None). A plain
#: tuple: see ``buffer``.
Chunk = tuple[int, int, Any, str, str, int, int, Any, Any, int | None]


class PipelineCollector(Component):
    name = "pipeline"

    def __init__(self) -> None:
        super().__init__()
        self.buffer: BoundedBuffer[Chunk] = BoundedBuffer("pipeline", 1 << 16)
        self.buffers = (self.buffer,)
        self._wrapped: list[tuple[Any, str]] = []
        self._pending: list[Chunk] = []  # CUDA chunks whose end event has not completed yet
        self.hists: dict[tuple[str, str], Histogram] = {}
        self.streams = StreamCap()
        self.busy_by_step: dict[int, float] = {}
        self.last_busy = 0.0
        self.last_bubble: float | None = None
        self.bubbles: list[tuple[int, float]] = []  # (step, bubble ratio), recent
        self.schedule = ""
        self.stage_times: dict[tuple[int, str], list[float]] = {}
        # per step: chunk seconds by phase and the first stage-0 forward's start (read by the anatomy)
        self.phase_by_step: dict[int, dict[str, float]] = {}
        self.first_forward_ns: dict[int, int] = {}
        self.eval_end_ns: dict[int, int] = {}  # per step: the end of its last evaluation chunk
        self.intervals_by_step: dict[
            int, list[tuple[int, int]]
        ] = {}  # chunk (t0, t1): the anatomy's busy time

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.buffer.capacity = ctx.config.buffer_size

    def watch(self, stages: list[Any], schedule: Any = None) -> None:
        """Wrap the one-chunk methods of each stage (idempotent). The schedule's class name is
        ``schedule``'s, else that of the schedule the topology watch saw running the stages."""
        name = type(schedule).__name__ if schedule is not None else ""
        name = name or next((n for s in stages if (n := pipelining.schedule_name(s))), "")
        if name:
            self.schedule = name
        for stage in stages:
            for method, phase in _METHODS:
                orig = getattr(stage, method, None)
                if orig is None or getattr(orig, _TAG, False):
                    continue
                setattr(stage, method, self._wrap(stage, orig, phase))
                self._wrapped.append((stage, method))

    @property
    def wrapped(self) -> list[tuple[Any, str]]:
        """(stage, method name) of every one-chunk method wrapped now (empty: no pipeline watched)."""
        return self._wrapped

    def uninstall(self) -> None:
        for stage, method in self._wrapped:
            fn = stage.__dict__.get(method)
            if fn is not None and getattr(fn, _TAG, False):
                delattr(stage, method)  # the class method shows through again
        self._wrapped.clear()

    def _wrap(self, stage: Any, orig: Any, phase: str) -> Any:
        buffer = self.buffer
        device = getattr(stage, "device", None)
        cuda = getattr(device, "type", "cpu") == "cuda"
        cpu_stream = stream_label(None)
        stage_index = int(getattr(stage, "stage_index", 0))
        steps = self.ctx.find(StepCollector) if self.ctx is not None else None
        import torch

        grad_on = torch.is_grad_enabled

        @functools.wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if phase == "forward" and not (grad_on() and getattr(stage, "has_backward", True)):
                out = orig(*args, **kwargs)  # an evaluation's chunk: its end only, on the CPU clock
                try:
                    if steps is not None:
                        steps.detailed = True  # whatever the stride: its phases say where the time went
                    step = steps.count if steps is not None else 0
                    buffer.put(
                        (step, stage_index, -1, "eval", cpu_stream, 0, time.time_ns(), None, None, None)
                    )
                except Exception as exc:
                    self.record_error(exc)
                return out
            if steps is not None and not steps.detailed:  # a step without detail (StepCollector.stride)
                return orig(*args, **kwargs)
            # The bookkeeping never raises into the schedule: a failure is counted and the chunk runs.
            try:
                chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                step = steps.count if steps is not None else 0
                t0 = time.time_ns()
                cs = e0 = None
                if cuda:
                    import torch

                    cs = torch.cuda.current_stream(device)  # the stage's device, not the thread's
                    e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: unannotated
                    e0.record(cs)
            except Exception as exc:
                self.record_error(exc)
                return orig(*args, **kwargs)
            out = orig(*args, **kwargs)
            try:
                if cs is not None:
                    import torch

                    stream = stream_label(device, cs)  # where the events are recorded (~1 µs)
                    e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch: unannotated
                    e1.record(torch.cuda.current_stream(device))
                    buffer.put((step, stage_index, chunk, phase, stream, t0, 0, e0, e1, cs.cuda_stream))
                else:
                    buffer.put(
                        (step, stage_index, chunk, phase, cpu_stream, t0, time.time_ns(), None, None, None)
                    )
            except Exception as exc:
                self.record_error(exc)
            return out

        setattr(timed, _TAG, True)
        return timed

    def poll(self, now: float) -> None:
        ctx = self.ctx
        assert ctx is not None
        items = self._pending + self.buffer.drain()
        tracing = ctx.tracing_on
        self._pending = []
        for item in items:
            step, stage_index, chunk, phase, stream, t0, t1, e0, e1, handle = item
            if phase == "eval":
                self.eval_end_ns[step] = max(t1, self.eval_end_ns.get(step, t1))
                continue
            if e1 is not None:
                if not e1.query():
                    self._pending.append(item)
                    continue
                dur = e0.elapsed_time(e1) / 1e3
                t1 = t0 + int(dur * 1e9)
            else:
                dur = (t1 - t0) / 1e9
            key = (phase, self.streams(stream))
            hist = self.hists.get(key)
            if hist is None:  # not setdefault: that builds a histogram for every chunk
                hist = self.hists[key] = Histogram(LATENCY_BUCKETS)
            hist.observe(dur)
            self.busy_by_step[step] = self.busy_by_step.get(step, 0.0) + dur
            by_phase = self.phase_by_step.setdefault(step, {})
            by_phase[phase] = by_phase.get(phase, 0.0) + dur
            self.intervals_by_step.setdefault(step, []).append((t0, t1))
            if phase == "forward" and stage_index == 0:
                self.first_forward_ns[step] = min(t0, self.first_forward_ns.get(step, t0))
            times = self.stage_times.setdefault((stage_index, phase), [])
            times.append(dur)
            del times[:-256]
            if tracing:
                ctx.add_span(
                    LazySpan(step, _chunk_span, (phase, t0, t1, step, stage_index, chunk, stream, handle))
                )

    def on_step(self, rec: StepRecord) -> None:
        busy = self.busy_by_step.pop(rec.step, None)
        for s in [s for s in self.busy_by_step if s < rec.step - 64]:
            del self.busy_by_step[s]
        for d in (self.phase_by_step, self.first_forward_ns, self.intervals_by_step, self.eval_end_ns):
            for s in [s for s in d if s < rec.step - 64]:
                del d[s]
        if busy is None or rec.duration_s <= 0 or rec.step in self.eval_end_ns:
            return  # no chunk timed, or an evaluation's time in the step: no bubble of the schedule
        self.last_busy = busy
        self.last_bubble = min(1.0, max(0.0, 1.0 - busy / rec.duration_s))
        self.bubbles.append((rec.step, self.last_bubble))
        del self.bubbles[:-512]

    def collect(self) -> Iterable[Metric]:
        if not self._wrapped:
            return
        f = self.require_ctx().families
        yield f.histograms("hpar_pp_chunk_duration_seconds", self.hists)
        busy = f.gauge("hpar_pp_busy_seconds")
        f.add(busy, [], self.last_busy)
        yield busy
        bubble = f.gauge("hpar_pp_bubble_ratio")
        if self.last_bubble is not None:
            f.add(bubble, [], self.last_bubble)
        yield bubble

    def summary(self) -> dict[str, Any]:
        per_stage = {
            f"{stage}/{phase}": sorted(v)[len(v) // 2]
            for (stage, phase), v in sorted(self.stage_times.items())
            if v
        }
        warm = [b for step, b in self.bubbles if step >= BUBBLE_WARMUP_STEPS] or [b for _, b in self.bubbles]
        return {
            "schedule": self.schedule,
            "chunk_seconds_p50": per_stage,
            "bubble_ratio": self.last_bubble,
            "bubble_ratio_mean": sum(warm) / len(warm) if warm else None,  # over the steps after warm-up
            "bubble_ratio_steps": len(warm),
        }


def _chunk_span(args: tuple[str, int, int, int, int, Any, str, Any]) -> SpanRecord:
    """The span of one microbatch's forward or backward (``LazySpan``: made only when its step's trace
    is kept)."""
    phase, t0, t1, step, stage_index, chunk, stream, handle = args
    attrs = {cat.ATTR_PP_STAGE: stage_index, cat.ATTR_MICROBATCH: int(chunk), cat.ATTR_STREAM: stream}
    if handle is not None:  # the cudaStream_t (an int) beside the readable name
        attrs[cat.ATTR_STREAM_HANDLE] = int(handle)
    name = cat.SPAN_PP_FORWARD if phase == "forward" else cat.SPAN_PP_BACKWARD
    return SpanRecord(name=name, start_ns=t0, end_ns=t1, step=step, attributes=attrs)
