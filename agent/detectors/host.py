"""NumaMisbinding: the rank may run only on CPUs outside its GPU's NUMA node."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpar_agent.detectors.base import Detector, Verdict

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot


class NumaMisbinding(Detector):
    """The process's allowed CPUs (``os.sched_getaffinity``) share none with NVML's ideal CPUs for the
    rank's GPU (``nvmlDeviceGetCpuAffinity``), read once at attach (``hpar_agent.affinity``).

    Fires at the first evaluation (the binding does not change); no NVML or no GPU: no verdict. Value:
    the allowed CPUs among the GPU's ideal ones. Details: allowed CPUs and NUMA nodes, the GPU's ideal
    CPUs and node.
    """

    name = "NumaMisbinding"
    threshold_param = "min_shared_cpus"

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        binding = snap.binding
        if binding is None or not binding.gpu_cpus:
            return None
        shared = len(binding.cpus & binding.gpu_cpus)
        return Verdict(shared < self.p("min_shared_cpus"), float(shared), binding.labels())
