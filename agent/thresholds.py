"""Every detector's default parameters, in one table: the detectors, the config's validation of
``thresholds`` overrides, the Prometheus rule generator and the README read it (``<Alert>.<param>``
overrides a value per job). Each detector's docstring says what its parameters mean."""

from __future__ import annotations

MiB = 1 << 20

#: alert -> parameter -> default
DETECTOR_DEFAULTS: dict[str, dict[str, float]] = {
    "RecompileStorm": {"max_recompiles": 10, "max_limit_hits": 0, "window_s": 300, "min_hit_ratio": 0.3, "min_lookups": 20, "warmup_steps": 3},
    "GraphBreaks": {"warmup_steps": 3, "hold_steps": 20},
    "CompileDivergence": {"warmup_steps": 3, "settle_s": 2},
    "ReplicaDivergence": {"every_steps": 10, "per_param": 16},
    "CollectiveMismatch": {"max_entries": 256},
    "MemoryLeak": {"warmup_steps": 5, "quiet_steps": 3, "max_busy_steps": 10, "window": 12, "min_slope_bytes": 1 * MiB, "rss_min_slope_bytes": 2 * MiB, "min_increase_fraction": 0.15},
    "CompiledGraphsGrowing": {"warmup_steps": 5, "window_steps": 10, "min_graphs": 4, "min_steps": 3},
    "CollectiveLatencyHigh": {"slo_s": 0.085, "window_s": 60, "min_count": 20, "quiet_steps": 3, "max_busy_steps": 10, "match_s": 30},
    "Straggler": {"max_lag_ratio": 0.25, "min_collectives": 8, "warmup_steps": 3, "min_window_steps": 3, "quiet_steps": 3, "max_busy_steps": 10},
    "Hang": {"timeout_s": 60, "warmup_steps": 2},
    "GradSyncIncomplete": {"min_coverage": 0.99},
    "NumaMisbinding": {"min_shared_cpus": 1},
}

#: parameters of the detectors component itself (``detectors.<param>``)
COMPONENT_THRESHOLDS = ("exchange_s", "log_interval_s", "stale_s")
