"""Goodput by cause: where each rank's wall time since its process started went (``goodput_ledger``).

Built on what the other collectors already measure, on the agent thread only: the step boundaries
(``steps``), each step's data wait, host time and exposed communication (``anatomy``: the steps a fast
loop leaves without detail get the shares of the detailed steps before them), the compiles' start and
end (``compile``), and the checkpoint calls this collector times itself (``checkpoint_wrap``: the only
training-thread cost it adds, two clock reads a checkpoint call). The culprit of a wait is the one the
Straggler detector concluded (``AgentContext.conclusions``): while it names a peer, this rank's exposed
communication is waiting for that peer; else it is the step's own communication (productive), once no
culprit was named within ``goodput_ledger.UNDECIDED_STEPS`` steps. Before the detector has judged at all
(a run shorter than its window, or the detectors off) it stays undecided, and the summary says so.
While the Hang alert is active, the time since the last accounted step is hang. Earlier attempts in the same run directory (a restart) are
added, with ``restart`` and ``recomputed`` (``goodput_attempts``).

A step is accounted once the anatomy has finished it (its CUDA events and collectives read), so the
counters run a step or two behind the clock; the time after the last step counts at detach (hang, or
"other": the program's end) and ``hpar_goodput_ratio`` is productive over the time accounted so far.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent.catalogue import GOODPUT_CAUSES as CAUSES
from hpar_agent.collectors import goodput_attempts
from hpar_agent.collectors.anatomy import AnatomyCollector
from hpar_agent.collectors.checkpoint_wrap import CheckpointWrap
from hpar_agent.collectors.compile import CompileCollector
from hpar_agent.collectors.goodput_ledger import Ledger, Shares, merged
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.spans import StepRecord

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

WRITE_EVERY_NS = 5 * 10**9  # how often the attempt's ledger is written to the run directory
MAX_PENDING = 8192  # steps awaiting the anatomy; past it the oldest are accounted with the recent shares
SHARE_WEIGHT = 0.25  # weight of the newest detailed step in the shares undetailed steps get
HANG_ALERT = "Hang"


def process_start_ns() -> int | None:
    """When this process started (epoch ns, 10 ms resolution): /proc/self/stat's start time after boot,
    placed by /proc/uptime. None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        start = now - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return int(start * 1e9) if now - 30 * 86400 < start <= now else None


class GoodputCollector(Component):
    name = "goodput"

    def __init__(self) -> None:
        super().__init__()
        self.ckpt = CheckpointWrap()
        self.buffers = (self.ckpt.buffer,)
        self.ledger = Ledger(process_start_ns() or time.time_ns())
        self.pending: deque[StepRecord] = deque()
        self.shares = Shares()  # what an undetailed step gets: the recent detailed steps' shares
        self.ckpt_calls: deque[tuple[int, int]] = deque(maxlen=1024)  # the training thread's
        self.ckpt_seconds = 0.0  # every thread's checkpoint calls (async ones included)
        self._other_threads: list[
            tuple[int, int, int]
        ] = []  # calls made before the training thread was known
        self._steps: StepCollector | None = None
        self._anatomy: AnatomyCollector | None = None
        self._compile: CompileCollector | None = None
        self.attempts: goodput_attempts.Attempts | None = None  # read at the first pass
        self.earlier: Ledger | None = None  # the earlier attempts' seconds, restarts included
        self.resumed = False  # a checkpoint was loaded before the first step
        self.base_step: int | None = None  # the number of this attempt's first step across attempts
        self.saved_at: int | None = None  # this attempt's steps done at its last checkpoint save
        self._written_ns = 0

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._steps = ctx.find(StepCollector)
        self._anatomy = ctx.find(AnatomyCollector)
        self._compile = ctx.find(CompileCollector)
        steps = self._steps
        self.ckpt.install(ctx.config.buffer_size, (lambda: steps.count) if steps is not None else None)

    def uninstall(self) -> None:
        self.ckpt.uninstall()

    # ------------------------------------------------------------------------------------ agent thread
    def poll(self, now: float) -> None:
        tid = self._steps.tid if self._steps is not None else None
        if tid is not None and tid in self.ckpt.open and self._steps is not None:
            self._steps.busy_ts = time.time()  # a checkpoint in progress is progress (``StepCollector``)
        new = self.ckpt.buffer.drain()
        for _t0, _t1, _thread, save, done in new:
            if save:
                self.saved_at = done
            elif done == 0:
                self.resumed = True
        calls = self._other_threads + [(t0, t1, thread) for t0, t1, thread, _s, _d in new]
        self._other_threads = []
        for t0, t1, thread in calls:
            if tid is None and len(self._other_threads) < 1024:
                self._other_threads.append((t0, t1, thread))  # kept until the training thread is known
                continue
            if tid is None or thread == tid:
                self.ckpt_calls.append((t0, t1))
            self.ckpt_seconds += (t1 - t0) / 1e9
        if tid is None and self.ctx is not None and self.ctx.stopping:  # no step ever: all of them count
            self.ckpt_calls.extend((a, b) for a, b, _t in self._other_threads)
            self.ckpt_seconds += sum(b - a for a, b, _t in self._other_threads) / 1e9
            self._other_threads = []

    def on_step(self, rec: StepRecord) -> None:
        self.pending.append(rec)

    def end_pass(self) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        if self.attempts is None and ctx.run_dir:
            earlier = goodput_attempts.read(ctx.run_dir, ctx.topology.rank)
            self.attempts = goodput_attempts.Attempts(earlier, os.getpid(), self.ledger.start_ns)
            self.earlier = self.attempts.total()
        self._account_steps(ctx.stopping)
        now = time.time_ns()
        if not self.pending:
            if self._hung():
                if (culprit := self._culprit()) is not None or self._judged():
                    self.ledger.decide(culprit)
                self.ledger.span(now, "hang", self.ckpt_calls, self._compiles())
            elif ctx.stopping:  # the program's end after its last step, or a run that never stepped
                if self._judged():
                    self.ledger.decide(None)
                rest = "other" if self.ledger.steps else "startup"
                self.ledger.span(now, rest, self.ckpt_calls, self._compiles())
        if ctx.run_dir and (ctx.stopping or now - self._written_ns >= WRITE_EVERY_NS):
            self._written_ns = now
            self._write(ctx.run_dir, ctx.topology.rank)

    def _write(self, run_dir: str, rank: int) -> None:
        """This attempt's ledger into the run directory, beside the earlier attempts'."""
        base = self.base_step or 0
        current = {
            "pid": os.getpid(),
            "ledger": self.ledger.to_dict(),
            "base_step": base,
            "last_save_step": None if self.saved_at is None else base + self.saved_at,
        }
        earlier = self.attempts.earlier if self.attempts is not None else []
        try:
            goodput_attempts.write(run_dir, rank, earlier, current)
        except OSError as exc:
            self.record_error(exc)

    def _compiles(self) -> Iterable[tuple[int, int]]:
        return self._compile.intervals if self._compile is not None else ()

    def _hung(self) -> bool:
        """Whether the Hang detector concluded this rank is hung (``AgentContext.conclusions``)."""
        ctx = self.ctx
        if ctx is None or self._steps is None or time.time_ns() - self.ledger.covered_ns < 1e9:
            return False
        return HANG_ALERT in ctx.conclusions

    def _judged(self) -> bool:
        """Whether the Straggler detector has judged: until then exposed communication may be a wait
        for a slow rank (``Ledger.step``)."""
        return self.ctx is None or self.ctx.judged("Straggler")

    def _culprit(self) -> int | None:
        """The peer the Straggler detector names as the job's slow rank (None on that rank itself)."""
        sr = self.ctx.conclusions.get("Straggler") if self.ctx is not None else None
        return sr.peer if sr is not None and not sr.here else None

    def _account_steps(self, stopping: bool) -> None:
        """Account the pending steps the anatomy has finished, in order."""
        anatomy = self._anatomy
        mark = anatomy.span_watermark_ns() if anatomy is not None else None
        by_step: dict[int, tuple[float, dict[str, float], float]] | None = None
        culprit, judged = self._culprit(), self._judged()
        ckpt, compiles = merged(self.ckpt_calls), merged(self._compiles())  # once a pass, not a step
        att = self.attempts
        seen = att.steps_seen() if att is not None else 0
        while self.pending:
            rec = self.pending[0]
            if mark is not None and rec.start_ns >= mark and not stopping and len(self.pending) < MAX_PENDING:
                break
            self.pending.popleft()
            if by_step is None:
                hist = anatomy.history if anatomy is not None else []
                by_step = {h[0]: (h[1], h[2], h[3]) for h in hist}
            shares = self.shares
            if rec.step in by_step:
                step_s, phases, loader = by_step[rec.step]
                # no forward timed (the model not known yet): the time inside the loader is the data wait
                timed = "forward" in phases
                data = phases.get("data_wait", 0.0 if timed else loader)
                host = phases.get("host", 0.0)
                if not timed and self.ledger.steps == 0:
                    # the model found at this first step's optimizer step: all of it but the loader and the
                    # optimizer step is the program's set-up since attach (its own forward and backward too:
                    # one step's compute lost, against set-up of any length counted productive)
                    host = max(0.0, step_s - data - phases.get("optimizer", 0.0))
                if step_s > 0:
                    shares = Shares(data / step_s, host / step_s, phases.get("comm_exposed", 0.0) / step_s)
                    self._learn(shares)
            if self.base_step is None:  # resumed from the last checkpoint an earlier attempt saved, or anew
                self.base_step = att.last_save_step() if att is not None and self.resumed else 0
            again = self.base_step + rec.step < seen
            led = self.ledger
            led.step(rec.start_ns, rec.end_ns, shares, culprit, ckpt, compiles, again, judged)

    def _learn(self, s: Shares) -> None:
        w, o = SHARE_WEIGHT, self.shares
        if self.ledger.steps == 0:  # the first step's set-up says nothing of the steady ones
            return
        if o == Shares():
            self.shares = s
            return
        self.shares = Shares(
            o.data_wait + w * (s.data_wait - o.data_wait),
            o.host + w * (s.host - o.host),
            o.comm + w * (s.comm - o.comm),
        )

    # ------------------------------------------------------------------------------------ outputs
    def total(self) -> Ledger:
        """This attempt's ledger with the earlier attempts' seconds added."""
        own = self.ledger
        out = Ledger(
            own.start_ns, own.covered_ns, own.productive, dict(own.lost), dict(own.wait_by), own.steps
        )
        out.undecided.extend(own.undecided)
        out.older = own.older
        if self.earlier is not None:
            out.add(self.earlier)
        return out

    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        led = self.total()
        lost = f.counter("hpar_lost_seconds_total")
        for cause in CAUSES:
            if cause == "wait":
                named = sum(led.wait_by.values())
                for culprit, secs in sorted(led.wait_by.items()):
                    f.add(lost, [cause, str(culprit)], secs)
                if led.lost[cause] - named > 1e-9:
                    f.add(lost, [cause, ""], led.lost[cause] - named)
            elif led.lost[cause] > 0:
                f.add(lost, [cause, ""], led.lost[cause])
        yield lost
        prod = f.counter("hpar_productive_seconds_total")
        f.add(prod, [], led.productive)
        yield prod
        ratio = f.gauge("hpar_goodput_ratio")
        if (r := led.ratio()) is not None:
            f.add(ratio, [], r)
        yield ratio

    def summary(self) -> dict[str, Any]:
        out = self.total().to_dict()
        earlier = self.attempts.ledgers if self.attempts is not None else []
        out["start"] = min([self.ledger.start_ns, *(e.start_ns for e in earlier)]) / 1e9
        out["end"] = self.ledger.covered_ns / 1e9
        out["attempts"] = 1 + len(earlier)
        out["checkpoint_seconds_all_threads"] = round(self.ckpt_seconds, 6)
        out["steps_pending"] = len(self.pending)
        return out
