"""The overview dashboard, the first to open on a run: step time, throughput and MFU, where step
time goes and each rank's bottleneck, alerts, and the agent's own health."""

from __future__ import annotations

from dashboards.panels import RANK_INFO, RI, SEL, Board, Q, heatmap, stat, table, ts, with_job_id, worst
from hpar_agent import catalogue as cat


def overview() -> Board:
    b = Board(
        cat.DASH_OVERVIEW, "hpar / Overview", "Step time, throughput, alerts and agent health of every rank."
    )
    b.row("Training")
    ts(
        b,
        "Step time p50 / p99 by stage",
        "Job-wide step-time quantiles (recording rules, 5m window).",
        [
            Q(
                'job_pp_stage:hpar_step_duration_seconds:p50_5m{job=~"$job",pp_stage=~"$pp_stage"}',
                "p50 stage {{pp_stage}}",
            ),
            Q(
                'job_pp_stage:hpar_step_duration_seconds:p99_5m{job=~"$job",pp_stage=~"$pp_stage"}',
                "p99 stage {{pp_stage}}",
            ),
        ],
        "s",
    )
    ts(
        b,
        "Slowest $topn ranks: step time p99",
        "Per-rank step-time p99 of the $topn ranks with the highest peak in the time range; exemplars open "
        "the step's trace in Jaeger. Every rank: the step-time heatmap below.",
        [
            Q(
                worst(
                    f"histogram_quantile(0.99, sum by (job, instance, rank, le) "
                    f"(rate(hpar_step_duration_seconds_bucket{{{SEL}}}[{RI}])))"
                ),
                "rank {{rank}}",
                exemplar=True,
            )
        ],
        "s",
    )
    ts(
        b,
        "Steps per second",
        "Steps per second, mean over the scrape job's ranks (recording rule).",
        [Q('job:hpar_steps:rate5m{job=~"$job"}', "steps/s {{job}}")],
        "short",
    )
    ts(
        b,
        "Tokens per second",
        "Tokens per second of each run: the sum over one rank per data-parallel replica (tp_rank, pp_rank "
        "and cp_rank 0 in hpar_rank_info), since every rank of a replica reports the replica's tokens "
        "(as hpar_trainer does). A loop that reports tokens on other ranks only shows nothing here.",
        [
            Q(
                f"sum by (job_id) (rate(hpar_tokens_total{{{SEL}}}[{RI}]) * on (job, instance, rank) "
                f'group_left (job_id) hpar_rank_info{{job=~"$job",job_id=~"$job_id",rank=~"$rank",'
                f'tp_rank="0",pp_rank="0",cp_rank="0"}})',
                "tokens/s {{job_id}}",
            )
        ],
        "short",
    )
    ts(
        b,
        "MFU (model FLOPs utilization)",
        "The mean over the run's ranks of hpar_mfu: the agent's count of the model's FLOPs a step (torch's "
        "flop counter once, or 6N + 12LHQT from the model's structure) over the median step time and the "
        "GPU's dense peak for the dtype (docs/metrics.md#mfu); absent on GPUs outside the peak table.",
        [Q(f"avg by (job_id) ({with_job_id(f'hpar_mfu{{{SEL}}}')})", "MFU {{job_id}}")],
        "percentunit",
        gpu=True,
    )
    ts(
        b,
        "Lowest-MFU $topn ranks",
        "Each rank's hpar_mfu (see MFU), the $topn ranks with the lowest minimum in the time range; beside "
        "it hpar_mfu_at_clock, against the peak at the current SM clock: a throttled GPU reads higher there, "
        "a rank that waits for its peers reads low in both.",
        [
            Q(worst(f"hpar_mfu{{{SEL}}}", best=True), "rank {{rank}} stage {{pp_stage}}"),
            Q(
                worst(f"hpar_mfu{{{SEL}}}", best=True, draw=f"hpar_mfu_at_clock{{{SEL}}}"),
                "rank {{rank}} stage {{pp_stage}} at clock",
            ),
        ],
        "percentunit",
        gpu=True,
    )
    ts(
        b,
        "MFU reported by the training loop",
        "Model FLOP/s over peak FLOP/s as the training loop reports them, summed over the run's ranks: "
        "rate(hpar_tokens_total) x hpar_model_flops_per_token / hpar_peak_flops (agent.report_flops; "
        "hpar_trainer: 6 x its local parameters per token, --peak-tflops); no data until they are reported.",
        [
            Q(
                f"sum by (job_id) ({with_job_id(f'rate(hpar_tokens_total{{{SEL}}}[{RI}]) * on (job, instance, rank) hpar_model_flops_per_token{{{SEL}}}')}) "
                f"/ sum by (job_id) ({with_job_id(f'hpar_peak_flops{{{SEL}}}')})",
                "MFU {{job_id}} (reported)",
            )
        ],
        "percentunit",
    )
    ts(
        b,
        "Step time vs job median: slowest $topn ranks",
        "Each rank's mean step time over the job median (recording rule, scrape job wide); the $topn "
        "highest in the time range. Straggler fires above 1.2 for 5m.",
        [
            Q(
                worst(f"rank:hpar_step_duration_seconds:ratio_to_median5m{{{SEL}}}", join=False),
                "rank {{rank}}",
            )
        ],
        "short",
    )
    heatmap(
        b,
        "Step time by rank (heatmap)",
        "Mean step time of every rank (rows) over time: a slow rank is a dark row, a slow step a dark "
        "column.",
        f"sum by (job, instance, rank) (rate(hpar_step_duration_seconds_sum{{{SEL}}}[{RI}])) / "
        f"sum by (job, instance, rank) (rate(hpar_step_duration_seconds_count{{{SEL}}}[{RI}]))",
        "s",
        w=24,
    )
    ts(
        b,
        "Where the step time goes",
        "Share of step time by phase (data_wait, host, forward, backward, optimizer, comm_exposed; recording rule, "
        "5m window), mean over ranks. CPU wall clock; GPU stream time from CUDA events on GPU.",
        [Q(f"avg by (phase) (rank_phase:hpar_step_phase_duration_seconds:ratio5m{{{SEL}}})", "{{phase}}")],
        "percentunit",
        max_val=1,
    )
    lost = f"rate(hpar_lost_seconds_total{{{SEL}}}[5m])"
    accounted = f"(sum(rate(hpar_productive_seconds_total{{{SEL}}}[5m])) + sum({lost}))"
    ts(
        b,
        "Where the time went (goodput)",
        "Share of the selected ranks' wall time since their processes started that was productive (the "
        "steps' own compute and communication; recording rule rank:hpar_goodput:ratio5m, mean over ranks), "
        "and the share lost to each cause: startup, compile, data_wait, host, checkpoint, wait (labelled "
        "with the rank waited for when one is named), hang, restart, recomputed, other. 5m window.",
        [
            Q(f"avg(rank:hpar_goodput:ratio5m{{{SEL}}})", "goodput"),
            Q(f"sum by (cause, culprit) ({lost}) / scalar({accounted})", "{{cause}} {{culprit}}"),
        ],
        "percentunit",
        max_val=1,
    )
    ts(
        b,
        "Ranks input-bound for 10 minutes",
        "Number of ranks whose bottleneck verdict has been input-bound for the whole last 10 minutes "
        "(InputBound fires on each); the table next to it gives every rank's current verdict.",
        [Q(f'sum(min_over_time(hpar_step_bottleneck{{{SEL},verdict="input-bound"}}[10m]))', "ranks")],
        "short",
    )
    table(
        b,
        "Bottleneck by rank",
        "Each rank's current verdict: input-bound, pipeline-bound, host-bound, compute-bound, communication-bound, slow-rank, or "
        "unknown when the phases explain too little of the step (the reason is in the rank's summary).",
        [Q(f"max by (rank, pp_stage, verdict) (hpar_step_bottleneck{{{SEL}}}) == 1", instant=True)],
    )
    b.row("Alerts")
    table(
        b,
        "Active alerts by rank and stage",
        "In-process detectors whose condition holds now (hpar_alert_active == 1).",
        [Q(f"max by (alert, rank, pp_stage) (hpar_alert_active{{{SEL}}}) == 1", instant=True)],
    )
    ts(
        b,
        "Ranks in alert",
        "Number of ranks on which each detector's condition holds.",
        [Q(f"sum by (alert) (hpar_alert_active{{{SEL}}})", "{{alert}}")],
        "short",
    )
    ts(
        b,
        "Detector signals (worst rank)",
        "Per detector, the highest value over ranks of what it compares with its threshold (units per "
        "detector).",
        [Q(f"max by (alert) (hpar_detector_value{{{SEL}}})", "{{alert}}")],
        "short",
    )
    ts(
        b,
        "Alerts raised",
        "Transitions from inactive to active per detector.",
        [Q(f"sum by (alert) (increase(hpar_alerts_total{{{SEL}}}[{RI}]))", "{{alert}}")],
        "short",
    )
    b.row("Rank health")
    stat(
        b,
        "Scrape targets down",
        "Targets of the scrape job Prometheus cannot reach (up == 0); their ranks are in the table below.",
        [Q('count(up{job=~"$job"} == 0) or vector(0)', "down")],
        "short",
        w=8,
        thresholds=[(None, "green"), (1, "red")],
    )
    stat(
        b,
        "Components up (min over ranks)",
        "0 when a component's source is missing or failing on some rank.",
        [Q(f"min by (component) (hpar_agent_component_up{{{SEL}}})", "{{component}}")],
        "short",
        w=8,
        thresholds=[(None, "red"), (1, "green")],
    )
    stat(
        b,
        "Seconds since last step (oldest rank)",
        "Age of the newest completed step on the rank that stepped least recently; Hang fires above 300 s.",
        [Q(f"max(time() - hpar_last_step_timestamp_seconds{{{SEL}}})", "oldest")],
        "s",
        w=8,
        thresholds=[(None, "green"), (60, "orange"), (300, "red")],
    )
    ts(
        b,
        "Agent errors",
        "Exceptions caught inside agent components (training unaffected).",
        [Q(f"sum by (component) (rate(hpar_agent_errors_total{{{SEL}}}[{RI}]))", "{{component}}")],
        "short",
        w=8,
    )
    ts(
        b,
        "Dropped hook events and spans",
        "Events dropped by full buffers, spans dropped by the span queue (all ranks).",
        [
            Q(f"sum by (buffer) (rate(hpar_agent_buffer_dropped_total{{{SEL}}}[{RI}]))", "{{buffer}}"),
            Q(f"sum(rate(hpar_agent_spans_dropped_total{{{SEL}}}[{RI}]))", "spans"),
        ],
        "short",
        w=8,
    )
    ts(
        b,
        "Agent poll time",
        "Agent-thread time of each component's last poll.",
        [Q(f"max by (component) (hpar_agent_collect_duration_seconds{{{SEL}}})", "{{component}}")],
        "s",
        w=8,
    )
    table(
        b,
        "Ranks: host and GPU",
        "One row per rank from hpar_rank_info: run, host, local rank, NVML GPU index and UUID (empty on "
        "CPU), the NUMA nodes of the rank's CPUs and of its GPU (NumaMisbinding), and whether Prometheus "
        "reaches it. Join with dcgm-exporter on the GPU UUID, e.g. "
        'DCGM_FI_DEV_GPU_UTIL * on (UUID) group_left (rank, job_id) label_replace(hpar_rank_info, "UUID", '
        '"$1", "gpu_uuid", "(.+)").',
        [
            Q(
                f"max by (job_id, rank, pp_stage, host, local_rank, gpu_index, gpu_uuid, numa_node, gpu_numa_node, "
                f"instance) ({RANK_INFO})"
                ' * on (instance) group_left () max by (instance) (up{job=~"$job"})',
                instant=True,
                table=True,
            )
        ],
        w=24,
    )
    return b
