"""The step collector: per-step page faults and context switches, on train.step spans and as process
counters, read in microseconds."""

from __future__ import annotations

import mmap
import time

from hpar_agent import catalogue as cat
from hpar_agent.agent import Agent
from hpar_agent.collectors.steps import StepCollector, _rusage
from tests.unit.test_otel import _spans, _step, _tracing, tracings  # noqa: F401 (fixture)


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
