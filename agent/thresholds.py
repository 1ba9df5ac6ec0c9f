"""Every alert threshold, in one place.

``DETECTOR_PARAMS`` declares each in-process detector's parameters (name, default, meaning;
``thresholds={"<Alert>.<param>": v}`` overrides one per job) and ``COMPONENT_PARAMS`` those of the
detectors component (``detectors.<param>``); ``ANATOMY_DEFAULTS`` the step anatomy's verdict shares.
``RULE_THRESHOLDS`` are the numbers the Prometheus rules (``deploy/prometheus/rules/hpar-alerts.yml``)
compare with, in the order they appear in the rule's expression; where a rule measures what a detector
measures it takes the detector's number from here. The detectors, the config's validation, the docs
tables (``scripts/gen_docs.py``: each alert's parameters in ``docs/alerts.md``) and a test that reads
the rules file all use these tables, so a threshold changes in one place."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Param:
    """One parameter: its name (the part after ``<Alert>.``), default and meaning (the docs' table)."""

    name: str
    default: float
    help: str


#: alert -> its detector's parameters
DETECTOR_PARAMS: dict[str, tuple[Param, ...]] = {
    "RecompileStorm": (
        Param(
            "max_recompiles",
            10,
            "fire when more recompiles (plus limit hits) than this happen within `window_s`",
        ),
        Param(
            "max_limit_hits",
            0,
            "... or when more frames than this hit Dynamo's recompile limit within `window_s`",
        ),
        Param("window_s", 300, "window of the recompile count, seconds"),
        Param("min_hit_ratio", 0.3, "... or when the compile-cache hit ratio after warm-up is below this"),
        Param("min_lookups", 20, "... over at least this many cache lookups after warm-up"),
        Param("warmup_steps", 3, "cache lookups before this step (cold caches) are not judged"),
    ),
    "GraphBreaks": (
        Param("warmup_steps", 3, "reasons first seen before this many steps completed are the baseline"),
        Param("hold_steps", 20, "the alert stays active this many steps after the last new reason"),
    ),
    "CompileDivergence": (
        Param(
            "warmup_steps",
            3,
            "fingerprints are compared once every rank of the stage completed this many steps",
        ),
        Param(
            "settle_s", 2, "a rank publishes its fingerprint once its compiles were quiet this long, seconds"
        ),
    ),
    "ReplicaDivergence": (
        Param("every_steps", 10, "checksum a fixed sample of every parameter every this many steps"),
        Param("per_param", 16, "elements sampled per parameter (strided over the whole tensor)"),
    ),
    "CollectiveMismatch": (
        Param(
            "max_entries",
            256,
            "recent flight-recorder entries each rank publishes (up to 4x more where these span less "
            "than 3 median steps: Straggler measures whole steps)",
        ),
    ),
    "MemoryLeak": (
        Param("warmup_steps", 5, "samples before this step are ignored (allocator and caches filling)"),
        Param(
            "quiet_steps",
            3,
            "... and samples before compiles have been quiet this many steps (compile caches, "
            "loaded kernels)",
        ),
        Param(
            "max_busy_steps",
            10,
            "compiles going on for more steps than this are the job's steady state (a leak "
            "of compiled graphs), not warm-up",
        ),
        Param("window", 12, "post-step samples in the trend window"),
        Param("min_slope_bytes", 1 * MiB, "Theil-Sen slope in bytes a step that counts as growth (1 MiB)"),
        Param(
            "rss_min_slope_bytes",
            2 * MiB,
            "the same for host RSS (2 MiB), which glibc arenas and Python's allocator move on their own",
        ),
        Param(
            "min_increase_fraction",
            0.15,
            "fraction of steps that must rise (stair-steps; one jump is not a leak)",
        ),
    ),
    "CompiledGraphsGrowing": (
        Param("warmup_steps", 5, "graphs compiled before this step are warm-up"),
        Param("window_steps", 10, "steps looked back"),
        Param("min_graphs", 4, "graphs compiled in the window (after warm-up) that count as growth"),
        Param(
            "min_steps",
            3,
            "... spread over at least this many distinct steps (one late compile burst is not growth)",
        ),
    ),
    "CollectiveLatencyHigh": (
        Param(
            "slo_s",
            0.085,
            "p99 SLO of all_reduce (the SLI), seconds; `slo_s.<op>` sets another op's (e.g. "
            "`CollectiveLatencyHigh.slo_s.all_gather`): ops without one are not judged, as a "
            "p2p recv's time includes waiting for the peer's compute",
        ),
        Param("window_s", 60, "window of the p99, seconds"),
        Param("min_count", 20, "judged ops in the window before the p99 is judged"),
        Param(
            "quiet_steps", 3, "ops enqueued before compiles have been quiet this many steps are not judged"
        ),
        Param(
            "max_busy_steps", 10, "compiles going on for more steps than this are steady state, not warm-up"
        ),
        Param(
            "match_s",
            30,
            "an op whose peers' entries did not arrive within this many seconds is dropped unjudged",
        ),
    ),
    "Straggler": (
        Param(
            "max_lag_ratio",
            0.25,
            "fire when the others wait for this rank more than this share of its own step time (the "
            "median over the measured steps, counted once a step whatever the number of gradient "
            "buckets; a 1.5x slower rank scores 0.33, a 1.1x one 0.09)",
        ),
        Param(
            "warmup_steps",
            3,
            "collectives enqueued before this rank completed this many steps (compiles) are not judged",
        ),
        Param("min_window_steps", 12, "steps measured before a verdict (persistence, not one step)"),
        Param("window_steps", 64, "the last this many measured steps make the score (kept per peer)"),
        Param(
            "quiet_steps",
            3,
            "... nor before this rank's compiles were quiet this many steps (ranks compile at "
            "different speeds)",
        ),
        Param(
            "max_busy_steps", 10, "compiles going on for more steps than this are steady state, not warm-up"
        ),
    ),
    "Hang": (
        Param(
            "timeout_s",
            60,
            "silence that counts as a hang, seconds; raised to 10 median steps and capped at "
            "80% of the process group's timeout unless set explicitly",
        ),
        Param(
            "warmup_steps", 2, "no-progress is judged only after this many steps (the first steps compile)"
        ),
    ),
    "RankGone": (
        Param(
            "silent_s",
            6,
            "a peer is named only once a read of the store made this long after its last payload, "
            "seconds, or two exchange intervals and a late pass (1 s, or the agent's interval if longer) "
            "if longer, shows nothing newer (a live peer that missed one exchange is never that silent)",
        ),
    ),
    "GradSyncIncomplete": (
        Param("min_coverage", 0.99, "coverage below this fires: part of the gradient was never reduced"),
    ),
    "NumaMisbinding": (
        Param("min_shared_cpus", 1, "allowed CPUs that are ideal for the GPU, below which it fires"),
    ),
}
#: Parameter names (the part after ``<Alert>.``, without a ``.<op>`` suffix) that count things: whole
#: numbers. By ending, so that a new parameter of that kind is one without a declaration here.
_COUNTS = ("_steps", "_entries", "window", "_count", "_collectives", "_graphs", "_recompiles", "_hits")
_COUNTS_TOO = ("min_lookups", "min_shared_cpus", "per_param")
#: ... that are shares of a whole: 0..1.
_SHARES = ("_ratio", "_fraction", "_coverage", "_share", "min_explained")
#: ... that must be at least 1 (a divisor, a sample size).
_AT_LEAST_ONE = ("every_steps", "per_param", "window")


def param_bounds(name: str) -> tuple[bool, float, float]:
    """(whole number, lowest, highest) a value of the parameter ``name`` may take: what the config
    validates every override against (``config.threshold_problems``)."""
    base = name.split(".")[0]
    whole = base.endswith(_COUNTS) or base in _COUNTS_TOO
    return whole, 1.0 if base in _AT_LEAST_ONE else 0.0, 1.0 if base.endswith(_SHARES) else float("inf")


#: alert -> parameter -> default (from ``DETECTOR_PARAMS``)
DETECTOR_DEFAULTS: dict[str, dict[str, float]] = {
    alert: {p.name: p.default for p in params} for alert, params in DETECTOR_PARAMS.items()
}

#: parameters of the detectors component itself (``detectors.<param>``)
COMPONENT_PARAMS: tuple[Param, ...] = (
    Param("exchange_s", 3.0, "seconds between store exchanges (longer past 1,024 ranks)"),
    Param("exchange_min_s", 1.0, "the soonest an exchange follows the last when something changed, seconds"),
    Param("log_interval_s", 60.0, "one log line per alert per this many seconds"),
    Param("stale_s", 30.0, "peers' payloads older than this are ignored, seconds"),
)
COMPONENT_DEFAULTS: dict[str, float] = {p.name: p.default for p in COMPONENT_PARAMS}
COMPONENT_THRESHOLDS = tuple(COMPONENT_DEFAULTS)

#: the step anatomy's bottleneck verdict (``anatomy.<param>``): the share of step time at or above
#: which a rank is input-bound / pipeline-bound (its p2p waits) / host-bound / communication-bound, and the share the measured phases
#: must explain for compute-bound (below it, and no other cause reached: unknown)
ANATOMY_DEFAULTS: dict[str, float] = {
    "input_share": 0.2,
    "pipeline_share": 0.2,
    "host_share": 0.2,
    "comm_share": 0.3,
    "min_explained": 0.6,
}

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
    ("GpuThrottled", "throttle"): {"min_active": 0},
    ("GpuHardwareErrors", "xid"): {"max_xid_events": 0, "max_first_events": 0},
    ("GpuHardwareErrors", "memory_repair"): {"max_pending": 0, "max_retirements_pending": 0},
    ("GpuHardwareErrors", "nvlink"): {"max_errors": 0},
    ("HparAgentDown", "peer_up"): {"min_peers_up": 0},
    ("HparAgentDown", "job_active"): {"min_active": 0},
    ("HparAgentErrors", "agent_errors"): {"max_errors": 0},
    ("GradSyncIncomplete", "grad_sync_coverage"): {"min_coverage": _D["GradSyncIncomplete"]["min_coverage"]},
}
