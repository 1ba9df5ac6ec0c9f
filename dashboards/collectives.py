"""The collectives dashboard: latency, bandwidth, FSDP, gradient sync, in-flight ops and cross-rank
skew per process group (the only board with the ``$pg`` variable)."""

from __future__ import annotations

from dashboards.panels import RI, SEL, SELPG, Board, Q, heatmap, ts, worst
from hpar_agent import catalogue as cat


def collectives() -> Board:
    b = Board(
        cat.DASH_COLLECTIVES,
        "hpar / Collectives",
        "Latency, bandwidth, in-flight ops and cross-rank skew of every process group.",
        pg_var=True,
    )
    b.row("Latency")
    ts(
        b,
        "p99 latency by op and pg",
        "Job-wide p99 (recording rule); CollectiveLatencyHigh fires for all_reduce above 85 ms.",
        [Q('job_pg_op:hpar_collective_duration_seconds:p99_5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    ts(
        b,
        "p50 latency by op and pg",
        "Job-wide median latency (recording rule).",
        [Q('job_pg_op:hpar_collective_duration_seconds:p50_5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    ts(
        b,
        "Slowest $topn: p99 latency by rank",
        "Per-rank p99 of the $topn (rank, pg, op) series with the highest peak in the time range; exemplars "
        "open the step's trace in Jaeger. Every rank: the latency heatmap below.",
        [
            Q(
                worst(
                    "histogram_quantile(0.99, sum by (job, instance, rank, pg, op, le) "
                    f"(rate(hpar_collective_duration_seconds_bucket{{{SELPG}}}[{RI}])))"
                ),
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
        w=12,
    )
    heatmap(
        b,
        "Collective latency by rank (heatmap)",
        "Mean latency of every rank's timed collectives in $pg (rows: ranks) over time. In a group the rank "
        "that arrives last waits least: a light row among dark ones is the late rank.",
        f"sum by (job, instance, rank) (rate(hpar_collective_duration_seconds_sum{{{SELPG}}}[{RI}])) / "
        f"sum by (job, instance, rank) (rate(hpar_collective_duration_seconds_count{{{SELPG}}}[{RI}]))",
        "s",
    )
    b.row("Throughput")
    ts(
        b,
        "Lowest $topn: bus bandwidth by rank",
        "Bus bandwidth of the last timed op (nccl-tests factors) of the $topn (rank, pg, op) series with the "
        "lowest minimum in the time range.",
        [
            Q(
                worst(
                    f"max by (job, instance, rank, pg, op) (hpar_collective_busbw_bytes_per_second{{{SELPG}}})",
                    best=True,
                ),
                "rank {{rank}} {{pg}} {{op}}",
            )
        ],
        "Bps",
    )
    ts(
        b,
        "Payload bytes per second",
        "Collective payload by pg and op.",
        [Q(f"sum by (pg, op) (rate(hpar_collective_bytes_total{{{SELPG}}}[{RI}]))", "{{pg}} {{op}}")],
        "Bps",
    )
    ts(
        b,
        "Ops per second",
        "Collectives observed, timed or not.",
        [Q(f"sum by (pg, op) (rate(hpar_collectives_total{{{SELPG}}}[{RI}]))", "{{pg}} {{op}}")],
        "ops",
    )
    ts(
        b,
        "Unobserved flight-recorder entries",
        "Entries overwritten before the agent read them.",
        [Q(f"sum by (pg) (rate(hpar_collective_unobserved_total{{{SELPG}}}[{RI}]))", "{{pg}}")],
        "short",
    )
    b.row("FSDP (sharded data parallel)")
    fsdp = SELPG + ',pg=~"dp_shard.*|dp_replicate|dp",op=~"all_gather|reduce_scatter|all_reduce"'
    ts(
        b,
        "FSDP all-gather / reduce-scatter bytes per second",
        "FSDP2's parameter all-gathers and gradient reduce-scatters on the dp_shard group, and HSDP's "
        "gradient all-reduce on dp_replicate (gloo runs a reduce-scatter as an all_reduce).",
        [Q(f"sum by (pg, op) (rate(hpar_collective_bytes_total{{{fsdp}}}[{RI}]))", "{{pg}} {{op}}")],
        "Bps",
    )
    ts(
        b,
        "FSDP all-gather / reduce-scatter p99 latency by rank",
        "Per-rank p99 of FSDP's collectives, the slowest $topn; empty where the backend gives no durations "
        "(gloo).",
        [
            Q(
                worst(
                    "histogram_quantile(0.99, sum by (job, instance, rank, pg, op, le) "
                    f"(rate(hpar_collective_duration_seconds_bucket{{{fsdp}}}[{RI}])))"
                ),
                "rank {{rank}} {{pg}} {{op}}",
                exemplar=True,
            )
        ],
        "s",
    )
    b.row("Gradient sync")
    ts(
        b,
        "Gradient-sync coverage: lowest $topn ranks",
        "Gradient elements each step reduced over the dp groups / trainable gradient elements it must "
        "reduce (1 when whole; a block outside the DDP/FSDP wrapper shows below 1), the $topn ranks with "
        "the lowest minimum in the time range. GradSyncIncomplete fires below 0.99.",
        [Q(worst(f"hpar_grad_sync_coverage_ratio{{{SEL}}}", best=True), "rank {{rank}} {{group}}")],
        "percentunit",
        w=24,
    )
    b.row("In flight and skew")
    ts(
        b,
        "Ops in flight: highest $topn",
        "Ops enqueued but not completed per rank and group; the $topn highest.",
        [Q(worst(f"hpar_collective_inflight{{{SELPG}}}"), "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Oldest in-flight age: highest $topn",
        "Age of the oldest incomplete op, the $topn oldest; Hang fires above 120 s.",
        [Q(worst(f"hpar_collective_oldest_inflight_age_seconds{{{SELPG}}}"), "rank {{rank}} {{pg}}")],
        "s",
        w=8,
    )
    ts(
        b,
        "Last completed seq: lowest $topn",
        "The rank lagging behind its group is the one the others wait for: the $topn lowest.",
        [Q(worst(f"hpar_collective_last_completed_seq{{{SELPG}}}", best=True), "rank {{rank}} {{pg}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Mean latency by rank: lowest $topn",
        "The rank with the lowest mean waited least: it arrived last. The $topn lowest (recording rule).",
        [
            Q(
                worst(
                    f"rank_pg_op:hpar_collective_duration_seconds:mean5m{{{SELPG}}}", best=True, join=False
                ),
                "rank {{rank}} {{pg}} {{op}}",
            )
        ],
        "s",
    )
    ts(
        b,
        "Skew across ranks",
        "Max - min of per-rank mean latency per group and op (recording rule).",
        [Q('job_pg_op:hpar_collective_duration_seconds:rank_skew5m{job=~"$job",pg=~"$pg"}', "{{pg}} {{op}}")],
        "s",
    )
    return b
