"""CPU affinity against the GPU's ideal CPUs (``affinity``): cpu lists, the binding read from NVML and
the NUMA nodes' cpulists."""

from __future__ import annotations

import os

from hpar_agent.affinity import cpu_list, parse_cpu_list, read_binding
from tests.unit.test_memory import FakeNvml


class AffinityNvml(FakeNvml):
    """FakeNvml whose GPU prefers ``ideal`` CPUs on NUMA node ``node``."""

    def __init__(self, ideal: set[int], node: int) -> None:
        super().__init__()
        self.ideal, self.node = ideal, node

    def nvmlDeviceGetCpuAffinity(self, h, words):
        mask = [0] * max(words, max(self.ideal) // 64 + 1)
        for c in self.ideal:
            mask[c // 64] |= 1 << (c % 64)
        return mask

    def nvmlDeviceGetNumaNodeId(self, h):
        return self.node


def test_cpu_lists_round_trip_and_stay_bounded() -> None:
    assert cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    long = cpu_list(set(range(0, 400, 2)))
    assert len(long) <= 64 and long.endswith(",...")


def test_binding_against_the_gpus_ideal_cpus(tmp_path) -> None:
    mine = os.sched_getaffinity(0)
    far = {max(mine) + 64, max(mine) + 65}
    for node, cpus in ((0, mine), (1, far)):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpu_list(cpus) + "\n")
    bad = read_binding(AffinityNvml(far, 1), "h", str(tmp_path))
    assert bad.misbound and bad.numa == (0,) and bad.gpu_numa == 1
    assert bad.labels() == {
        "numa_node": "0",
        "cpu_affinity": cpu_list(mine),
        "gpu_numa_node": "1",
        "gpu_cpu_affinity": cpu_list(far),
    }
    good = read_binding(AffinityNvml(set(mine), 0), "h", str(tmp_path))
    assert not good.misbound and good.gpu_numa == 0
    unknown = read_binding(None, None, str(tmp_path))  # no NVML: the CPU half only, never misbound
    assert not unknown.misbound and unknown.labels()["gpu_cpu_affinity"] == ""
