"""Every launcher and framework users run, under ``hpar-agent run`` with no change to the program, and
with the program calling ``hpar_agent.attach()`` (the ``attach_*`` jobs): each rank observed once (and
no launcher, parent or worker process), with its rank, world, backend and dp (the DDP the framework
builds after attach included);
steps equal to the optimizer steps taken; collectives on every rank; compile counts equal to dynamo's
own in the same process, with the real backend under DDP; no alert on a clean rank and the planted
fault's alert on its rank; nothing of the agent in the job's output but its own lines; private files.

The jobs are in ``conftest.SPECS`` (each runs once, on first use). README's "Works with" table and
docs/launchers.md name these tests."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from hpar_agent.collectors.zerocode import NO_STEPS
from hpar_agent.tools.report import build_report
from testkit.zerocode import OWN_LINES, events
from tests.compat.conftest import SPECS, Run

ALL = list(SPECS)
DISTRIBUTED = [n for n, s in SPECS.items() if s.world > 1]
COMPILED = [n for n, s in SPECS.items() if s.compile_backend]
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.compat
CompatRun = Callable[[str], Run]


@pytest.mark.parametrize("name", ALL)
def test_every_rank_is_observed_once_with_its_topology(compat_run: CompatRun, name: str) -> None:
    run = compat_run(name)
    world = run.spec.world
    sums = run.summaries()
    assert sorted(sums) == list(range(world)), run.why()
    for r, s in sums.items():
        topo = s["topology"]
        assert (s["rank"], topo["world_size"], topo["backend"]) == (
            r,
            str(world),
            "gloo" if world > 1 else "none",
        )
        assert (topo["dp"], topo["dp_rank"]) == (str(world), str(r)), topo  # DDP built after attach
        if run.spec.zero_code:
            expected = (
                "init_process_group"
                if world > 1
                else "compile"
                if run.spec.compile_backend
                else "optimizer step"
            )
            assert s["components"]["zerocode"]["attached_at"] == expected
        assert s["errors"] == {}, s["errors"]
    # no other process attached: not the launcher, not the parent that spawned, not a worker
    assert sorted(p.name for p in run.run_dir.glob("events.rank*.jsonl")) == [
        f"events.rank{r}.jsonl" for r in range(world)
    ]
    for r in range(world):
        assert [e["kind"] for e in events(run.run_dir, r)].count("attach") == 1
    if run.spec.zero_code:
        assert (
            f"ranks observed: {world} of {world}" in run.proc.stderr and "not observed" not in run.proc.stderr
        )


@pytest.mark.parametrize("name", ALL)
def test_steps_are_the_optimizer_steps_taken(compat_run: CompatRun, name: str) -> None:
    run = compat_run(name)
    results, sums = run.results(), run.summaries()
    assert sorted(results) == sorted(sums), run.why()
    for r, res in results.items():
        assert sums[r]["components"]["steps"]["steps"] == res["steps"] > 0, (r, res)


@pytest.mark.parametrize("name", DISTRIBUTED)
def test_collectives_are_counted_on_every_rank(compat_run: CompatRun, name: str) -> None:
    """At least the one gradient all-reduce per step each rank took part in."""
    run = compat_run(name)
    for r, s in run.summaries().items():
        seen = sum(int(t["count"]) for t in s["components"]["collectives"]["table"])
        assert seen >= s["components"]["steps"]["steps"], (r, s["components"]["collectives"])


@pytest.mark.parametrize("name", COMPILED)
def test_compile_counts_equal_dynamos_own(compat_run: CompatRun, name: str) -> None:
    """Graphs, graph breaks and recompiles as dynamo counted them in the same process, and the backend
    the program chose (under DDP dynamo wraps it in its DDPOptimizer)."""
    run = compat_run(name)
    results = run.results()
    for r, s in run.summaries().items():
        comp, dynamo = s["components"]["compile"], results[r]["dynamo"]
        assert comp["graphs_compiled"] == dynamo["unique_graphs"] > 0, (comp, dynamo)
        assert 0 < comp["graphs"] <= comp["graphs_compiled"]
        assert sum(b["count"] for b in comp["graph_breaks"]) == dynamo["graph_breaks"], (comp, dynamo)
        assert sum(x["count"] for x in comp["recompiles"]) == dynamo["recompiles"], (comp, dynamo)
        assert comp["backends"] == [run.spec.compile_backend], comp


@pytest.mark.parametrize("name", ALL)
def test_no_alert_but_the_planted_faults(compat_run: CompatRun, name: str) -> None:
    """A clean rank raises nothing; a 4 MiB/step host leak raises MemoryLeak and a rank 15x slower
    than its peer Straggler, on that rank."""
    run = compat_run(name)
    alerts = run.alerts()
    for r in range(run.spec.world):
        if r in run.spec.faults:
            assert run.spec.faults[r] in alerts.get(r, set()), (r, alerts)
        else:
            assert alerts.get(r, set()) == set(), (r, alerts)


def test_an_hf_trainer_evaluation_is_host_time_on_every_rank(compat_run: CompatRun) -> None:
    """The Trainer evaluates through the model DDP wraps, not the wrapper whose forward the agent times,
    at steps the detail stride leaves without detail: each rank's evaluation is lost host time in
    goodput (it was counted with the recent steps' shares, mostly productive). Its batch fetches count
    as data wait: the bound leaves room for them."""
    run = compat_run("hf_trainer_eval")
    results = run.results()
    for r, s in run.summaries().items():
        goodput, evaluated = s["components"]["goodput"], results[r]["evaluated_s"]
        assert s["components"]["steps"]["detail_stride"] > 1, s["components"]["steps"]  # else all detailed
        assert evaluated > 0.5 and goodput["lost_seconds"]["host"] >= 0.8 * evaluated, (r, evaluated, goodput)


@pytest.mark.parametrize("name", ALL)
def test_nothing_of_the_agent_in_the_output_but_its_own_lines(compat_run: CompatRun, name: str) -> None:
    run = compat_run(name)
    assert NO_STEPS not in run.output  # every rank stepped an optimizer: no advice
    assert "[c10d]" not in run.output  # no c10d server or store line of the agent's
    for line in run.output.splitlines():
        text = line.replace(str(REPO), "<repo>").replace(str(run.run_dir.parents[1]), "<tmp>")
        if "hpar" in text.lower():
            assert text.startswith(OWN_LINES), line


@pytest.mark.parametrize("name", ALL)
def test_every_file_and_directory_is_private(compat_run: CompatRun, name: str) -> None:
    run = compat_run(name)
    paths = [run.run_dir, *run.run_dir.rglob("*")]
    assert len(paths) > 1
    for p in paths:
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p}: {oct(mode)}"


def test_the_report_is_private(compat_run: CompatRun) -> None:
    run = compat_run("mp_spawn")
    out = build_report(run.run_dir)
    assert out == run.run_dir / "report.html" and stat.S_IMODE(out.stat().st_mode) == 0o600
