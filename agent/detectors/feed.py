"""What feeds the detectors: each pass's ``Snapshot`` read from the collectors (through ``sources``),
and the compile warm-up signal tracked from pass to pass.

Every source is read inside its own guard: a reader that fails is counted and reads as no data, so one
broken source silences only the detectors that need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.snapshot import (
    CollectiveState,
    CompileState,
    CompileWarmup,
    GradSyncState,
    MemoryState,
    PeerView,
    Snapshot,
    TimedOp,
)

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

T = TypeVar("T")


def _ignore(exc: BaseException) -> None:
    return None


class DetectorFeed:
    """Builds the snapshot of a pass: ``snapshot`` at its start (what a payload is built from), then
    ``complete`` with what the exchange read. ``memory_window`` post-step samples per memory source and
    ``fr_limit`` flight-recorder entries are read (what MemoryLeak and CollectiveMismatch judge)."""

    def __init__(
        self, memory_window: int = 0, fr_limit: int = 256, on_error: Callable[[BaseException], None] = _ignore
    ) -> None:
        self.memory_window = memory_window
        self.fr_limit = fr_limit
        self.on_error = on_error
        self.fr = src.FrWindow()
        self._compile_token: tuple[float, ...] | None = None
        self._busy = False  # the last pass saw compile work
        self._busy_since = 0  # first step of the current stretch of passes that saw compile work
        self._last_ts = 0.0  # agent-thread time compile activity was last seen (0: never)
        self._last_step = 0

    def snapshot(self, ctx: AgentContext, now: float, evidence_on: bool = False) -> Snapshot:
        """The collectors' state now (no exchange yet: ``complete`` adds it). A payload is built from it."""
        steps_done, last_step_ts, durations = src.step_state(ctx)
        try:
            self._track_compiles(ctx, now, steps_done)
        except Exception as exc:
            self.on_error(exc)
        topo = ctx.topology
        return Snapshot(
            now=now, topology=topo, coords=topo.coords(), steps_done=steps_done, last_step_ts=last_step_ts,
            step_durations=durations, warmup=self._warmup(now, steps_done), compile=self._read(ctx, self._compile, None),
            memory=self._memory(ctx), collectives=self._collectives(ctx), grad_sync=self._read(ctx, self._grad_sync, None),
            binding=self._read(ctx, src.cpu_binding, None), model=ctx.model, evidence_on=evidence_on,
            stopping=ctx.stopping,
        )  # fmt: skip

    def complete(self, ctx: AgentContext, local: Snapshot, view: PeerView) -> Snapshot:
        """``local`` with what the exchange holds now. A fresh read brings the tp peers' gradient samples
        to the gradient-sync collector first, so the coverage read is the one just judged; whether the
        agent stops is read again (a stop ends the exchange's wait at once)."""
        grad = local.grad_sync
        if view.fresh:
            try:
                self._deliver_tp_samples(ctx, local.rank, view)
            except Exception as exc:
                self.on_error(exc)
            grad = self._read(ctx, self._grad_sync, None)
        return dataclasses.replace(local, exchange=view, grad_sync=grad, stopping=ctx.stopping)

    # ------------------------------------------------------------------------------------ readers
    def _read(self, ctx: AgentContext, reader: Callable[[AgentContext], T], default: T) -> T:
        try:
            return reader(ctx)
        except Exception as exc:
            self.on_error(exc)
            return default

    def _compile(self, ctx: AgentContext) -> CompileState | None:
        total = src.recompiles_total(ctx)
        if total is None:
            return None
        return CompileState(
            recompiles=total, limit_hits=src.recompile_limit_hits(ctx), cache_lookups=src.cache_lookups(ctx) or (0.0, 0.0),
            graph_breaks=src.graph_break_reasons(ctx), break_info=src.graph_break_info(ctx),
            graph_log=src.graph_compiles(ctx) or [], fingerprint=src.graph_fingerprint(ctx) or 0,
        )  # fmt: skip

    def _memory(self, ctx: AgentContext) -> MemoryState:
        return MemoryState(
            series=self._read(ctx, lambda c: src.memory_series(c, last=self.memory_window), {}),
            room=self._read(ctx, src.memory_room, {}),
        )

    def _collectives(self, ctx: AgentContext) -> CollectiveState:
        none: tuple[int, list[TimedOp]] = (0, [])
        timed, ops = self._read(ctx, src.timed_ops, none)
        return CollectiveState(
            timed=timed, timed_ops=ops, oldest_inflight=self._read(ctx, src.oldest_inflight, {}),
            groups=self._read(ctx, src.group_states, {}), pg_timeout_s=self._read(ctx, src.pg_timeout_s, None),
            fr_entries=self._read(ctx, lambda c: self.fr.read(c, self.fr_limit), []),
        )  # fmt: skip

    @staticmethod
    def _grad_sync(ctx: AgentContext) -> GradSyncState | None:
        got = src.grad_sync(ctx)
        return None if got is None else GradSyncState(*got)

    @staticmethod
    def _deliver_tp_samples(ctx: AgentContext, rank: int, view: PeerView) -> None:
        group = sig.group_of(view.peers, rank, sig.TP_KEYS, "gst")
        if len(group) < 2:
            return
        steps = set.intersection(*(set(view.peers[r]["gst"]) for r in group))
        for step in sorted(steps, key=int):
            src.judge_tp(ctx, int(step), {r: view.peers[r]["gst"][step] for r in group})

    # ------------------------------------------------------------------------------------ compile warm-up
    def _track_compiles(self, ctx: AgentContext, now: float, steps_done: int) -> None:
        token = src.compile_activity(ctx)
        if token is None:
            self._busy = False
            return
        prev = self._compile_token
        busy = token[-1] > 0 or (token != prev if prev is not None else any(token))
        self._compile_token = token
        if busy:
            if not self._busy:
                self._busy_since = steps_done
            self._last_ts = now
            self._last_step = steps_done
        self._busy = busy

    def _warmup(self, now: float, steps_done: int) -> CompileWarmup:
        return CompileWarmup(
            last_ts=self._last_ts, last_step=self._last_step,
            quiet_s=now - self._last_ts if self._last_ts else float("inf"), quiet_steps=steps_done - self._last_step,
            busy_steps=steps_done - self._busy_since if self._busy else 0,
        )  # fmt: skip
