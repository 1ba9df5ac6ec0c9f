"""What feeds the detectors: each pass's ``Snapshot`` read from the collectors (through ``sources``),
and the compile warm-up signal tracked from pass to pass.

Each collector's state is read inside its own guard: a reader that fails is counted and reads as no
data, so one broken collector silences only the detectors that need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.snapshot import CompileWarmup, PeerView, Snapshot

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

T = TypeVar("T")


def _ignore(exc: BaseException) -> None:
    return None


#: Median steps the flight-recorder window spans at least (``sources.FrWindow``): Straggler measures
#: steps whose start and end every rank's window covers
WINDOW_STEPS = 3


def _span_ns(durations: list[float]) -> int:
    return int(WINDOW_STEPS * sorted(durations)[len(durations) // 2] * 1e9) if durations else 0


class DetectorFeed:
    """Builds the snapshot of a pass (``snapshot``), completed with what the exchange read in it
    (``complete``). ``memory_window`` post-step samples per memory source and ``fr_limit`` flight-recorder
    entries are read (what MemoryLeak and CollectiveMismatch judge)."""

    def __init__(
        self, memory_window: int = 0, fr_limit: int = 256, on_error: Callable[[BaseException], None] = _ignore
    ) -> None:
        self.memory_window = memory_window
        self.fr_limit = fr_limit
        self.on_error = on_error
        self.fr = src.FrWindow()
        self._activity: tuple[float, ...] | None = None  # the compile collector's, at the last pass
        self._busy = False  # the last pass saw compile work
        self._busy_since = 0  # first step of the current stretch of passes that saw compile work
        self._last_ts = 0.0  # agent-thread time compile activity was last seen (0: never)
        self._last_step = 0

    def snapshot(
        self, ctx: AgentContext, now: float, exchange: PeerView | None = None, evidence_on: bool = False
    ) -> Snapshot:
        """The collectors' state now, with ``exchange``: what the exchange holds before this pass's turn
        (a payload is built from this snapshot; ``complete`` adds what the turn read)."""
        steps_done, last_step_ts, durations = src.step_state(ctx)
        unknown: tuple[float, float | None] = (last_step_ts, None)
        progress_ts, cpu_share = self._read(ctx, src.progress, unknown)
        topo = ctx.topology
        coords = topo.coords()
        comp = self._read(ctx, src.compile_state, None)
        self._track_compiles(comp, now, steps_done)
        return Snapshot(
            now=now,
            topology=topo,
            coords=coords,
            steps_done=steps_done,
            last_step_ts=last_step_ts,
            step_durations=durations,
            last_progress_ts=progress_ts,
            thread_cpu_share=cpu_share,
            warmup=self._warmup(now, steps_done),
            compile=comp,
            memory=self._read(ctx, lambda c: src.memory_state(c, self.memory_window), src.NO_MEMORY),
            collectives=self._read(
                ctx,
                lambda c: src.collective_state(c, self.fr, self.fr_limit, coords, _span_ns(durations)),
                src.NO_COLLECTIVES,
            ),
            grad_sync=self._read(ctx, src.grad_sync, None),
            binding=self._read(ctx, src.cpu_binding, None),
            gpu=self._read(ctx, src.gpu_health, None),
            model=ctx.model,
            evidence_on=evidence_on,
            stopping=ctx.stopping,
            exchange=exchange if exchange is not None else PeerView(),
        )

    def complete(self, ctx: AgentContext, snap: Snapshot, view: PeerView) -> Snapshot:
        """``snap`` with what the exchange holds after its turn. A fresh read brings the tp peers' gradient
        samples to the gradient-sync collector first, so the coverage read is the one just judged; whether
        the agent stops is read again (a stop ends the exchange's wait at once)."""
        grad = snap.grad_sync
        if view.fresh and grad is not None:  # a gradient-sync collector to judge the tp peers' samples
            try:
                self._deliver_tp_samples(ctx, snap.rank, view)
            except Exception as exc:
                self.on_error(exc)
            grad = self._read(ctx, src.grad_sync, None)
        return dataclasses.replace(snap, exchange=view, grad_sync=grad, stopping=ctx.stopping)

    def _read(self, ctx: AgentContext, reader: Callable[[AgentContext], T], default: T) -> T:
        try:
            return reader(ctx)
        except Exception as exc:
            self.on_error(exc)
            return default

    @staticmethod
    def _deliver_tp_samples(ctx: AgentContext, rank: int, view: PeerView) -> None:
        group = sig.group_of(view.peers, rank, sig.TP_KEYS, "gst")
        if len(group) < 2:
            return
        steps = set.intersection(*(set(view.peers[r]["gst"]) for r in group))
        for step in sorted(steps, key=int):
            src.judge_tp(ctx, int(step), {r: view.peers[r]["gst"][step] for r in group})

    # ------------------------------------------------------------------------------------ compile warm-up
    def _track_compiles(self, comp: src.CompileState | None, now: float, steps_done: int) -> None:
        if comp is None:
            self._busy = False
            return
        token, prev = comp.activity, self._activity
        busy = token[-1] > 0 or (token != prev if prev is not None else any(token))
        self._activity = token
        if busy:
            if not self._busy:
                self._busy_since = steps_done
            self._last_ts = now
            self._last_step = steps_done
        self._busy = busy

    def _warmup(self, now: float, steps_done: int) -> CompileWarmup:
        return CompileWarmup(
            last_ts=self._last_ts,
            last_step=self._last_step,
            quiet_s=now - self._last_ts if self._last_ts else float("inf"),
            quiet_steps=steps_done - self._last_step,
            busy_steps=steps_done - self._busy_since if self._busy else 0,
        )
