"""Per-step page faults and context switches: on train.step spans and as process counters."""

from __future__ import annotations

import mmap
import os
import time

import pytest

from hpar_agent import catalogue as cat
from hpar_agent.affinity import cpu_list, parse_cpu_list, read_binding
from hpar_agent.agent import Agent
from hpar_agent.collectors.memory import NvmlCollector
from hpar_agent.collectors.steps import StepCollector, _rusage
from hpar_agent.spans import realize
from hpar_agent.tools import doctor
from tests.unit.test_memory import FakeNvml, _replace, agent  # noqa: F401 (fixture)
from tests.unit.test_tracing import _spans, _step, _tracing, tracings  # noqa: F401 (fixture)


def _samples(comp: StepCollector, name: str) -> dict[str, float]:
    return {s.labels["kind"]: s.value for fam in comp.collect() for s in fam.samples if s.name == name}


def test_step_attributes_count_the_faults_of_that_step(tmp_path) -> None:
    ag = Agent(None, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    steps = StepCollector()
    ag.add_component(steps)
    steps.mark(explicit=True)  # step 0: nothing touched
    buf = mmap.mmap(-1, 8 << 20)  # step 1 touches 2048 fresh anonymous pages: one minor fault each
    for off in range(0, len(buf), mmap.PAGESIZE):
        buf[off] = 1
    steps.mark(explicit=True)
    steps.poll(time.time())
    quiet, touched = steps.take_completed()
    assert touched.attributes[cat.ATTR_MINOR_FAULTS] >= (8 << 20) // mmap.PAGESIZE * 0.9
    assert quiet.attributes[cat.ATTR_MINOR_FAULTS] < touched.attributes[cat.ATTR_MINOR_FAULTS] // 4
    for rec in (quiet, touched):
        assert rec.attributes[cat.ATTR_MAJOR_FAULTED] is (rec.attributes[cat.ATTR_MAJOR_FAULTS] > 0)
        assert all(
            rec.attributes[a] >= 0 for a in (cat.ATTR_VOLUNTARY_SWITCHES, cat.ATTR_INVOLUNTARY_SWITCHES)
        )
    faults = _samples(steps, "hpar_process_page_faults_total")
    assert faults["minor"] >= (8 << 20) // mmap.PAGESIZE and faults["minor"] <= _rusage()[0]
    assert set(faults) == {"minor", "major"}
    assert set(_samples(steps, "hpar_process_context_switches_total")) == {"voluntary", "involuntary"}
    steps.uninstall()


def test_step_attributes_reach_the_train_step_span(tmp_path, tracings) -> None:  # noqa: F811
    t, exp = _tracing(tmp_path, tracings, trace_every=1)
    rec = _step(3, attributes={cat.ATTR_MAJOR_FAULTS: 7, cat.ATTR_MAJOR_FAULTED: True})
    assert t.export_step(rec)
    root = next(s for s in _spans(t, exp) if s.name == cat.SPAN_STEP)
    assert root.attributes[cat.ATTR_MAJOR_FAULTS] == 7 and root.attributes[cat.ATTR_MAJOR_FAULTED] is True
    assert root.attributes[cat.ATTR_STEP] == 3  # the common attributes are kept


def test_rusage_read_is_microseconds() -> None:
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        _rusage()
    assert (time.perf_counter() - t0) / n < 20e-6  # ~0.6 µs measured; generous for a loaded CI box


# ------------------------------------------------------------------------------------------ NUMA binding
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
    assert bad.labels() == {"numa_node": "0", "cpu_affinity": cpu_list(mine), "gpu_numa_node": "1",
                            "gpu_cpu_affinity": cpu_list(far)}  # fmt: skip
    good = read_binding(AffinityNvml(set(mine), 0), "h", str(tmp_path))
    assert not good.misbound and good.gpu_numa == 0
    unknown = read_binding(None, None, str(tmp_path))  # no NVML: the CPU half only, never misbound
    assert not unknown.misbound and unknown.labels()["gpu_cpu_affinity"] == ""


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


def test_doctor_reports_the_binding() -> None:
    mine = os.sched_getaffinity(0)
    bad = doctor._numa(AffinityNvml({max(mine) + 64}, 1))[0]
    assert bad.status == doctor.DEGRADED and "none shared" in bad.detail and "numactl" in bad.fix
    good = doctor._numa(AffinityNvml(set(mine), 0))[0]
    assert good.status == doctor.OK and f"GPU ideal CPUs {cpu_list(mine)}" in good.detail
    assert any(c.name == "NUMA binding" for c in doctor.run_checks())


# ------------------------------------------------------------------------------------------ stream handle
class _Stream:
    stream_id, cuda_stream = 3, 0x7F3A00001000


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object) -> None:
        assert stream is _STREAM

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 2.0  # ms


_STREAM = _Stream()


def test_chunk_spans_carry_the_stream_handle_beside_its_name(tmp_path, monkeypatch) -> None:
    import torch

    from hpar_agent.collectors.pipeline import PipelineCollector

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _STREAM)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    class Stage:
        device, stage_index = torch.device("cuda", 0), 1

        def forward_one_chunk(self, chunk: int) -> str:
            return "out"

    ag = Agent(None, metrics_port=-1, traces="none", run_dir=str(tmp_path))
    ag.tracing = object()  # spans on (tracing_on), no exporter needed: add_span only queues
    pipe = PipelineCollector()
    ag.add_component(pipe)
    stage = Stage()
    pipe.watch([stage])
    assert stage.forward_one_chunk(0) == "out"
    pipe.poll(time.time())
    (span,) = [realize(s) for spans in ag.span_schedule.pending.values() for s in spans]
    assert span.attributes[cat.ATTR_STREAM] == "cuda:3"
    assert span.attributes[cat.ATTR_STREAM_HANDLE] == 0x7F3A00001000
    assert span.end_ns - span.start_ns == 2_000_000
    pipe.uninstall()
