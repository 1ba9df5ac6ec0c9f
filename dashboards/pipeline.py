"""The pipeline-parallel dashboard: per-stage chunk times, bubbles, busy time against the stage
median, and chunks per stream."""

from __future__ import annotations

from dashboards.panels import RI, SEL, Board, Q, ts, worst
from hpar_agent import catalogue as cat


def pipeline() -> Board:
    b = Board(
        cat.DASH_PIPELINE, "hpar / Pipeline", "Per-stage forward/backward chunk times and pipeline bubbles."
    )
    b.row("Stages")
    ts(
        b,
        "Chunk time p99 by stage and phase",
        "Per-microbatch compute time; exemplars open the step's trace.",
        [
            Q(
                f"histogram_quantile(0.99, sum by (pp_stage, phase, le) (rate(hpar_pp_chunk_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                "stage {{pp_stage}} {{phase}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Mean chunk time: slowest $topn",
        "Mean forward/backward time per microbatch chunk, the $topn slowest (rank, phase).",
        [
            Q(
                worst(
                    f"sum by (job, instance, rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_sum{{{SEL}}}[{RI}])) / "
                    f"sum by (job, instance, rank, pp_stage, phase) (rate(hpar_pp_chunk_duration_seconds_count{{{SEL}}}[{RI}]))"
                ),
                "rank {{rank}} stage {{pp_stage}} {{phase}}",
            )
        ],
        "s",
    )
    ts(
        b,
        "Bubble ratio by stage",
        "Idle fraction of the last step: 1 - busy / step time.",
        [Q(f"avg by (pp_stage) (hpar_pp_bubble_ratio{{{SEL}}})", "stage {{pp_stage}}")],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Busy time: highest $topn ranks",
        "Forward+backward compute time of the last step, the $topn highest.",
        [Q(worst(f"hpar_pp_busy_seconds{{{SEL}}}"), "rank {{rank}} stage {{pp_stage}}")],
        "s",
    )
    ts(
        b,
        "Compute time vs stage median",
        "Busy time over the median of the stage's ranks, the $topn highest; Straggler fires above 1.2.",
        [
            Q(
                worst(f"rank:hpar_pp_busy_seconds:ratio_to_stage_median5m{{{SEL}}}", join=False),
                "rank {{rank}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "Chunks per second by stream",
        "Microbatch chunks executed per CUDA stream (cpu on CPU).",
        [
            Q(
                f"sum by (pp_stage, stream, phase) (rate(hpar_pp_chunk_duration_seconds_count{{{SEL}}}[{RI}]))",
                "stage {{pp_stage}} {{stream}} {{phase}}",
            )
        ],
        "short",
    )
    return b
