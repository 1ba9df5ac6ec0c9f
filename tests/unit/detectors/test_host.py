"""NumaMisbinding (``detectors.host``): the rank's CPUs against its GPU's ideal CPUs, in hpar_rank_info
and as an alert."""

from __future__ import annotations

import os

import pytest

from hpar_agent.affinity import cpu_list
from hpar_agent.collectors.memory import NvmlCollector
from tests.unit.test_affinity import AffinityNvml
from tests.unit.test_memory import _replace, agent  # noqa: F401 (fixture)


@pytest.mark.parametrize("misbound", [True, False])
def test_rank_info_and_numa_misbinding_alert(agent, misbound) -> None:  # noqa: F811
    mine = os.sched_getaffinity(0)
    ideal = {max(mine) + 64} if misbound else set(mine)
    _replace(agent, NvmlCollector(nvml=AffinityNvml(ideal, 1 if misbound else 0)))
    agent.tick()
    info = next(s for fam in agent.registry.collect() for s in fam.samples if s.name == "hpar_rank_info")
    assert info.labels["cpu_affinity"] == cpu_list(mine)
    assert info.labels["gpu_cpu_affinity"] == cpu_list(ideal)
    assert info.labels["gpu_numa_node"] == ("1" if misbound else "0")
    labels = {"rank": "0", "pp_stage": "0", "alert": "NumaMisbinding"}
    assert agent.registry.get_sample_value("hpar_alert_active", labels) == (1.0 if misbound else 0.0)
    assert agent.registry.get_sample_value("hpar_detector_value", labels) == (0.0 if misbound else len(mine))
