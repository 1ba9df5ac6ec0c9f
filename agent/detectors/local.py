"""Detectors that need only this rank's state: compile storms and breaks, leaks, latency."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping
from statistics import median
from typing import TYPE_CHECKING, Any

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import Detector, FeedNeeds, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot

MiB = float(1 << 20)


class _Windowed:
    """(time, total) snapshots of a cumulative counter, to read its increase over a time window."""

    def __init__(self) -> None:
        self.snaps: deque[tuple[float, float]] = deque(maxlen=4096)

    def increase(self, now: float, total: float, window_s: float) -> float:
        if not self.snaps:
            self.snaps.append((now, 0.0))  # collectors count from attach: all of it is in the window
        self.snaps.append((now, total))
        while len(self.snaps) > 1 and self.snaps[1][0] <= now - window_s:
            self.snaps.popleft()
        return total - self.snaps[0][1]


class RecompileStorm(Detector):
    """Compile-cache pollution: shapes, Python ints or dtypes that change every step.

    A limit hit is a storm by itself: the frame already recompiled ``recompile_limit`` times (8 by
    default, shared by every module instance of one code object, so a per-step storm on identical
    blocks never exceeds 10 recompiles) and now runs uncompiled for good. Value: recompiles in the window.

    ``details.mode`` says which condition holds: ``cache_pollution`` is the design document's signal,
    both at once (more than ``max_recompiles`` recompiles in the window AND a hit ratio below
    ``min_hit_ratio``: the cache fills with graphs that are never hit again); ``recompiles``,
    ``limit`` and ``cache_hit_ratio`` are one condition alone.
    """

    name = "RecompileStorm"
    threshold_param = "max_recompiles"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.window = _Windowed()
        self.limit_window = _Windowed()
        self.cache_base: tuple[float, float] | None = None

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        c = snap.compile
        if c is None:
            return None
        n = self.window.increase(snap.now, c.recompiles, self.p("window_s"))
        limit_hits = self.limit_window.increase(snap.now, c.limit_hits, self.p("window_s"))
        details: dict[str, Any] = {"recompiles_in_window": n, "limit_hits_in_window": limit_hits}
        ratio = math.nan
        lookups = c.cache_lookups
        if snap.steps_done >= self.p("warmup_steps"):
            if self.cache_base is None:
                self.cache_base = lookups
            hits, misses = lookups[0] - self.cache_base[0], lookups[1] - self.cache_base[1]
            ratio = sig.hit_ratio(hits, misses)
            details.update(cache_hits=hits, cache_misses=misses, hit_ratio=ratio)
            if hits + misses < self.p("min_lookups"):
                ratio = math.nan
        low_hits = not math.isnan(ratio) and ratio < self.p("min_hit_ratio")
        many = n > self.p("max_recompiles")
        limit = limit_hits > self.p("max_limit_hits")
        details["mode"] = (
            "cache_pollution"
            if many and low_hits
            else "recompiles"
            if many
            else "limit"
            if limit
            else "cache_hit_ratio"
            if low_hits
            else ""
        )
        return Verdict(many or limit or low_hits, n, details)


class GraphBreaks(Detector):
    """A graph-break reason never seen during warm-up (``.item()``, print, data-dependent branches).

    Value: number of new reasons. Details carry the collector's text (user stack) per reason, and
    ``c10d_calls`` when a break comes from a torch.distributed (c10d) call inside compiled code.
    """

    name = "GraphBreaks"
    threshold_param = "warmup_steps"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.first_seen: dict[str, int] = {}
        self.last_new_step = -1

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        c = snap.compile
        for r in c.graph_breaks if c is not None else ():
            self.first_seen.setdefault(r, snap.steps_done)
        new = sig.new_reasons(self.first_seen, int(self.p("warmup_steps")), 0)
        fresh = [r for r in new if self.first_seen[r] > self.last_new_step]
        if fresh:
            self.last_new_step = max(self.first_seen[r] for r in fresh)
        active = bool(new) and snap.steps_done - self.last_new_step <= self.p("hold_steps")
        details: dict[str, Any] = {"reasons": {r: c.break_detail(r) if c else "" for r in new[:8]}}
        c10d = {r: op for r in new[:8] if c is not None and (op := c.break_c10d(r))}
        if c10d:  # a torch.distributed call inside compiled code: the fix is functional collectives
            details["c10d_calls"] = c10d
            details["fix"] = "use torch.distributed._functional_collectives inside compiled code"
        return Verdict(active, float(len(new)), details, threshold=0.0)  # new reasons past warm-up


#: memory sources the CUDA allocator's history explains
DEVICE_SOURCES = frozenset({"allocator", "reserved", "nvml"})


class MemoryLeak(Detector):
    """Post-step memory that keeps rising after warm-up (held tensors, per-microbatch graph leaks).

    Per source (allocator, reserved, nvml, rss); the worst source fires. Value: slope in bytes/step. Growth must
    go on across the whole window (``signals.leak_signal``): an allocator or RSS that grows through
    warm-up and flattens fails, a stair-step leak passes. Detection: about ``quiet_steps + window`` steps
    after the first compiles (a 4 MiB/step leak from step 3 fires near step 16).
    On CUDA the allocator's history recording starts when a leak is first suspected (slope above
    threshold), so the snapshot taken at confirmation has allocation stacks. For a device source the
    details say when the device is full at this slope (``forecast``, ``full_at_step``,
    ``seconds_to_full``); within ``window`` steps of it the recording resumes for the out-of-memory's
    snapshot.
    """

    name = "MemoryLeak"
    threshold_param = "min_slope_bytes"
    evidence = ("pyspy", "allocator", "profile")  # profile: a bounded py-spy record, off both threads
    clear = 3
    stack_detail = "stack_at_firing"  # what the training thread was doing then, not where it allocated

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.start = 0  # first step of the trend: after warm-up and after the compiles of warm-up
        self._confirmed = False  # fired: its snapshot took the recorded stacks

    def needs(self) -> FeedNeeds:
        return FeedNeeds(memory_window=int(self.p("window")))

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        series = snap.memory.series  # the last ``window`` samples: the trend reads no more
        if not series:
            return None
        if snap.warmup.busy_steps <= self.p("max_busy_steps"):
            self.start = max(self.start, snap.warmup.last_step + int(self.p("quiet_steps")))
        start = max(int(self.p("warmup_steps")), self.start)
        worst: tuple[float, bool, str] = (-math.inf, False, "")
        suspected = False
        for source, samples in series.items():
            slope, leaking = sig.leak_signal(
                samples,
                warmup_steps=start,
                window=int(self.p("window")),
                min_slope=self.p("rss_min_slope_bytes" if source == "rss" else "min_slope_bytes"),
                min_increase_fraction=self.p("min_increase_fraction"),
            )
            if (leaking, slope) > (worst[1], worst[0]):
                worst = (slope, leaking, source)
            if source in DEVICE_SOURCES and slope >= self.p("min_slope_bytes"):
                suspected = True  # host RSS says nothing about the CUDA allocator's stacks
        slope, leaking, source = worst
        details: dict[str, Any] = {
            "source": source,
            "trend_from_step": start,
            **self.forecast(snap, source, slope),
        }
        history = None
        if snap.evidence_on:
            left = details.get("full_at_step", math.inf) - snap.steps_done
            history = self._history(suspected, leaking, imminent=left <= self.p("window"))
        return Verdict(leaking, slope if math.isfinite(slope) else 0.0, details, memory_history=history)

    def fired_details(
        self, evidence: Any, snap: Snapshot, value: float, details: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The leak's site: the allocating site whose live bytes grew over the steps the allocator's
        history recorded (``memory_forensics.leak_site``), or ``site: "unknown"`` and why."""
        if evidence is None:
            return {"site": "unknown", "site_unknown": "evidence collection is off (HPAR_EVIDENCE)"}
        recorded, steps, why = evidence.take_snapshot()  # taken either way: a snapshot can be large
        source = details.get("source")
        if source not in DEVICE_SOURCES:
            why = f"the memory that grew is the host's ({source}): the CUDA allocator's history covers device memory only"
        elif recorded is not None:
            from hpar_agent.memory_forensics import leak_site

            index = getattr(evidence.device, "index", None)
            return leak_site(recorded, index, steps or 0, value)
        return {"site": "unknown", "site_unknown": why}

    @staticmethod
    def forecast(snap: Snapshot, source: str, slope: float) -> dict[str, Any]:
        """When a device source grows: the step at which, at this slope, the device is full (the
        headroom used up, ``sources.memory_room``), and in how long at the median step time."""
        room = snap.memory.room.get(source)
        durations = snap.step_durations[-64:]
        full = (
            sig.time_to_full(room, slope, snap.steps_done, median(durations) if durations else None)
            if room is not None
            else None
        )
        if full is None:
            return {}
        step, seconds = full
        text = f"at {slope / MiB:.1f} MiB/step the device is full at step {step}"
        return {
            "room_bytes": room,
            "full_at_step": step,
            "seconds_to_full": seconds,
            "forecast": text + (f" (in ~{_duration(seconds)})" if seconds is not None else ""),
        }

    def _history(self, suspected: bool, leaking: bool, imminent: bool = False) -> bool | None:
        """Whether to record CUDA allocation stacks (``Verdict.memory_history``): at a cost on every
        allocation and free, so only while a device leak is suspected and not yet confirmed: the
        snapshot taken when the alert fires stops the recording, and it stays off until the leak clears,
        unless the device is full within the trend window: the out-of-memory's own snapshot then names
        the code holding the memory."""
        if leaking:
            self._confirmed = True
        elif self._confirmed:
            self._confirmed = False  # cleared: the next suspicion may record again
        if suspected and (not self._confirmed or imminent):
            return True
        if not suspected or not leaking:
            return False
        return None


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


class CompiledGraphsGrowing(Detector):
    """Compiled graphs still growing after warm-up: the PP x compile-cache leak (a fresh compiled
    function per microbatch that the schedule keeps alive; its graphs and their memory grow).

    Value: graphs compiled in the window. Details name the code location (function file:line) that
    compiled most of them; MemoryLeak's evidence (py-spy profile) shows where it is called from.
    """

    name = "CompiledGraphsGrowing"
    threshold_param = "min_graphs"
    clear = 3

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        if snap.compile is None:
            return None
        log = snap.compile.graph_log
        lo = max(int(self.p("warmup_steps")), snap.steps_done - int(self.p("window_steps")))
        recent = [where for step, where in log if step >= lo]
        steps = {step for step, _ in log if step >= lo}
        by = Counter(recent)
        growing = (
            snap.steps_done >= self.p("warmup_steps")
            and len(recent) >= self.p("min_graphs")
            and len(steps) >= self.p("min_steps")
        )
        details: dict[str, Any] = {
            "location": by.most_common(1)[0][0] if by else "",
            "graphs_in_window": len(recent),
            "steps_with_compiles": len(steps),
            "by_location": dict(by.most_common(3)),
            "graphs_total": len(log),
        }
        return Verdict(growing, float(len(recent)), details)


class CollectiveLatencyHigh(Detector):
    """Slow links or long tails: a (pg, op)'s p99 transfer time over the recent window above its SLO
    (``slo_s.<op>``: another op's SLO; ops without one are not judged).

    Judges the transfer, not the wait for a late peer: a timed op's duration (NCCL starts timing when
    the kernel starts, and the kernel waits for every member) includes the time until the last member
    enqueued. Each op of a group with peers is matched with the peers' flight-recorder entries of the
    same (pg, seq) from the cross-rank exchange, and its arrival skew (last member's enqueue time minus
    ours) is subtracted (``signals.net_of_skew``): what remains is what the last-arriving rank timed.
    Ops no peer entry matched are not judged; ops of a single-rank job are judged as timed. A rank
    late to every collective is a Straggler, not a slow link. Compile warm-up (ranks compiling at
    different speeds) is skipped. Value: the p99 in seconds of the (pg, op) furthest above its SLO.
    """

    name = "CollectiveLatencyHigh"
    threshold_param = "slo_s"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.seen = 0  # ops timed so far that were read
        self.pending: deque[tuple[str, str, int, int, float, float]] = deque(maxlen=8192)  # + time read
        self.judged: dict[tuple[str, str], deque[tuple[float, float]]] = {}  # (pg, op) -> (time, net seconds)
        self.open_ns = 0  # ops enqueued before this (epoch ns) are warm-up: 0 while warming up

    def _slo(self, op: str) -> float | None:
        return self.params.get(f"slo_s.{op}", self.p("slo_s") if op == "all_reduce" else None)

    def _read(self, snap: Snapshot) -> None:
        total, ops = snap.collectives.timed, snap.collectives.timed_ops
        new = min(total - self.seen, len(ops))
        self.seen = total
        warm = snap.warmup.warmed_up(int(self.p("quiet_steps")), int(self.p("max_busy_steps")))
        if not warm:
            self.open_ns = 0
        elif not self.open_ns:
            self.open_ns = int(snap.now * 1e9)
        for pg, op, seq, created, seconds in ops[len(ops) - new :] if new > 0 else ():
            if self.open_ns and created >= self.open_ns and self._slo(op) is not None:
                self.pending.append((pg, op, seq, created, seconds, snap.now))

    def _match(self, snap: Snapshot) -> None:
        """Move pending ops to the window, net of skew, once the peers' entries show every arrival."""
        single = snap.topology.world_size <= 1
        arrivals: dict[tuple[str, int], list[int]] = {}
        if not single and snap.exchange.fresh:
            for key, by_rank in snap.exchange.common.items():
                arrivals[key] = [e[5] for e in by_rank.values()]
        keep: deque[tuple[str, str, int, int, float, float]] = deque(maxlen=self.pending.maxlen)
        for item in self.pending:
            pg, op, seq, created, seconds, t_read = item
            at = None if single or seq < 0 else arrivals.get((src.group_key_of(pg, snap.coords), seq))
            if single or seq < 0:  # p2p: no (pg, seq) to match; judged as timed where it has an SLO
                net = seconds
            elif at is not None:
                net = sig.net_of_skew(seconds, created, at)
            else:
                if snap.now - t_read < self.p("match_s"):
                    keep.append(item)
                continue
            self.judged.setdefault((pg, op), deque(maxlen=4096)).append((created / 1e9, net))
        self.pending = keep

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        self._read(snap)
        self._match(snap)
        if not self.judged:
            return None
        worst = (0.0, 0.0, "", math.nan)  # (p99 / slo, p99, "pg/op", slo)
        counted = 0
        for (pg, op), window in self.judged.items():
            while window and window[0][0] <= snap.now - self.p("window_s"):
                window.popleft()
            slo = self._slo(op)
            counted += len(window)
            if slo is None or len(window) < self.p("min_count"):
                continue
            p99 = sig.quantile([v for _, v in window], 0.99)
            if p99 / slo > worst[0]:
                worst = (p99 / slo, p99, f"{pg}/{op}", slo)
        details = {
            "worst": worst[2],
            "ratio_to_slo": worst[0],
            "judged": counted,
            "unmatched": len(self.pending),
        }
        # the worst op's p99 against its own SLO (slo_s, or a per-op one)
        return Verdict(
            worst[0] > 1.0, worst[1], details, threshold=None if math.isnan(worst[3]) else worst[3]
        )
