"""The one catalogue of names users, dashboards and alert rules depend on.

Every metric, label, span, span attribute and alert the agent emits is declared here as data, and every
environment variable it reads is listed here (``ENV_VARS``, ``TOOL_ENV_VARS``) from its declaration
in ``hpar_agent.config``. Exporters, docs, dashboards and rules are generated from or tested against it,
so a name changes in exactly one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpar_agent.config import ENV_AUTOATTACH as ENV_AUTOATTACH
from hpar_agent.config import ENV_DIAGNOSE_RUN as ENV_DIAGNOSE_RUN
from hpar_agent.config import SETTINGS, Setting
from hpar_agent.config import TOOL_ENV_VARS as TOOL_ENV_VARS

# ---------------------------------------------------------------------------------------------- labels
RANK = "rank"
PP_STAGE = "pp_stage"
PG = "pg"
OP = "op"
STREAM = "stream"
COMPONENT = "component"
ALERT = "alert"
REASON = "reason"
PHASE = "phase"
OUTCOME = "outcome"
TRIGGER = "trigger"
BACKEND = "backend"
CACHE = "cache"
RESULT = "result"
KIND = "kind"
SOURCE = "source"
BUFFER = "buffer"
CLOCK = "clock"
ERROR_TYPE = "error_type"
PEER = "peer"
VERDICT = "verdict"
GROUP = "group"
CULPRIT = "culprit"
CAUSE = "cause"
GPU = "gpu"
WHICH = "which"
XID = "xid"

#: Labels every series carries, in this order.
COMMON_LABELS: tuple[str, ...] = (RANK, PP_STAGE)

#: Label keys of the info metric (static identity; never repeated on other series).
INFO_LABELS: tuple[str, ...] = (
    "job_id",  # not "job": Prometheus owns that label for the scrape job
    "host",
    "local_rank",
    "world_size",
    "dp",
    "tp",
    "pp",
    "dp_rank",
    "tp_rank",
    "pp_rank",
    "dp_replicate",  # torchtitan mesh dims: dp = dp_replicate x dp_shard (HSDP); FSDP alone: dp_shard
    "dp_shard",
    "cp",
    "dp_replicate_rank",
    "dp_shard_rank",
    "cp_rank",
    "mesh_dims",  # the mesh as read: name=size,... in mesh order
    "pp_stages",  # the pipeline stages this rank runs: 1,5 (interleaved); empty where none was seen
    "backend",
    "device",
    "torch_version",
    "agent_version",
    "gpu_index",  # NVML index of this rank's GPU (empty on CPU)
    "gpu_uuid",  # NVML UUID (GPU-...): joins with dcgm-exporter's UUID label (empty on CPU)
    "numa_node",  # NUMA nodes of the CPUs the process may run on
    "cpu_affinity",  # those CPUs (cpulist form, at most 64 characters)
    "gpu_numa_node",  # NVML: the GPU's NUMA node ("" unknown)
    "gpu_cpu_affinity",  # NVML: the CPUs ideal for the GPU
)


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric family. ``name`` is the exposition name (counters include ``_total``)."""

    name: str
    type: str  # counter | gauge | histogram | info
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""

    @property
    def all_labels(self) -> tuple[str, ...]:
        return COMMON_LABELS + self.labels

    @property
    def family(self) -> str:
        """Name prometheus_client expects for the family (counters and info without suffix)."""
        if self.type == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.type == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name


def _m(name: str, type_: str, help_: str, *labels: str, unit: str = "") -> MetricSpec:
    return MetricSpec(name, type_, help_, tuple(labels), unit)


# Histogram bounds: 10 µs .. ~10 s, x~2.15 per bucket (three per decade) — resolves p99 of fast TP
# all-reduces and multi-second stalls in one family.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5,
    2.2e-5,
    4.6e-5,
    1e-4,
    2.2e-4,
    4.6e-4,
    1e-3,
    2.2e-3,
    4.6e-3,
    1e-2,
    2.2e-2,
    4.6e-2,
    0.085,
    0.1,
    0.22,
    0.46,
    1.0,
    2.2,
    4.6,
    10.0,
)
#: Step and compile times are longer: 1 ms .. ~10 min.
STEP_BUCKETS: tuple[float, ...] = (
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

#: Step anatomy: the fixed ``phase`` values of hpar_step_phase_duration_seconds (data_wait: inside the data
#: loader before the forward; host: the rest of that time; comm_exposed: collective time no other phase
#: hides, only where collective timing exists) and the ``verdict`` values of hpar_step_bottleneck.
STEP_PHASES: tuple[str, ...] = ("data_wait", "host", "forward", "backward", "optimizer", "comm_exposed")
#: The ``cause`` values of hpar_lost_seconds_total (docs/metrics.md#goodput says what each holds).
GOODPUT_CAUSES: tuple[str, ...] = (
    "startup",
    "compile",
    "data_wait",
    "host",
    "checkpoint",
    "wait",
    "hang",
    "restart",
    "recomputed",
    "other",
)
VERDICTS: tuple[str, ...] = (
    "input-bound",
    "host-bound",
    "pipeline-bound",
    "compute-bound",
    "communication-bound",
    "slow-rank",
    "waits-for-slow-rank",
    "unknown",
)

METRICS: tuple[MetricSpec, ...] = (
    # identity and agent health
    _m("hpar_rank_info", "info", "Static identity of this rank: job, topology, host and versions."),
    _m(
        "hpar_agent_errors_total",
        "counter",
        "Exceptions caught inside an agent component (never raised into training).",
        COMPONENT,
    ),
    _m(
        "hpar_agent_component_up",
        "gauge",
        "1 when the component's source is available and working, else 0.",
        COMPONENT,
    ),
    _m(
        "hpar_agent_collect_duration_seconds",
        "gauge",
        "Time the agent thread spent in the component's last poll.",
        COMPONENT,
        unit="seconds",
    ),
    _m(
        "hpar_agent_buffer_dropped_total",
        "counter",
        "Hook events dropped because a bounded buffer was full.",
        BUFFER,
    ),
    _m(
        "hpar_agent_spans_dropped_total",
        "counter",
        "Spans dropped by the bounded span queue or a failing exporter.",
    ),
    # the metrics endpoint's own audit (exporters.endpoint_audit, exporters.http_server)
    _m(
        "hpar_endpoint_auth_failures_total",
        "counter",
        "Clients the metrics endpoint refused, by reason: no_credentials, wrong_password, unknown_user, "
        "no_client_certificate, bad_client_certificate.",
        REASON,
    ),
    _m(
        "hpar_endpoint_connections_evicted_total",
        "counter",
        "Connections the metrics endpoint closed to make room for another (slow or idle clients).",
    ),
    _m(
        "hpar_endpoint_connections_timed_out_total",
        "counter",
        "Connections the metrics endpoint closed at a deadline (request head in 5 s, whole exchange in 30 s).",
    ),
    # steps and pipeline
    _m(
        "hpar_step_duration_seconds",
        "histogram",
        "Wall time of one training step on this rank (optimizer step to optimizer step).",
        unit="seconds",
    ),
    _m("hpar_steps_total", "counter", "Training steps completed on this rank."),
    _m(
        "hpar_last_step_timestamp_seconds",
        "gauge",
        "Unix time at which the last step completed.",
        unit="seconds",
    ),
    _m(
        "hpar_last_progress_timestamp_seconds",
        "gauge",
        "Unix time at which this rank last made progress: a step, or its training thread working on a CPU"
        " (5 % of a pass or more: an evaluation between steps) or compiling since.",
        unit="seconds",
    ),
    _m("hpar_tokens_total", "counter", "Tokens processed, as reported by the training loop."),
    _m(
        "hpar_model_flops_per_token",
        "gauge",
        "Model FLOPs this rank performs per token of hpar_tokens_total, as the trainer reports it (agent.report_flops); absent until reported.",
    ),
    _m(
        "hpar_peak_flops",
        "gauge",
        "Peak FLOP/s of this rank's accelerator for the training dtype, as the trainer reports it (agent.report_flops); absent until reported.",
    ),
    _m(
        "hpar_step_phase_duration_seconds",
        "histogram",
        "Time of one phase of a step on this rank (data_wait: in the data loader before the forward, host: the rest of that time, forward, backward, optimizer, comm_exposed: collective time no other phase hides, where collective timing exists); CPU wall clock, GPU stream time from CUDA events on GPU; on a loop faster than HPAR_DETAIL_RATE steps a second, every k-th step.",
        PHASE,
        unit="seconds",
    ),
    _m(
        "hpar_step_phase_ratio",
        "gauge",
        "Share of step time spent in the phase over the recent steps (after warm-up).",
        PHASE,
        unit="ratio",
    ),
    _m(
        "hpar_model_flops_per_step",
        "gauge",
        "The model's FLOPs in one step of this rank (its pipeline stage's part), counted once: torch's flop counter on a steady step (a torch.compile'd model: on a copy on fake tensors), else 6N + 12 L H Q T a token (docs/metrics.md#mfu).",
    ),
    _m(
        "hpar_mfu",
        "gauge",
        "Model FLOPs utilisation: hpar_model_flops_per_step over the median recent step time and the GPU's dense peak for the dtype in use (docs/metrics.md#mfu has the table).",
        unit="ratio",
    ),
    _m(
        "hpar_mfu_at_clock",
        "gauge",
        "hpar_mfu against the peak at the GPU's current SM clock (NVML): a throttled GPU reads higher here than in hpar_mfu, a waiting one low in both.",
        unit="ratio",
    ),
    _m(
        "hpar_lost_seconds_total",
        "counter",
        "Seconds of this rank's wall time since its process started that produced no training, by cause (startup, compile, data_wait, host, checkpoint, wait, hang, restart, recomputed, other); culprit: the rank a wait was for, only on waits with a named culprit. Accounted a step behind the clock.",
        CAUSE,
        CULPRIT,
        unit="seconds",
    ),
    _m(
        "hpar_productive_seconds_total",
        "counter",
        "Seconds of this rank's wall time spent in its steps' own compute and communication (the complement of hpar_lost_seconds_total).",
        unit="seconds",
    ),
    _m(
        "hpar_goodput_ratio",
        "gauge",
        "Productive seconds over the wall time accounted since the process started (a lower bound while exposed communication waits undecided for a Straggler verdict).",
        unit="ratio",
    ),
    _m(
        "hpar_step_slow_rank",
        "gauge",
        "The job's slowest rank, on the rank itself (verdict slow-rank) and on the ranks that wait for it (waits-for-slow-rank), from the cross-rank Straggler exchange; absent otherwise.",
        unit="",
    ),
    _m(
        "hpar_step_bottleneck",
        "gauge",
        "1 for this rank's current bottleneck verdict (input-bound, host-bound, pipeline-bound, compute-bound, communication-bound, slow-rank, waits-for-slow-rank: a victim of the slow rank, unknown: the phases explain too little of the step), 0 for the others.",
        VERDICT,
    ),
    _m(
        "hpar_pp_chunk_duration_seconds",
        "histogram",
        "Compute time of one pipeline microbatch chunk on this stage (on a loop faster than HPAR_DETAIL_RATE steps a second, of every k-th step).",
        PHASE,
        STREAM,
        unit="seconds",
    ),
    _m(
        "hpar_pp_busy_seconds",
        "gauge",
        "Forward+backward compute time of this stage in the last step.",
        unit="seconds",
    ),
    _m(
        "hpar_pp_bubble_ratio",
        "gauge",
        "Idle fraction of the last step on this stage: 1 - busy / step time (a step with an evaluation "
        "leaves it as it was).",
        unit="ratio",
    ),
    # collectives
    _m(
        "hpar_collective_duration_seconds",
        "histogram",
        "Latency of a collective or p2p op, from the best timing source available.",
        PG,
        OP,
        STREAM,
        unit="seconds",
    ),
    _m("hpar_collectives_total", "counter", "Collective and p2p ops observed (timed or not).", PG, OP),
    _m(
        "hpar_collective_bytes_total",
        "counter",
        "Payload bytes of collective and p2p ops (input size x element size).",
        PG,
        OP,
        unit="bytes",
    ),
    _m(
        "hpar_collective_busbw_bytes_per_second",
        "gauge",
        "Bus bandwidth of the last timed op (nccl-tests factors, group size of the pg).",
        PG,
        OP,
        unit="bytes",
    ),
    _m("hpar_collective_inflight", "gauge", "Ops enqueued but not completed on the group.", PG),
    _m(
        "hpar_collective_oldest_inflight_age_seconds",
        "gauge",
        "Age of the oldest op not yet completed on the group.",
        PG,
        unit="seconds",
    ),
    _m(
        "hpar_collective_last_completed_seq",
        "gauge",
        "Sequence number of the last completed collective on the group.",
        PG,
    ),
    _m(
        "hpar_collective_last_enqueued_seq",
        "gauge",
        "Sequence number of the last collective this rank entered on the group: at a hang, the ranks below their group's highest are the ones the others wait for.",
        PG,
    ),
    _m(
        "hpar_collective_unobserved_total",
        "counter",
        "Flight-recorder entries overwritten before the agent read them.",
        PG,
    ),
    _m(
        "hpar_grad_sync_coverage_ratio",
        "gauge",
        "dp: gradient elements the last judged step reduced over dp / trainable gradient elements it must reduce; tp: elements of tp-replicated gradients that needed a tp sum and got it / those that needed it (sampled steps); 1 when whole.",
        GROUP,
        unit="ratio",
    ),
    _m(
        "hpar_collective_timing_enabled",
        "gauge",
        "1 when the group's ops carry durations (NCCL with timing on, pipelining p2p), else 0.",
        PG,
    ),
    # torch.compile
    _m(
        "hpar_dynamo_compiles_total",
        "counter",
        "Dynamo compile attempts by outcome (ok, graph_break, failed, limit), trigger and backend (a name in dynamo's backend registry, else custom/unknown).",
        OUTCOME,
        TRIGGER,
        BACKEND,
    ),
    _m(
        "hpar_dynamo_recompiles_total",
        "counter",
        "Recompiles of an already compiled frame, by failed-guard kind.",
        REASON,
    ),
    _m(
        "hpar_dynamo_graph_breaks_total",
        "counter",
        "Graph breaks by registry code (gbNNNN) or a short stable key.",
        REASON,
    ),
    _m(
        "hpar_dynamo_recompile_limit_hits_total",
        "counter",
        "Frames that hit torch._dynamo.config.recompile_limit and fell back to eager.",
    ),
    _m(
        "hpar_dynamo_cache_events_total",
        "counter",
        "AOTAutograd and Inductor FX graph cache lookups by result.",
        CACHE,
        RESULT,
    ),
    _m(
        "hpar_dynamo_compile_duration_seconds",
        "histogram",
        "Compile time per attempt by phase (entire_frame, backend, inductor, code_gen; lazy_backward for a deferred backward compile).",
        PHASE,
        unit="seconds",
    ),
    _m("hpar_dynamo_unique_graphs", "gauge", "Distinct graphs compiled by this process."),
    _m(
        "hpar_dynamo_graphs_compiled_total",
        "counter",
        "Graphs compiled (forward frames that produced a graph, identical ones included): keeps rising after warm-up when compiled functions leak.",
    ),
    _m(
        "hpar_dynamo_graph_fingerprint",
        "gauge",
        "Order-independent hash (< 2**52) of the graphs this rank compiled; equal across ranks of a stage.",
    ),
    # memory
    _m("hpar_gpu_memory_used_bytes", "gauge", "NVML: device memory in use (all processes).", unit="bytes"),
    _m("hpar_gpu_memory_total_bytes", "gauge", "NVML: device memory capacity.", unit="bytes"),
    _m("hpar_gpu_process_memory_bytes", "gauge", "NVML: device memory used by this process.", unit="bytes"),
    _m(
        "hpar_gpu_memory_headroom_bytes",
        "gauge",
        "Bytes this process can still allocate on its GPU before a CUDA out-of-memory: device memory no process holds (NVML total - used, else cudaMemGetInfo) plus the caching allocator's reserved-but-unallocated cache, which it reuses before asking the device (fragmentation can leave less usable).",
        unit="bytes",
    ),
    _m(
        "hpar_gpu_utilization_ratio",
        "gauge",
        "NVML: fraction of time a kernel ran over the last sample period.",
        unit="ratio",
    ),
    _m("hpar_gpu_power_watts", "gauge", "NVML: board power draw.", unit="watts"),
    _m("hpar_gpu_temperature_celsius", "gauge", "NVML: GPU core temperature.", unit="celsius"),
    _m("hpar_gpu_clock_hertz", "gauge", "NVML: current clock by domain (sm, mem).", CLOCK, unit="hertz"),
    _m(
        "hpar_gpu_ecc_errors_total",
        "counter",
        "NVML: volatile ECC error count by type (corrected, uncorrected).",
        ERROR_TYPE,
    ),
    _m("hpar_gpu_throttle_active", "gauge", "NVML: 1 while a clock-throttle reason is active.", REASON),
    _m(
        "hpar_gpu_clock_max_hertz",
        "gauge",
        "NVML: the GPU's maximum clock by domain (sm, mem): hpar_gpu_clock_hertz against it tells a throttled GPU.",
        GPU,
        CLOCK,
        unit="hertz",
    ),
    _m("hpar_gpu_power_limit_watts", "gauge", "NVML: the enforced board power limit.", GPU, unit="watts"),
    _m(
        "hpar_gpu_pcie_link_generation",
        "gauge",
        "NVML: PCIe link generation, current and max (a current below max under load: a downtrained link).",
        GPU,
        WHICH,
    ),
    _m("hpar_gpu_pcie_link_width", "gauge", "NVML: PCIe link width (lanes), current and max.", GPU, WHICH),
    _m(
        "hpar_gpu_retired_pages",
        "gauge",
        "NVML: device memory pages retired, by cause (single_bit: multiple single-bit ECC errors, double_bit).",
        GPU,
        CAUSE,
    ),
    _m(
        "hpar_gpu_retired_pages_pending",
        "gauge",
        "NVML: 1 while a page retirement waits for the GPU's reset.",
        GPU,
    ),
    _m(
        "hpar_gpu_remapped_rows",
        "gauge",
        "NVML (Ampere and later): memory rows remapped, by kind (correctable, uncorrectable; pending and failed are 1 while true).",
        GPU,
        KIND,
    ),
    _m(
        "hpar_gpu_xid_events_total",
        "counter",
        "NVML: Xid critical error events on this rank's GPU since attach, by Xid code (at most 16 codes); absent where NVML cannot watch them.",
        GPU,
        XID,
    ),
    _m(
        "hpar_gpu_nvlink_errors_total",
        "counter",
        "NVML: NVLink error counters summed over the GPU's active links, by kind (replay, recovery, crc_flit, crc_data).",
        GPU,
        KIND,
    ),
    _m(
        "hpar_allocator_bytes",
        "gauge",
        "CUDA caching allocator current bytes by kind (allocated, reserved, active).",
        KIND,
        unit="bytes",
    ),
    _m(
        "hpar_allocator_peak_bytes", "gauge", "CUDA caching allocator peak bytes by kind.", KIND, unit="bytes"
    ),
    _m(
        "hpar_allocator_alloc_retries_total",
        "counter",
        "cudaMalloc retries after freeing cached blocks (memory pressure).",
    ),
    _m("hpar_allocator_ooms_total", "counter", "Out-of-memory errors seen by the CUDA caching allocator."),
    _m(
        "hpar_process_page_faults_total",
        "counter",
        "Page faults of this process by kind (minor: no disk read; major: read from disk), read at step boundaries.",
        KIND,
    ),
    _m(
        "hpar_process_context_switches_total",
        "counter",
        "Context switches of this process by kind (voluntary: it waited; involuntary: preempted), read at step boundaries.",
        KIND,
    ),
    _m("hpar_host_rss_bytes", "gauge", "Resident set size of this process.", unit="bytes"),
    _m(
        "hpar_memory_post_step_bytes",
        "gauge",
        "Memory sampled right after the last step, by source (allocator, nvml, rss).",
        SOURCE,
        unit="bytes",
    ),
    # detectors
    _m("hpar_alert_active", "gauge", "1 while the named detector's condition holds on this rank.", ALERT),
    _m("hpar_alerts_total", "counter", "Times the named alert went from inactive to active.", ALERT),
    _m(
        "hpar_detector_value",
        "gauge",
        "The signal each detector compares with its threshold (units per detector, see docs).",
        ALERT,
    ),
    _m(
        "hpar_alert_culprit",
        "gauge",
        "1 for each rank an active cross-rank alert on this rank names as its cause (at most 16 an alert): max by (alert, culprit) over the job gives every culprit.",
        ALERT,
        CULPRIT,
    ),
)

METRICS_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def metric(name: str) -> MetricSpec:
    """Look a metric up; a KeyError here means a name was used that the catalogue does not hold."""
    return METRICS_BY_NAME[name]


# ---------------------------------------------------------------------------------------------- alerts
#: Grafana dashboard uids (``dashboards/*.json``): each alert names the one that shows its series.
DASH_OVERVIEW = "hpar-overview"
DASH_COLLECTIVES = "hpar-collectives"
DASH_COMPILE = "hpar-compile"
DASH_MEMORY = "hpar-memory"
DASH_PIPELINE = "hpar-pipeline"

#: Where the docs are published: every rule's ``runbook_url`` is this page with the alert's heading as
#: anchor. Docs hosted elsewhere: rewrite the prefix (docs/alerts.md, "Links in notifications").
RUNBOOK_PAGE_URL = "https://github.com/hpar-agent/hpar-agent/blob/main/docs/alerts.md"


@dataclass(frozen=True)
class AlertSpec:
    name: str
    severity: str
    summary: str
    dashboard: str
    """Uid of the Grafana dashboard that shows the alert's series (a ``DASH_*`` constant)."""

    @property
    def runbook_url(self) -> str:
        """The alert's section of docs/alerts.md (GitHub's anchor of the heading ``### <name>``)."""
        return f"{RUNBOOK_PAGE_URL}#{self.name.lower()}"

    @property
    def dashboard_url(self) -> str:
        """Grafana path of the dashboard (relative: prefix it with your Grafana's URL)."""
        return f"/d/{self.dashboard}"


ALERTS: tuple[AlertSpec, ...] = (
    AlertSpec(
        "RecompileStorm",
        "warning",
        "Recompiles per window above threshold or compile-cache hit ratio collapsed; both at once is cache pollution (details.mode, signal=cache_pollution).",
        DASH_COMPILE,
    ),
    AlertSpec(
        "GraphBreaks",
        "warning",
        "A new graph-break reason appeared after warm-up (a c10d call in compiled code is named, with the functional-collectives fix).",
        DASH_COMPILE,
    ),
    AlertSpec(
        "CompileDivergence",
        "critical",
        "Ranks of the same pipeline stage compiled different graphs.",
        DASH_COMPILE,
    ),
    AlertSpec(
        "ReplicaDivergence",
        "critical",
        "Parameters that must be identical across replicas differ.",
        DASH_OVERVIEW,
    ),
    AlertSpec(
        "CollectiveMismatch",
        "critical",
        "Ranks disagree on op, size or dtype of the same collective.",
        DASH_COLLECTIVES,
    ),
    AlertSpec("MemoryLeak", "warning", "Post-step memory keeps rising after warm-up.", DASH_MEMORY),
    AlertSpec(
        "CompiledGraphsGrowing",
        "warning",
        "Graphs are still being compiled step after step past warm-up (a fresh compiled function per microbatch kept alive); names the code location that keeps compiling.",
        DASH_COMPILE,
    ),
    AlertSpec("CollectiveLatencyHigh", "warning", "Collective p99 latency above its SLO.", DASH_COLLECTIVES),
    AlertSpec("Straggler", "warning", "A rank is persistently slower than its group.", DASH_OVERVIEW),
    AlertSpec(
        "GradSyncIncomplete",
        "critical",
        "A step reduced less of the trainable gradient over data parallelism than it must.",
        DASH_COLLECTIVES,
    ),
    AlertSpec(
        "NumaMisbinding",
        "warning",
        "The rank may run only on CPUs outside its GPU's NUMA node (NVML's ideal CPUs).",
        DASH_OVERVIEW,
    ),
    AlertSpec(
        "Hang",
        "critical",
        "A collective is in flight, or no step progressed, past the timeout; names the rank(s) the others wait for.",
        DASH_COLLECTIVES,
    ),
    AlertSpec(
        "RankGone",
        "critical",
        "A rank stopped publishing and its process is gone, stopped or out of sight (raised by the ranks that compare with it, naming it).",
        DASH_OVERVIEW,
    ),
)
#: Alerts of the in-process detectors (each exported as ``hpar_alert_active{alert=...}``).
ALERT_NAMES: tuple[str, ...] = tuple(a.name for a in ALERTS)
#: Alerts only the Prometheus rules raise (from the series the agent exports, or from ``up``).
RULE_ALERTS: tuple[AlertSpec, ...] = (
    AlertSpec(
        "InputBound",
        "warning",
        "A rank spends more of its step time waiting for input than anatomy.input_share (Prometheus rule only).",
        DASH_OVERVIEW,
    ),
    AlertSpec(
        "GpuMemoryNearFull",
        "warning",
        "NVML reports the GPU's memory nearly full (Prometheus rule only).",
        DASH_MEMORY,
    ),
    AlertSpec(
        "GpuEccErrors",
        "critical",
        "NVML counted uncorrected ECC errors on the rank's GPU (Prometheus rule only).",
        DASH_MEMORY,
    ),
    AlertSpec(
        "GpuThrottled",
        "warning",
        "NVML reports the rank's GPU throttled by heat, power delivery or a hardware slowdown for 5 minutes (Prometheus rule only).",
        DASH_MEMORY,
    ),
    AlertSpec(
        "GpuHardwareErrors",
        "critical",
        "The rank's GPU reports an Xid error, a pending or failed memory repair, a downtrained PCIe link or NVLink errors (Prometheus rule only).",
        DASH_MEMORY,
    ),
    AlertSpec(
        "HparAgentDown",
        "warning",
        "A rank's endpoint stopped answering while its job still runs (Prometheus rule only).",
        DASH_OVERVIEW,
    ),
    AlertSpec(
        "HparAgentErrors",
        "warning",
        "A component of the agent keeps failing (hpar_agent_errors_total rises; Prometheus rule only).",
        DASH_OVERVIEW,
    ),
)
#: Every alert a rule file may define.
ALL_ALERTS: tuple[AlertSpec, ...] = ALERTS + RULE_ALERTS
ALERTS_BY_NAME: dict[str, AlertSpec] = {a.name: a for a in ALL_ALERTS}

# ---------------------------------------------------------------------------------------------- spans
SPAN_STEP = "train.step"
SPAN_PP_FORWARD = "pp.forward"
SPAN_PP_BACKWARD = "pp.backward"
SPAN_COLLECTIVE_PREFIX = "collective."  # + op, e.g. collective.all_reduce
SPAN_COMPILE = "dynamo.compile"
#: Step anatomy: one child span of train.step per phase, named step.<phase>
SPAN_STEP_PHASES: dict[str, str] = {p: f"step.{p}" for p in STEP_PHASES}
SPAN_NAMES: tuple[str, ...] = (
    SPAN_STEP,
    SPAN_PP_FORWARD,
    SPAN_PP_BACKWARD,
    SPAN_COMPILE,
    *SPAN_STEP_PHASES.values(),
)

# span attributes
ATTR_RANK = "hpar.rank"
ATTR_PP_STAGE = "hpar.pp.stage"
ATTR_STEP = "hpar.step"
ATTR_MICROBATCH = "hpar.microbatch"
ATTR_JOB = "hpar.job.id"
ATTR_STREAM = "cuda.stream"
ATTR_PG = "collective.pg"
ATTR_OP = "collective.op"
ATTR_SEQ = "collective.seq"
ATTR_BYTES = "collective.bytes"
ATTR_PEER = "collective.peer"
ATTR_BUSBW = "collective.busbw"
ATTR_COMPILE_ID = "dynamo.compile_id"
ATTR_COMPILE_TRIGGER = "dynamo.trigger"
ATTR_COMPILE_OUTCOME = "dynamo.outcome"
ATTR_COMPILE_FUNCTION = "dynamo.function"  # co_name file:line of the compiled frame
ATTR_GRAPH_BREAK_REASON = "dynamo.graph_break.reason"  # the bounded reason key (gbNNNN or slug)
ATTR_USER_FRAME = "dynamo.user_frame"  # innermost user file:line of a graph break
ATTR_RECOMPILE_REASON = "dynamo.recompile.reason"  # bounded kind of the first failed guard
ATTR_CODE_HASH = "dynamo.code_hash"  # short hash of basename:co_firstlineno:co_name of the compiled frame
ATTR_COMPILE_BACKEND = "dynamo.backend"  # registered backend name (eager, aot_eager, inductor; custom)
ATTR_ALERT = "hpar.alert"
# train.step: this step's page faults and context switches (process-wide deltas, getrusage)
ATTR_MINOR_FAULTS = "hpar.page_faults.minor"
ATTR_MAJOR_FAULTS = "hpar.page_faults.major"
ATTR_MAJOR_FAULTED = (
    "hpar.page_faults.had_major"  # true when the step took a major fault (Jaeger tags match exactly)
)
ATTR_VOLUNTARY_SWITCHES = "hpar.context_switches.voluntary"
ATTR_INVOLUNTARY_SWITCHES = "hpar.context_switches.involuntary"
ATTR_STREAM_HANDLE = "cuda.stream.handle"  # the cudaStream_t as an int, beside the readable cuda.stream
ATTR_TRACE_REASON = "hpar.trace.reason"  # why the step's trace was kept: sampled | anomalous | slow
#: Span attributes every span carries (Jaeger tag search keys).
SPAN_COMMON_ATTRS: tuple[str, ...] = (ATTR_RANK, ATTR_PP_STAGE, ATTR_STEP)

# OTel Resource (static identity of the rank; never repeated on spans). The semantic conventions'
# names where one exists (opentelemetry.io/docs/specs/semconv/resource/), hpar.* where none does.
SERVICE_NAME_DEFAULT = "hpar-trainer"  # unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES set it
RES_SERVICE_NAME = "service.name"
RES_SERVICE_INSTANCE_ID = "service.instance.id"  # <job id>-<rank>: unique among the job's live processes
RES_HOST_NAME = "host.name"
RES_PROCESS_PID = "process.pid"
RES_K8S_POD_NAME = "k8s.pod.name"
RES_K8S_NAMESPACE_NAME = "k8s.namespace.name"
RES_K8S_NODE_NAME = "k8s.node.name"
RES_SLURM_JOB_ID = "hpar.slurm.job.id"  # no semantic convention for Slurm exists
#: Environment variables whose value, when set, becomes a Resource attribute: the K8S_* ones from the
#: Kubernetes downward API (deploy/k8s/trainer.yaml sets them), SLURM_JOB_ID from Slurm itself.
RESOURCE_ENV: dict[str, str] = {
    "K8S_POD_NAME": RES_K8S_POD_NAME,
    "K8S_NAMESPACE_NAME": RES_K8S_NAMESPACE_NAME,
    "K8S_NODE_NAME": RES_K8S_NODE_NAME,
    "SLURM_JOB_ID": RES_SLURM_JOB_ID,
}
RES_WORLD_SIZE = "hpar.world_size"
RES_DP = "hpar.dp.size"
RES_TP = "hpar.tp.size"
RES_PP = "hpar.pp.size"
RES_DP_RANK = "hpar.dp.rank"
RES_TP_RANK = "hpar.tp.rank"
RES_PP_RANK = "hpar.pp.rank"
#: Span event names
EVENT_GRAPH_BREAK = "graph_break"
EVENT_COMPILE_START = "compile_start"  # dynamo starts a frame (code_hash, frame_id, f_locals_keys)
EVENT_BACKEND_COMPILE = "backend_compile"  # an attempt ended (outcome, backend, node_name on failure)
EVENT_RECOMPILE = "recompile"
EVENT_ALERT = "hpar.alert"


# ---------------------------------------------------------------------------------------------- env vars
#: The settings' ``HPAR_*`` variables, each declared once on its ``AgentConfig`` field (``hpar_agent.config``,
#: ``setting()``: variable, type, bounds, default, help). The variables the tools set in the processes they
#: start (``TOOL_ENV_VARS``, imported above) are declared beside them, where the loader's unknown-name
#: warning reads them too.
ENV_VARS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.env)
