"""Detectors that need only this rank's state: compile storms and breaks, leaks, latency, hangs."""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import TYPE_CHECKING, Any

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.component import DetectorsComponent

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

    | param | default | meaning |
    |---|---|---|
    | max_recompiles | 10 | fire when more recompiles (+ limit hits) than this happen within window_s |
    | max_limit_hits | 0 | ... or when more frames than this hit Dynamo's recompile limit within window_s |
    | window_s | 300 | window of the recompile count, seconds |
    | min_hit_ratio | 0.3 | ... or when the compile-cache hit ratio after warm-up is below this |
    | min_lookups | 20 | ... over at least this many cache lookups after warm-up |
    | warmup_steps | 3 | cache lookups before this step (cold caches) are not judged |

    A limit hit is a storm by itself: the frame already recompiled ``recompile_limit`` times (8 by
    default, shared by every module instance of one code object, so a per-step storm on identical
    blocks never exceeds 10 recompiles) and now runs uncompiled for good. Value: recompiles in the window.
    """

    name = "RecompileStorm"
    defaults = {"max_recompiles": 10, "max_limit_hits": 0, "window_s": 300, "min_hit_ratio": 0.3, "min_lookups": 20,
                "warmup_steps": 3}
    threshold_param = "max_recompiles"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.window = _Windowed()
        self.limit_window = _Windowed()
        self.cache_base: tuple[float, float] | None = None

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        total = src.recompiles_total(ctx.agent)
        if total is None:
            return None
        n = self.window.increase(ctx.now, total, self.p("window_s"))
        limit_hits = self.limit_window.increase(ctx.now, src.recompile_limit_hits(ctx.agent), self.p("window_s"))
        details: dict[str, Any] = {"recompiles_in_window": n, "limit_hits_in_window": limit_hits}
        ratio = math.nan
        lookups = src.cache_lookups(ctx.agent)
        if lookups is not None and ctx.steps_done >= self.p("warmup_steps"):
            if self.cache_base is None:
                self.cache_base = lookups
            hits, misses = lookups[0] - self.cache_base[0], lookups[1] - self.cache_base[1]
            ratio = sig.hit_ratio(hits, misses)
            details.update(cache_hits=hits, cache_misses=misses, hit_ratio=ratio)
            if hits + misses < self.p("min_lookups"):
                ratio = math.nan
        low_hits = not math.isnan(ratio) and ratio < self.p("min_hit_ratio")
        storm = n > self.p("max_recompiles") or limit_hits > self.p("max_limit_hits")
        return Verdict(storm or low_hits, n, details)


class GraphBreaks(Detector):
    """A graph-break reason never seen during warm-up (``.item()``, print, data-dependent branches).

    | param | default | meaning |
    |---|---|---|
    | warmup_steps | 3 | reasons first seen before this many steps completed are the baseline |
    | hold_steps | 20 | the alert stays active this many steps after the last new reason |

    Value: number of new reasons. Details carry the collector's text (user stack) per reason.
    """

    name = "GraphBreaks"
    defaults = {"warmup_steps": 3, "hold_steps": 20}
    threshold_param = "warmup_steps"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.first_seen: dict[str, int] = {}
        self.last_new_step = -1

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        reasons = src.graph_break_reasons(ctx.agent)
        for r in reasons:
            self.first_seen.setdefault(r, ctx.steps_done)
        new = sig.new_reasons(self.first_seen, int(self.p("warmup_steps")), 0)
        fresh = [r for r in new if self.first_seen[r] > self.last_new_step]
        if fresh:
            self.last_new_step = max(self.first_seen[r] for r in fresh)
        active = bool(new) and ctx.steps_done - self.last_new_step <= self.p("hold_steps")
        details = {"reasons": {r: src.graph_break_detail(ctx.agent, r) for r in new[:8]}}
        return Verdict(active, float(len(new)), details)


class MemoryLeak(Detector):
    """Post-step memory that keeps rising after warm-up (held tensors, per-microbatch graph leaks).

    | param | default | meaning |
    |---|---|---|
    | warmup_steps | 5 | samples before this step are ignored (allocator and caches filling) |
    | window | 20 | post-step samples in the trend window |
    | min_slope_bytes | 1048576 | Theil-Sen slope (bytes/step) that counts as growth (1 MiB) |
    | min_increase_fraction | 0.2 | fraction of steps that must rise (stair-steps; one jump is not a leak) |

    Per source (allocator, nvml, rss); the worst source fires. Value: slope in bytes/step. An allocator
    that grows to a plateau fails the "second half still rising" test; see ``signals.leak_signal``.
    On CUDA the allocator's history recording starts when a leak is first suspected (slope above
    threshold), so the snapshot taken at confirmation has allocation stacks.
    """

    name = "MemoryLeak"
    defaults = {"warmup_steps": 5, "window": 20, "min_slope_bytes": MiB, "min_increase_fraction": 0.2}
    threshold_param = "min_slope_bytes"
    evidence = ("pyspy", "allocator")
    clear = 3

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        series = src.memory_series(ctx.agent)
        if not series:
            return None
        worst: tuple[float, bool, str] = (-math.inf, False, "")
        for source, samples in series.items():
            slope, leaking = sig.leak_signal(
                samples,
                warmup_steps=int(self.p("warmup_steps")),
                window=int(self.p("window")),
                min_slope=self.p("min_slope_bytes"),
                min_increase_fraction=self.p("min_increase_fraction"),
            )
            if (leaking, slope) > (worst[1], worst[0]):
                worst = (slope, leaking, source)
        slope, leaking, source = worst
        if ctx.evidence is not None and ctx.agent.config.evidence:
            if slope >= self.p("min_slope_bytes"):
                ctx.evidence.start_memory_history()  # suspected: record stacks for the confirmation
            elif not leaking:
                ctx.evidence.stop_memory_history()  # cleared: recording costs every allocation
        return Verdict(leaking, slope if math.isfinite(slope) else 0.0, {"source": source})


class CollectiveLatencyHigh(Detector):
    """Slow links or long tails: a (pg, op)'s p99 over the recent window above its SLO.

    | param | default | meaning |
    |---|---|---|
    | slo_s | 0.085 | p99 SLO in seconds of all_reduce (the SLI) |
    | slo_s.<op> | - | SLO of another op, e.g. ``CollectiveLatencyHigh.slo_s.all_gather``; ops without one
      are not judged: a p2p recv's time includes waiting for the peer's compute, not only the link |
    | window_s | 60 | window of the p99, seconds |
    | min_count | 20 | ops in the window before the p99 is judged |

    Value: p99 in seconds of the (pg, op) furthest above its SLO (bucket upper bound, as histogram_quantile).
    """

    name = "CollectiveLatencyHigh"
    defaults = {"slo_s": 0.085, "window_s": 60, "min_count": 20}
    threshold_param = "slo_s"

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.snaps: dict[tuple[str, str], deque[tuple[float, list[int]]]] = {}

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        hists = src.latency_histograms(ctx.agent)
        if not hists:
            return None
        worst = (0.0, 0.0, "")  # (p99 / slo, p99, "pg/op")
        for (pg, op), (bounds, counts) in hists.items():
            snaps = self.snaps.setdefault((pg, op), deque([(ctx.now, [0] * len(counts))], maxlen=1024))
            snaps.append((ctx.now, counts))
            while len(snaps) > 1 and snaps[1][0] <= ctx.now - self.p("window_s"):
                snaps.popleft()
            delta = [a - b for a, b in zip(counts, snaps[0][1], strict=True)]
            if sum(delta) < self.p("min_count"):
                continue
            p99 = sig.quantile_from_counts(bounds, delta, 0.99)
            slo = self.params.get(f"slo_s.{op}", self.p("slo_s") if op == "all_reduce" else None)
            if slo is None:
                continue
            if p99 / slo > worst[0]:
                worst = (p99 / slo, p99, f"{pg}/{op}")
        return Verdict(worst[0] > 1.0, worst[1], {"worst": worst[2], "ratio_to_slo": worst[0]})


class Hang(Detector):
    """A rank stuck in or missing a collective: an op in flight, or no step, for too long.

    | param | default | meaning |
    |---|---|---|
    | timeout_s | 60 | silence that counts as a hang; raised to 10 median steps, capped at 80% of the pg timeout |
    | warmup_steps | 2 | no-progress is judged only after this many steps (first steps compile) |

    An explicit ``Hang.timeout_s`` is used as is. Value: the longer of (seconds since the last step,
    oldest in-flight age). The agent thread keeps evaluating while training is blocked in C++.
    """

    name = "Hang"
    defaults = {"timeout_s": 60, "warmup_steps": 2}
    threshold_param = "timeout_s"
    evidence = ("pyspy", "fr")

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.explicit = f"{self.name}.timeout_s" in (thresholds or {})

    def timeout(self, ctx: DetectorsComponent) -> float:
        if self.explicit:
            return self.p("timeout_s")
        durations = ctx.step_durations[-64:]
        return sig.hang_timeout(self.p("timeout_s"), src.pg_timeout_s(ctx.agent), median(durations) if durations else None)

    def evaluate(self, ctx: DetectorsComponent) -> Verdict | None:
        stalled = sig.stalled_seconds(ctx.now, ctx.last_step_ts, ctx.steps_done, int(self.p("warmup_steps")))
        inflight = src.oldest_inflight(ctx.agent)
        pg, age = max(inflight.items(), key=lambda kv: kv[1], default=("", 0.0))
        timeout = self.timeout(ctx)
        value = max(stalled, age)
        return Verdict(
            value > timeout,
            value,
            {"no_step_s": stalled, "oldest_inflight_s": age, "pg": pg, "timeout_s": timeout},
        )
