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

Hooks (``anatomy_hooks``), installed at attach, only append ``(step, code, epoch ns, ...)`` marks to a
bounded buffer: forward and backward from hooks on the model's root module (the model given to
``attach(model)``, else the one ``model_root`` finds: a wrapper built, or at an optimizer step), the
optimizer phase from the global optimizer step pre-hook to the step boundary, and the time inside the
data loader. Pipeline schedules: forward/backward are the pipeline collector's chunk times (CUDA events
there on a GPU), data wait and host end at the first stage-0 forward chunk (CPU clock). The steps a
fast loop leaves without detail (``StepCollector.stride``) get no phases; a step that held an evaluation
(forwards without grad, a pipeline's evaluation chunks) gets them, on the CPU clock, and is not judged.

Clock: on CPU, wall clock. On CUDA wall-clock phases would be launch times (the time shows up wherever
the CPU next waits for the GPU, e.g. a loss ``.item()`` in the data wait), so each hook also records a
CUDA event on the current stream (plus one at the end of the optimizer step), and the agent thread
turns them into GPU-stream phases once the step's last event has completed (``query()``, never a
sync), as the pipeline collector does for chunks (``phases.gpu_phases``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent.collectors.anatomy_hooks import AnatomyHooks
from hpar_agent.collectors.collectives import CollectiveCollector
from hpar_agent.collectors.phases import EVAL, OPT1, Event, cpu_phases, exposed_ns, gpu_phases, host_waits
from hpar_agent.collectors.pipeline import PipelineCollector
from hpar_agent.collectors.pipeline_p2p import waited_by
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.collectors.verdict import NAMING, bottleneck
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import SpanRecord, StepRecord
from hpar_agent.thresholds import ANATOMY_DEFAULTS

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

MAX_WAITING = 256  # CUDA steps whose events have not completed yet
MAX_COMM_WAITING = 8192  # steps whose collectives have not all been read yet (FR reads are periodic)
COMM_WAIT_NS = 30 * 10**9  # then comm_exposed is computed from what was read (a hung op never completes)
BUSY_PHASES = ("data_wait", "host", "forward", "backward", "optimizer")  # disjoint from comm_exposed
PHASES = cat.STEP_PHASES
WARMUP_STEPS = 2  # left out of the verdict: the first steps compile and allocate
WINDOW = 64  # recent steps the shares and the verdict are computed over


class AnatomyCollector(Component):
    name = "anatomy"

    def __init__(self) -> None:
        super().__init__()
        self.hooks = AnatomyHooks()
        self.buffers = (self.hooks.buffer,)
        self._pipe: PipelineCollector | None = None
        self._coll: CollectiveCollector | None = None
        #: steps awaiting their collectives: (rec, busy intervals, host waits, phases dict to complete)
        self.comm_pending: list[
            tuple[StepRecord, list[tuple[int, int]], list[tuple[int, int]], dict[str, float]]
        ] = []
        self._events: dict[int, list[Event]] = {}  # step -> its marks as ``phases`` reads them
        self._waiting: list[tuple[StepRecord, list[Event]]] = []  # steps awaiting their CUDA events
        self._last_end_event: Any = None
        self.clock = "cpu"
        self.hists: dict[str, Histogram] = {p: Histogram(cat.LATENCY_BUCKETS) for p in PHASES}
        self.history: list[
            tuple[int, float, dict[str, float], float]
        ] = []  # (step, step s, phases, loader s)
        self.verdict: str | None = None
        self._unjudged = False  # steps finished by on_step, judged in end_pass
        self.slow_rank: int | None = None  # the slow peer a verdict names (None: this rank, or none)
        self.evidence: dict[str, Any] = {}
        self.shares: dict[str, float] = {}
        self.spans_ns: dict[int, tuple[int, int]] = {}  # step -> (start ns, end ns) of the recent steps
        self.evaluated: set[int] = set()  # recent steps that held an evaluation: host time, not judged

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._pipe = ctx.find(PipelineCollector)
        self.hooks.install(ctx, ctx.find(StepCollector))

    def uninstall(self) -> None:
        self.hooks.uninstall()

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        for step, code, t0, t1, ev in self.hooks.buffer.drain():
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
            pipe = self._pipe
            piped = pipe is not None and bool(getattr(pipe, "wrapped", None))
            evaluated = any(e[0] == EVAL for e in events) or (
                pipe is not None and piped and rec.step in pipe.eval_end_ns
            )
            if evaluated:  # on CUDA its forwards keep the stream busy: the host's clock says how long it took
                self.evaluated.add(rec.step)
            if end is not None and self._last_end_event is not None and not piped and not evaluated:
                try:
                    phases, spans, loader, step_s = gpu_phases(
                        rec.start_ns, events, self._last_end_event, end
                    )
                    self.clock = "cuda-events"
                except Exception as exc:  # an event not recorded (e.g. another device): CPU times
                    self.record_error(exc)
                    phases, spans, loader = self.phases(rec, events)
            else:
                phases, spans, loader = self.phases(rec, events)
            self._last_end_event = end
            self._finish(rec, phases, spans, loader, step_s)
            busy = [(t0, t1) for phase, t0, t1 in spans if phase in BUSY_PHASES]
            if pipe is not None and piped:  # forward/backward spans are the pipeline's chunks
                busy += pipe.intervals_by_step.pop(rec.step, [])
            waits = host_waits(events) if self.hooks.event is None else []
            self.comm_pending.append((rec, busy, waits, phases))
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
            if (
                coll is not None
                and coll.up
                and not (agent is not None and agent.stopping)
                and len(self.comm_pending) <= MAX_COMM_WAITING
                and now - rec.end_ns < COMM_WAIT_NS
            ):
                if mark is None:
                    mark = coll.span_watermark_ns()
                if mark is not None and mark < rec.end_ns:
                    break  # a timed op of this step may still come
            del self.comm_pending[0]
            done += 1
            comm = coll.comm_intervals(rec.step) if coll is not None else []
            if not comm and not waits and not (coll is not None and coll.stats.timed):
                continue  # no timing source on this rank: not measured (left out, not 0)
            parts = exposed_ns([*comm, *waits], busy, rec.start_ns, rec.end_ns)
            secs = sum(b - a for a, b in parts) / 1e9
            self.hists["comm_exposed"].observe(secs)
            phases["comm_exposed"] = secs  # the step's history entry holds this dict
            if agent is not None and agent.tracing_on:
                for t0, t1 in parts[:16]:
                    agent.add_span(SpanRecord(cat.SPAN_STEP_PHASES["comm_exposed"], t0, t1, rec.step))
        return done

    def _finish(
        self,
        rec: StepRecord,
        phases: dict[str, float],
        spans: list[tuple[str, int, int]],
        loader: float,
        step_s: float,
    ) -> None:
        for phase, secs in phases.items():
            self.hists[phase].observe(secs)
        self.history.append((rec.step, step_s, phases, loader))
        self.spans_ns[rec.step] = (rec.start_ns, rec.end_ns)
        if len(self.spans_ns) > 2 * WINDOW:
            for step in list(self.spans_ns)[:-WINDOW]:
                del self.spans_ns[step]
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
        schedule forward and backward are the stage's chunks, and only stage 0 waits for data. The host
        time ends at the first stage-0 forward chunk, on a later stage at the end of an evaluation the
        step began with (its chunks are no step's: ``PipelineCollector``)."""
        pipe = self._pipe
        chunks = None
        if pipe is not None and getattr(pipe, "wrapped", None):
            self.hooks.forward_source = "pipeline-chunks"
            first = pipe.first_forward_ns.pop(rec.step, None)
            chunks = (pipe.phase_by_step.pop(rec.step, {}), first or pipe.eval_end_ns.get(rec.step))
        return cpu_phases(rec.start_ns, rec.end_ns, events, chunks)

    def _judged_steps(self) -> list[tuple[int, float, dict[str, float], float]]:
        """The recent steps after warm-up and without an evaluation, and of those the ones with a forward
        timed where there are any (under ``hpar-agent run`` the steps before the model was found have
        none)."""
        recent = self.history[-WINDOW:]
        if self.evaluated:  # an evaluation's host time is the job's (goodput), not the training step's
            self.evaluated &= {h[0] for h in self.history}
            recent = [h for h in recent if h[0] not in self.evaluated] or recent
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
        known, straggler, lag, slow_rank = self._straggler()
        # the stage Straggler names is the one the others wait for, whatever its own bubble
        pipeline_wait = 0.0 if straggler and slow_rank is None else self._pipeline_wait(hist)
        verdict = bottleneck(
            self.shares,
            straggler=straggler,
            thresholds={k: float(th.get(f"anatomy.{k}", v)) for k, v in ANATOMY_DEFAULTS.items()},
            pipeline_wait=pipeline_wait,
            slow_peer=slow_rank,
            straggler_known=known,
        )
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
        if pipeline_wait:
            self.evidence["pipeline_wait_share"] = round(pipeline_wait, 4)
        self.slow_rank = slow_rank if self.verdict in NAMING else None
        if self.verdict in NAMING:
            self.evidence["slow_rank"] = rank if slow_rank is None else slow_rank

    def _pipeline_wait(self, hist: list[tuple[int, float, dict[str, float], float]]) -> float:
        """The share of the judged steps' time the training thread waited in pipeline p2p ops (the
        pipelining wrapper's waits, ``P2PTracker.waited``); 0 without them."""
        c = self.ctx.find(CollectiveCollector) if self.ctx is not None else None
        log = list(c.p2p.waited) if c is not None else []
        spans = [self.spans_ns[h[0]] for h in hist if h[0] in self.spans_ns]
        if not log or not spans:
            return 0.0
        waited = waited_by(log, [t for span in spans for t in span])
        total = sum(t1 - t0 for t0, t1 in spans)
        got = sum(max(0, b - a) for a, b in zip(waited[0::2], waited[1::2], strict=True) if a >= 0)
        return got / total if total > 0 else 0.0

    def _reason(self, verdict: str, reason: str, forward: bool, steps: set[int]) -> str:
        """The verdict's reason; an unknown one says where the rest of the step went where the agent
        knows: nowhere timed when no forward was, else a pipeline stage's bubble."""
        if verdict != "unknown":
            return reason
        if not forward:
            return self._no_forward()
        pipe = self._pipe
        bubbles = [b for step, b in getattr(pipe, "bubbles", ()) if step in steps]
        if self.hooks.forward_source == "pipeline-chunks" and bubbles:
            reason += (
                f"; the rest is mostly the pipeline's bubble ({sum(bubbles) / len(bubbles):.0%} of the step, "
                "hpar_pp_bubble_ratio): the stage waits for its neighbours"
            )
        return reason

    def _no_forward(self) -> str:
        """Why no step has a forward timed (the reason of an unknown verdict)."""
        root = self.hooks.root
        if not root.class_name:
            return (
                "no forward timed: the model is not known (give it to attach(model); under hpar-agent run "
                "a DDP/FSDP wrapper or the training loop's variables at an optimizer step name it)"
            )
        return (
            f"no forward timed: the forward hooks of the model's root ({root.class_name}, from "
            f"{root.found_by}) never ran outside torch.compile"
        )

    def _straggler(self) -> tuple[bool, bool, float | None, int | None]:
        """Whether it is known if the job has a slow rank (a single rank has none; else the Straggler
        detector has judged), whether it has, its arrival lag at collectives and which rank (None: this
        one), as the Straggler detector concluded (``AgentContext.conclusions``)."""
        ctx = self.ctx
        sr = ctx.conclusions.get("Straggler") if ctx is not None else None
        known = ctx is None or ctx.judged("Straggler")
        if sr is None or not (sr.here or sr.peer is not None):
            return known, False, None, None
        return known, True, sr.value, None if sr.here else sr.peer

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
        if self.verdict in NAMING:
            rank = self.ctx.topology.rank if self.ctx is not None else 0
            f.add(sr, [], float(rank if self.slow_rank is None else self.slow_rank))
        yield sr

    def summary(self) -> dict[str, Any]:
        hist = self._judged_steps()
        root = self.hooks.root
        p50 = {}
        for p in PHASES:
            vals = [h[2][p] for h in hist if p in h[2]]
            if vals:
                p50[p] = statistics.median(vals)
        return {
            "clock": self.clock,
            "source": self.hooks.forward_source,
            "model": {"class": root.class_name, "found_by": root.found_by} if root.class_name else None,
            "phase_seconds_p50": p50,
            "step_seconds_p50": statistics.median([h[1] for h in hist]) if hist else None,
            "verdict": self.verdict,
            "evidence": self.evidence,
        }
