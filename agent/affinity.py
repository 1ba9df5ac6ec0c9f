"""CPU and NUMA binding of a rank against its GPU's ideal CPUs (NVML), read once at attach.

A rank whose allowed CPUs (``os.sched_getaffinity``) share none with the CPUs NVML calls ideal for its
GPU (``nvmlDeviceGetCpuAffinity``: the GPU's NUMA node) copies every host<->device buffer and pins
every page across the socket link: steps carry cross-node memory traffic and page-fault long tails.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Any

#: Longest CPU list kept in a label (hpar_rank_info): longer lists end in "...".
MAX_LIST_CHARS = 64


def cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """``{0,1,2,3,8}`` -> ``"0-3,8"`` (the kernel's cpulist form), at most ``MAX_LIST_CHARS`` long."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    text = ",".join(out)
    return text if len(text) <= MAX_LIST_CHARS else text[: MAX_LIST_CHARS - 3].rsplit(",", 1)[0] + ",..."


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's cpulist form (``"0-3,8"``) -> CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: str = "/sys/devices/system/node") -> dict[int, set[int]]:
    """NUMA node -> its CPUs (empty where sysfs shows no nodes)."""
    nodes: dict[int, set[int]] = {}
    for path in glob.glob(os.path.join(root, "node[0-9]*", "cpulist")):
        m = re.search(r"node(\d+)", path)
        try:
            with open(path, encoding="ascii") as fh:
                nodes[int(m.group(1))] = parse_cpu_list(fh.read())  # type: ignore[union-attr]
        except (OSError, ValueError):
            continue
    return nodes


def nodes_of(cpus: set[int], nodes: dict[int, set[int]]) -> list[int]:
    return sorted(n for n, members in nodes.items() if members & cpus)


def gpu_ideal_cpus(nv: Any, handle: Any) -> set[int] | None:
    """NVML's ideal CPUs of the GPU: a bitmask in 64-bit words (None where NVML cannot say)."""
    words = ((os.cpu_count() or 64) + 63) // 64
    try:
        mask = nv.nvmlDeviceGetCpuAffinity(handle, words)
    except Exception:
        return None
    cpus = {i * 64 + b for i, word in enumerate(mask) for b in range(64) if int(word) >> b & 1}
    return cpus or None


def gpu_numa_node(nv: Any, handle: Any) -> int | None:
    """``nvmlDeviceGetNumaNodeId`` (NVML >= 12.x; None on older drivers and where NVML says none)."""
    fn = getattr(nv, "nvmlDeviceGetNumaNodeId", None)
    if fn is None:
        return None
    try:
        node = int(fn(handle))
    except Exception:
        return None
    return node if node >= 0 else None


@dataclass(frozen=True)
class Binding:
    """Where the process may run and where its GPU would like it to."""

    cpus: frozenset[int]
    numa: tuple[int, ...]  # NUMA nodes of the allowed CPUs
    gpu_cpus: frozenset[int] | None = None  # NVML's ideal CPUs for the GPU (None: unknown / no GPU)
    gpu_numa: int | None = None

    @property
    def misbound(self) -> bool:
        """The allowed CPUs share none with the GPU's ideal CPUs (unknown ideal: not misbound)."""
        return bool(self.gpu_cpus) and not (self.cpus & self.gpu_cpus)  # type: ignore[operator]

    def labels(self) -> dict[str, str]:
        """Bounded strings for ``hpar_rank_info`` ("" where unknown)."""
        return {
            "numa_node": ",".join(map(str, self.numa)),
            "cpu_affinity": cpu_list(self.cpus),
            "gpu_numa_node": "" if self.gpu_numa is None else str(self.gpu_numa),
            "gpu_cpu_affinity": cpu_list(self.gpu_cpus) if self.gpu_cpus else "",
        }


def read_binding(nv: Any = None, handle: Any = None, node_root: str = "/sys/devices/system/node") -> Binding:
    """This process's binding; the GPU half only with an NVML module and device handle."""
    try:
        cpus = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = frozenset(range(os.cpu_count() or 1))
    nodes = numa_nodes(node_root)
    gpu_cpus = gpu_ideal_cpus(nv, handle) if nv is not None and handle is not None else None
    gpu_numa = gpu_numa_node(nv, handle) if nv is not None and handle is not None else None
    if gpu_numa is None and gpu_cpus:
        found = nodes_of(gpu_cpus, nodes)
        gpu_numa = found[0] if len(found) == 1 else None
    return Binding(
        cpus, tuple(nodes_of(set(cpus), nodes)), frozenset(gpu_cpus) if gpu_cpus else None, gpu_numa
    )
