"""Every alert threshold, in one place.

``DETECTOR_DEFAULTS`` are the in-process detectors' parameters (``thresholds={"<Alert>.<param>": v}``
overrides one per job; each detector's docstring says what they mean); ``ANATOMY_DEFAULTS`` the step
anatomy's verdict shares. ``RULE_THRESHOLDS`` are the numbers the Prometheus rules
(``deploy/prometheus/rules/hpar-alerts.yml``) compare with, in the order they appear in the rule's
expression; where a rule measures what a detector measures it takes the detector's number from here.
The detectors, the config's validation, the docs table (``scripts/gen_docs.py``) and a test that reads
the rules file all use these tables, so a threshold changes in one place."""

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
    "RankGone": {"silent_s": 6},
    "GradSyncIncomplete": {"min_coverage": 0.99},
    "NumaMisbinding": {"min_shared_cpus": 1},
}

#: parameters of the detectors component itself (``detectors.<param>``), in seconds: between store
#: exchanges (longer past 1,024 ranks, ``crossrank.cadence``); the soonest an exchange follows the last
#: when something changed; one log line per alert per interval; peer payloads older than this are ignored
COMPONENT_DEFAULTS: dict[str, float] = {"exchange_s": 3.0, "exchange_min_s": 1.0, "log_interval_s": 60.0, "stale_s": 30.0}
COMPONENT_THRESHOLDS = tuple(COMPONENT_DEFAULTS)

#: the step anatomy's bottleneck verdict (``anatomy.<param>``): the share of step time at or above
#: which a rank is input-bound / host-bound / communication-bound, and the share the measured phases
#: must explain for compute-bound (below it, and no other cause reached: unknown)
ANATOMY_DEFAULTS: dict[str, float] = {"input_share": 0.2, "host_share": 0.2, "comm_share": 0.3, "min_explained": 0.6}

_D = DETECTOR_DEFAULTS

#: (alert, rule's ``signal`` label) -> {param: the number its expression compares with}, in the order of
#: the expression. Rules fed by a detector (``signal="detector"``) compare ``hpar_alert_active`` only.
RULE_THRESHOLDS: dict[tuple[str, str], dict[str, float]] = {
    ("RecompileStorm", "recompiles"): {"max_recompiles": _D["RecompileStorm"]["max_recompiles"]},
    ("RecompileStorm", "cache_hit_ratio"): {
        "min_hit_ratio": _D["RecompileStorm"]["min_hit_ratio"],
        "min_lookups": 10,  # per 5m over the fleet's scrapes (the detector counts 20 since its start)
        "stepped_before": 0,
    },
    ("RecompileStorm", "cache_pollution"): {
        "max_recompiles": _D["RecompileStorm"]["max_recompiles"],
        "min_hit_ratio": _D["RecompileStorm"]["min_hit_ratio"],
    },
    ("GraphBreaks", "new_graph_break_reason"): {"stepped_before": 0},
    ("CompileDivergence", "fingerprints"): {"max_distinct": 1},
    ("CollectiveLatencyHigh", "p99_latency"): {"slo_s": _D["CollectiveLatencyHigh"]["slo_s"]},
    ("Straggler", "step_time_ratio"): {"max_ratio_to_median": 1.2},
    ("Straggler", "compute_time_ratio"): {"max_ratio_to_median": 1.2},
    ("InputBound", "data_wait_ratio"): {"input_share": ANATOMY_DEFAULTS["input_share"]},
    ("MemoryLeak", "post_step_memory_slope"): {"min_slope_bytes_per_s": 65536},
    ("CompiledGraphsGrowing", "graphs_compiled"): {
        "max_graphs_10m": _D["CompiledGraphsGrowing"]["min_graphs"] - 1,  # > 3 fires at 4, as the detector
        "stepped_before": 0,
    },
    ("Hang", "no_step_progress"): {"max_step_age_s": 300},
    ("Hang", "inflight_age"): {"max_inflight_age_s": 120},
    ("Hang", "missing_from_collective"): {"max_inflight_age_s": 60},
    ("GpuMemoryNearFull", "nvml_memory"): {"max_used_fraction": 0.95},
    ("GpuEccErrors", "ecc"): {"max_uncorrected": 0},
    ("HparAgentDown", "peer_up"): {"min_peers_up": 0},
    ("HparAgentDown", "job_active"): {"min_active": 0},
    ("HparAgentErrors", "agent_errors"): {"max_errors": 0},
    ("GradSyncIncomplete", "grad_sync_coverage"): {"min_coverage": _D["GradSyncIncomplete"]["min_coverage"]},
}
