"""The overhead benchmark's interval of the median (exact order-statistic coverage, not a bootstrap's
claim) and its ablation arms."""

from __future__ import annotations

import json

import pytest

from benchmarks.overhead import (
    agent_arm,
    agent_lines,
    agent_notes,
    agent_totals,
    arm_env,
    core_halves,
    cpu_spinner,
    gil_burner,
    median_interval,
    p99,
    parse_variants,
    parse_windows,
    pooled_p99,
    ratio_stats,
    referenced_ratios,
    step_events,
    window_ratios,
)


def test_three_pairs_give_min_max_at_75_percent() -> None:
    assert median_interval([1.02, 0.98, 1.05]) == (0.98, 1.05, 0.75)


def test_nine_pairs_give_second_order_statistics_at_96_percent() -> None:
    lo, hi, cov = median_interval([9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0])
    assert (lo, hi) == (2.0, 8.0)
    assert cov == pytest.approx(1 - 2 * 10 / 512) and cov >= 0.95


def test_seven_pairs_give_min_max_at_98_percent() -> None:
    lo, hi, cov = median_interval([3.0, 1.0, 7.0, 2.0, 6.0, 4.0, 5.0])
    assert (lo, hi) == (1.0, 7.0)
    assert cov == pytest.approx(1 - 2 / 128)


def test_ratio_stats_reports_the_coverage() -> None:
    st = ratio_stats([1.0, 1.1, 0.9])
    assert (st["ci_lo"], st["ci_hi"], st["ci_coverage"]) == (0.9, 1.1, 0.75)
    assert "ci95_lo" not in st


def test_p99_interpolates_and_stays_within_range() -> None:
    assert p99([0.0, 1.0]) == pytest.approx(0.99)
    assert p99([5.0]) == 5.0


def test_variants_are_agent_arms_with_their_own_settings() -> None:
    v = parse_variants(["nopass:HPAR_INTERVAL=3600,HPAR_FR_INTERVAL=86400", "lean:HPAR_BENCH_DROP=anatomy,pipeline"])
    assert v == {"nopass": {"HPAR_INTERVAL": "3600", "HPAR_FR_INTERVAL": "86400"},
                 "lean": {"HPAR_BENCH_DROP": "anatomy,pipeline"}}  # fmt: skip
    assert agent_arm("on") and agent_arm("lean", v) and not agent_arm("aa", v) and not agent_arm("lean")
    env = arm_env("nopass", "/run", "job", v)
    assert env["HPAR_INTERVAL"] == "3600" and env["HPAR_RUN_DIR"] == "/run" and env["HPAR_TRACES"] == "file"
    assert arm_env("off", "/run", "job", v) == {}
    for bad in ("on:HPAR_INTERVAL=2", "x", ":HPAR_INTERVAL=2"):
        with pytest.raises(SystemExit):
            parse_variants([bad])


def test_pace_variant_sets_the_slices_of_each_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpar_agent.agent as agent_mod
    from benchmarks import overhead
    from hpar_agent import gil

    seen: list[tuple[int, int, bool]] = []

    def tick(self: object, final: bool = False, paced: bool = False) -> None:
        y = gil.Yielder()
        seen.append((y.hold_ns, y.slot_ns, paced))

    monkeypatch.setattr(agent_mod.Agent, "tick", tick)
    defaults = gil.Yielder.__init__.__defaults__
    try:
        overhead.allow_pacing_variants()
        monkeypatch.setenv("HPAR_BENCH_PACE", "0.25/25")
        agent_mod.Agent.tick(object(), paced=True)
        monkeypatch.setenv("HPAR_BENCH_PACE", "2/0")
        agent_mod.Agent.tick(object(), paced=True)
        monkeypatch.delenv("HPAR_BENCH_PACE")
        agent_mod.Agent.tick(object(), paced=True)
    finally:
        gil.Yielder.__init__.__defaults__ = defaults
    assert seen == [(250_000, 25_000_000, True), (2_000_000, gil.SLOT_NS, False), (gil.HOLD_NS, gil.SLOT_NS, True)]


def _block(arm: str, pair: int, times: list[float], start_ns: int = 0) -> dict[str, object]:
    ends, t = [], start_ns
    for x in times:
        t += int(x * 1e9)
        ends.append(t)
    return {"arm": arm, "pair": pair, "times": times, "ends": ends}


def test_windows_separate_the_attach_transient_from_the_later_steps() -> None:
    blocks = [_block("off", p, [1.0] * 6) for p in range(3)]
    blocks += [_block("on", p, [1.5, 1.5, 1.02, 1.02, 1.02, 1.02]) for p in range(3)]
    w = window_ratios(blocks, ["off", "on"], parse_windows("0:2,2:6"))
    assert w["0:2"]["on"]["median"] == pytest.approx(1.5)
    assert w["2:6"]["on"]["median"] == pytest.approx(1.02)
    with pytest.raises(SystemExit):
        parse_windows("5:3")


def test_reference_cancels_a_slowdown_of_the_whole_machine() -> None:
    """The on block runs while the machine is 20 % slower: raw, on/off reads 1.2 x 1.01; divided by the
    reference job's steps of the same seconds, 1.01."""
    off = _block("off", 0, [1.0] * 10, start_ns=0)
    on = _block("on", 0, [1.2 * 1.01] * 10, start_ns=20 * 10**9)
    ref = [_block("off", -1, [0.5] * 40, start_ns=0), _block("off", -1, [0.6] * 40, start_ns=20 * 10**9)]
    raw = ratio_stats([on["times"][0] / off["times"][0]])  # type: ignore[index]
    assert raw["median"] == pytest.approx(1.212)
    assert referenced_ratios([off, on], ref, ["off", "on"], skip=2)["on"]["median"] == pytest.approx(1.01)


def test_pooled_p99_is_over_every_kept_step_of_the_paired_blocks() -> None:
    blocks = [_block("off", -1, [9.0] * 4)] + [_block("off", p, [1.0] * 99 + [2.0]) for p in range(2)]
    blocks += [_block("on", p, [1.0] * 100) for p in range(2)]
    st = pooled_p99(blocks, ["off", "on"], skip=0)
    assert st["off"]["steps"] == 200 and st["off"]["p99_s"] == pytest.approx(p99([1.0] * 198 + [2.0] * 2))
    assert st["on"]["ratio"] < 1.0


def test_core_halves_keep_hyperthread_siblings_together() -> None:
    """CPUs 0/2 and 1/3 are siblings (two cores), 4 a core of its own: a job gets whole cores."""
    topo = {0: "0,2", 2: "0,2", 1: "1,3", 3: "1,3", 4: "4"}
    assert core_halves([0, 1, 2, 3, 4], topo.__getitem__) == ([0, 1, 2, 3], [4])
    assert core_halves([0, 1, 2, 3], topo.__getitem__) == ([0, 2], [1, 3])
    first, second = core_halves([0, 1])  # this machine's sysfs
    assert first and second and not set(first) & set(second)


def test_gil_burner_holds_slices_at_its_slots_and_stops() -> None:
    import sys
    import threading
    import time

    with gil_burner("1/20") as slices:
        time.sleep(0.25)
    assert slices[0] >= 3
    assert not any(t.name == "gil-burner" for t in threading.enumerate())
    with gil_burner("1/20/0.2") as fast:
        time.sleep(0.1)
    assert fast[0] >= 1 and sys.getswitchinterval() == pytest.approx(0.005)
    with gil_burner("") as none:
        time.sleep(0.05)
    assert none == [0]


def test_cpu_spinner_keeps_a_core_busy_in_bursts_without_holding_the_gil_and_stops() -> None:
    """Bursts of ~300 ms every 400 ms: the thread's CPU grows by about that, at nice 19, while this
    thread keeps running Python (a burst that held the GIL would stop it for the whole burst)."""
    import os
    import threading
    import time

    def stat_of(name: str) -> list[str]:
        t = next(t for t in threading.enumerate() if t.name == name)
        with open(f"/proc/self/task/{t.native_id}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()

    with cpu_spinner("300/400") as bursts:
        longest, last, end = 0.0, time.perf_counter(), time.perf_counter() + 1.0
        while time.perf_counter() < end:  # Python on this thread all along: the gaps say who held the GIL
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        while not bursts[0]:
            time.sleep(0.01)
        stat = stat_of("cpu-spinner")
    assert (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK") >= 0.1  # utime + stime: ~0.3 s a burst
    assert int(stat[16]) == 19
    assert longest < 0.15  # never stopped for a burst
    assert not any(t.name == "cpu-spinner" for t in threading.enumerate())
    with cpu_spinner("50/100/idle") as bursts:  # SCHED_IDLE, as the agent's helpers by default
        while not bursts[0]:
            time.sleep(0.01)
        tid = next(t for t in threading.enumerate() if t.name == "cpu-spinner").native_id
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
    with cpu_spinner("") as none:
        time.sleep(0.01)
    assert none == [0]


def test_blocks_carry_what_the_agents_summary_says_of_its_reads_and_slices(tmp_path, monkeypatch) -> None:
    """A real attach and detach writes the summary the blocks read their notes from; the totals add
    up the agent arms' blocks (an arm's notes say on the device whether a variant did what it meant)."""
    import torch

    import hpar_agent

    monkeypatch.setenv("HPAR_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("HPAR_METRICS_PORT", "0")
    monkeypatch.setenv("HPAR_TRACES", "file")
    model = torch.nn.Linear(4, 4)
    hpar_agent.attach(model)
    try:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
    finally:
        hpar_agent.detach()
    notes = agent_notes(str(tmp_path), 0)
    coll = json.loads((tmp_path / "summary.rank0.json").read_text())["components"]["collectives"]
    assert notes["by"] == coll["full_reads_by"]  # which reads there were depends on the process's groups
    assert notes["slices"] == coll["work_in_waits"] == {"on": False, "in_wait": 0, "at_slot": 0}  # no CPU pipeline
    assert agent_notes(str(tmp_path), 1) == {}  # no such rank's summary
    seen = {"by": {"first": 1, "final": 1}, "slices": {"on": True, "in_wait": 40, "at_slot": 9}}
    totals = agent_totals([{"arm": "on", "agent": notes}, {"arm": "on", "agent": seen}, {"arm": "off", "agent": {}}])
    assert list(totals) == ["on"]
    assert totals["on"]["blocks"] == 2 and totals["on"]["in_wait"] == 40 and totals["on"]["at_slot"] == 9
    assert totals["on"]["reads"]["final"] == 1 + notes["by"].get("final", 0)
    assert "parked into a wait 40, at a slot 9" in agent_lines(totals)[0]


def test_a_runs_long_step_and_full_collections_are_placed_on_their_steps(tmp_path) -> None:
    out = tmp_path / "run.json"
    out.write_text(json.dumps({"step_times": [2.0, 0.08, 0.08, 0.2, 0.08, 0.081],
                               "step_starts": [100.0, 102.0, 102.1, 102.2, 102.4, 102.5]}))
    (tmp_path / "run.json.gc.json").write_text(json.dumps([[101.0, 0.15], [102.25, 0.12]]))
    ev = step_events(str(out), skip=1, med=0.08)
    assert ev["steps_ms"][3] == 200.0
    assert ev["long"] == [(3, 200.0)]  # step 0 is over 1.5x the median too, but not kept
    assert ev["gc2"] == [(0, 150.0), (3, 120.0)]
    (tmp_path / "run.json.gc.json").unlink()
    assert step_events(str(out), skip=1, med=0.08)["gc2"] == []  # an in-process run records none
