"""The memory dashboard: post-step memory and leaks, the CUDA caching allocator and NVML device
memory, and GPU health; most panels only have data on CUDA ranks."""

from __future__ import annotations

from dashboards.panels import RI, SEL, Board, Q, heatmap, ts, worst
from hpar_agent import catalogue as cat


def memory() -> Board:
    b = Board(
        cat.DASH_MEMORY,
        "hpar / Memory",
        "Device (NVML), CUDA caching allocator and host memory per rank; leaks.",
    )
    b.row("Post-step memory and leaks")
    ts(
        b,
        "Post-step memory: highest $topn",
        "Memory sampled right after each step (allocator, nvml, rss): the $topn (rank, source) series with "
        "the highest peak in the time range.",
        [Q(worst(f"hpar_memory_post_step_bytes{{{SEL}}}"), "rank {{rank}} {{source}}")],
        "bytes",
    )
    heatmap(
        b,
        "Post-step memory by rank (heatmap)",
        "Every rank's memory right after each step (rows: ranks): the caching allocator's on CUDA, else "
        "the process RSS. A leak is a row that darkens over time.",
        f'max by (job, instance, rank) (hpar_memory_post_step_bytes{{{SEL},source="allocator"}}) or '
        f'max by (job, instance, rank) (hpar_memory_post_step_bytes{{{SEL},source="rss"}})',
        "bytes",
        w=24,
    )
    ts(
        b,
        "Growth per step: highest $topn",
        "10m slope of post-step memory divided by the step rate: bytes kept per step (the $topn highest).",
        [
            Q(
                worst(
                    f"rank_source:hpar_memory_post_step_bytes:deriv10m{{{SEL}}} / on (job, instance) group_left () "
                    f"sum by (job, instance) (rate(hpar_steps_total{{{SEL}}}[10m]))"
                ),
                "rank {{rank}} {{source}}",
            )
        ],
        "bytes",
    )
    ts(
        b,
        "Host RSS: highest $topn",
        "Resident set size of each rank's process, the $topn highest.",
        [Q(worst(f"hpar_host_rss_bytes{{{SEL}}}"), "rank {{rank}}")],
        "bytes",
    )
    ts(
        b,
        "MemoryLeak detector",
        "Ranks whose detector says leaking, and the signal of the $topn highest ranks.",
        [
            Q(f'sum(hpar_alert_active{{alert="MemoryLeak",{SEL}}})', "ranks leaking"),
            Q(worst(f'hpar_detector_value{{alert="MemoryLeak",{SEL}}}'), "signal rank {{rank}}"),
        ],
        "short",
    )
    b.row("GPU memory")
    ts(
        b,
        "GPU memory used / total (NVML)",
        "Device memory in use by all processes on the $topn fullest ranks, and the largest capacity.",
        [
            Q(worst(f"hpar_gpu_memory_used_bytes{{{SEL}}}"), "used rank {{rank}}"),
            Q(f"max(hpar_gpu_memory_total_bytes{{{SEL}}})", "total"),
        ],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "GPU memory used ratio",
        "The $topn fullest ranks; GpuMemoryNearFull fires above 95% for 5m.",
        [
            Q(
                worst(f"hpar_gpu_memory_used_bytes{{{SEL}}} / hpar_gpu_memory_total_bytes{{{SEL}}}"),
                "rank {{rank}}",
            )
        ],
        "percentunit",
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "Process GPU memory (NVML)",
        "Device memory used by each rank's process, the $topn highest.",
        [Q(worst(f"hpar_gpu_process_memory_bytes{{{SEL}}}"), "rank {{rank}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "GPU memory headroom: lowest $topn",
        "Bytes each rank can still allocate before a CUDA out-of-memory: free device memory plus the "
        "allocator's unallocated cache. A leak walks it down to 0; MemoryLeak's details say at which step.",
        [Q(worst(f"hpar_gpu_memory_headroom_bytes{{{SEL}}}", best=True), "rank {{rank}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator bytes by kind",
        "CUDA caching allocator allocated / reserved / active bytes, the $topn highest (rank, kind).",
        [Q(worst(f"hpar_allocator_bytes{{{SEL}}}"), "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator peak bytes",
        "Peak bytes per kind since start or reset, the $topn highest (rank, kind).",
        [Q(worst(f"hpar_allocator_peak_bytes{{{SEL}}}"), "rank {{rank}} {{kind}}")],
        "bytes",
        gpu=True,
    )
    ts(
        b,
        "Allocator retries and OOMs",
        "cudaMalloc retries (memory pressure) and OOMs per interval.",
        [
            Q(f"sum(increase(hpar_allocator_alloc_retries_total{{{SEL}}}[{RI}]))", "retries"),
            Q(f"sum(increase(hpar_allocator_ooms_total{{{SEL}}}[{RI}]))", "OOMs"),
        ],
        "short",
        gpu=True,
    )
    b.row("GPU health")
    ts(
        b,
        "GPU utilization",
        "Fraction of time a kernel ran (NVML), the $topn least busy ranks.",
        [Q(worst(f"hpar_gpu_utilization_ratio{{{SEL}}}", best=True), "rank {{rank}}")],
        "percentunit",
        w=8,
        gpu=True,
        max_val=1,
    )
    ts(
        b,
        "GPU power",
        "Board power draw, the $topn highest ranks.",
        [Q(worst(f"hpar_gpu_power_watts{{{SEL}}}"), "rank {{rank}}")],
        "watt",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU temperature",
        "GPU core temperature, the $topn hottest ranks.",
        [Q(worst(f"hpar_gpu_temperature_celsius{{{SEL}}}"), "rank {{rank}}")],
        "celsius",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU clocks",
        "SM and memory clocks, the $topn lowest; a straggler's clock is often throttled.",
        [Q(worst(f"hpar_gpu_clock_hertz{{{SEL}}}", best=True), "rank {{rank}} {{clock}}")],
        "hertz",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "Clock throttling",
        "Ranks on which each throttle reason is active.",
        [Q(f"sum by (reason) (hpar_gpu_throttle_active{{{SEL}}})", "{{reason}}")],
        "short",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "ECC errors",
        "Volatile ECC errors per interval on the $topn ranks with most; GpuEccErrors fires on uncorrected ones.",
        [
            Q(
                worst(
                    f"sum by (job, instance, rank, error_type) (increase(hpar_gpu_ecc_errors_total{{{SEL}}}[{RI}]))"
                ),
                "rank {{rank}} {{error_type}}",
            )
        ],
        "short",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "SM clock against its maximum",
        "Each rank's SM clock over the GPU's maximum (NVML), the $topn lowest: a throttled GPU sits below 1 "
        "under load (GpuThrottled names the reason); an idle one drops too.",
        [
            Q(
                worst(
                    f'max by (job, instance, rank) (hpar_gpu_clock_hertz{{{SEL},clock="sm"}}) / '
                    f'max by (job, instance, rank) (hpar_gpu_clock_max_hertz{{{SEL},clock="sm"}})',
                    best=True,
                ),
                "rank {{rank}}",
            )
        ],
        "percentunit",
        w=8,
        gpu=True,
    )
    ts(
        b,
        "GPU hardware errors",
        "Per interval: Xid critical errors by code, NVLink errors by kind; and the ranks with a memory "
        "repair pending or failed, or a PCIe link below its width. GpuHardwareErrors fires on each.",
        [
            Q(f"sum by (xid) (increase(hpar_gpu_xid_events_total{{{SEL}}}[{RI}]))", "Xid {{xid}}"),
            Q(f"sum by (kind) (increase(hpar_gpu_nvlink_errors_total{{{SEL}}}[{RI}]))", "NVLink {{kind}}"),
            Q(
                f'count(hpar_gpu_remapped_rows{{{SEL},kind=~"pending|failed"}} > 0)',
                "rows remap pending/failed",
            ),
            Q(f"count(hpar_gpu_retired_pages_pending{{{SEL}}} > 0)", "page retirement pending"),
            Q(
                f'count(hpar_gpu_pcie_link_width{{{SEL},which="current"}} < on (job, instance, rank, gpu) '
                f'hpar_gpu_pcie_link_width{{{SEL},which="max"}})',
                "PCIe below max width",
            ),
        ],
        "short",
        w=8,
        gpu=True,
    )
    return b
