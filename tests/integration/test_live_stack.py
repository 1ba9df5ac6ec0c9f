"""The real Prometheus and Alertmanager scraping the 4-rank trainer (dp1 x tp2 x pp2, 1F1B, aot_eager)
with the agent, loading the shipped rules of ``deploy/prometheus/rules``.

Two runs, one after the other, share one Prometheus/Alertmanager pair (scrape jobs ``hpar-leak`` and
``hpar-clean``):

- the leak run (``--inject tensor-leak`` on rank 3, plus ``graph-break`` and ``recompile-storm`` so the
  torch.compile panels have data) runs until Alertmanager has delivered MemoryLeak to the webhook,
  then stops; every dashboard panel that can have data on CPU must have it in that run;
- the clean run (no injection, same shape) must raise no alert in Prometheus.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hpar_agent import catalogue as cat
from hpar_agent.traceids import trace_id_hex
from testkit.live_run import LiveRun
from testkit.prom_stack import ALERTMANAGER, PROMETHEUS, ROOT, PromStack, finite_values, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="prometheus / prometheus-alertmanager not installed (.ci/setup installs them)",
    ),
]

LEAK_JOB, CLEAN_JOB = "hpar-leak", "hpar-clean"
COMPILE_ALERTS = ("GraphBreaks", "RecompileStorm")  # injected on every rank
EVERY_RANK = {"0", "1", "2", "3"}
LEAK_RANK, LEAK_STAGE = 3, 1  # mesh (dp, pp, tp) = (1, 2, 2): rank 3 is stage 1
SHAPE = (
    "--dp 1 --tp 2 --pp 2 --schedule 1f1b --microbatches 4 --layers 2 "
    "--compile aot_eager --log-every 10 --peak-tflops 0.05"
).split()
# The leak run has far more steps than it needs: it is stopped once the alert reached the webhook.
LEAK_ARGS = [
    *SHAPE,
    *"--steps 1000 --inject tensor-leak --inject graph-break --inject recompile-storm --inject-rank".split(),
    str(LEAK_RANK),
]
# Long enough for every detector to judge: MemoryLeak needs 5 warm-up + 20 window steps.
CLEAN_STEPS = 32
CLEAN_ARGS = [*SHAPE, "--steps", str(CLEAN_STEPS)]
START_TIMEOUT = 180  # torchrun up to every rank serving /metrics (all waits fit pytest-timeout's 600 s)
RUN_TIMEOUT = 300  # first scrape to MemoryLeak firing, or to the clean run's end
GPU_MARK = "Needs a CUDA GPU."
STEP_RATIOS = ("rank:hpar_goodput:ratio5m", "rank_phase:hpar_step_phase_duration_seconds:ratio5m")
#: Panels without data in the leak run on CPU although they are not GPU-only, and why.
NO_DATA_ON_CPU = {
    "Compile-cache hit ratio": "hpar_dynamo_cache_events_total counts AOTAutograd / FX graph cache "
    "lookups, which only the inductor backend makes; inductor is too slow on 2 CPU cores for a test",
    "Cache lookups by result": "same counter as 'Compile-cache hit ratio' (inductor only)",
    "Gradient-sync coverage: lowest $topn ranks": "the live run (dp1 x tp2 x pp2) has no data-parallel "
    "group to reduce gradients over; tests/distributed/test_gradsync_gloo.py checks the series on dp2",
    "Cache pollution: recompiles vs hit ratio ($topn ranks)": "its hit-ratio target reads the same cache "
    "counters (inductor only); tests/deploy promtool cases check the cache-pollution rule",
    "Unobserved flight-recorder entries": "only when the flight recorder's ring buffer overwrites entries "
    "before the agent reads them, which a healthy run never does",
    "FSDP all-gather / reduce-scatter bytes per second": "the live run (dp1 x tp2 x pp2) has no FSDP; "
    "tests/distributed/test_fsdp_agent.py checks these series on an HSDP run",
    "FSDP all-gather / reduce-scatter p99 latency by rank": "no FSDP in the live run, and gloo records no "
    "collective durations",
}
#: Grafana template variables and macros -> values for the live Prometheus ($job is the run's job).
RATE_INTERVAL = "15s"  # 4x the 1 s scrape interval and more; short enough for a run of a minute


@dataclass
class Run:
    run: LiveRun
    job: str
    start: float
    end: float
    prom_alerts: list[dict[str, Any]]  # /api/v1/alerts while the run was live
    rules: list[dict[str, Any]]  # /api/v1/rules groups while the run was live
    delivered: list[dict[str, Any]]  # webhook notifications while the run was live


def _targets(run: LiveRun) -> list[str]:
    return [f"127.0.0.1:{run.base + r}" for r in range(run.nproc)]


def _stop(run: LiveRun) -> None:
    """SIGTERM to torchrun, which terminates its workers; SIGKILL if it lingers."""
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGTERM)
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            run.kill()
    else:
        run.kill()


def _alive(run: LiveRun) -> None:
    if run.proc.poll() is not None:
        raise RuntimeError(f"trainer exited early ({run.proc.returncode}): {run.tail()}")


class _PortTaken(Exception):
    pass


def _serve(stack: PromStack, job: str, run: LiveRun) -> float:
    """Hand the run's endpoints to Prometheus once all of them answer (as service discovery does with a
    ready pod: HparAgentDown is for endpoints that go away, not for ones still importing torch); wait
    for their first scrape and return when it began."""

    def answering() -> bool:
        _alive(run)
        if "no metrics endpoint on this rank" in (run.run_dir / "torchrun.log").read_text():
            raise _PortTaken
        try:
            return all(run.scrape(r) for r in range(run.nproc))
        except OSError:
            return False

    wait_for(answering, START_TIMEOUT, f"the {job} run's endpoints")
    start = time.time()
    stack.set_targets(job, _targets(run))

    def scraped() -> bool:
        _alive(run)
        return len(stack.query(f'up{{job="{job}"}} == 1')) == run.nproc

    wait_for(scraped, 60, f"the first scrape of the {job} run")
    return start


def _launch(stack: PromStack, job: str, args: list[str], where: Path) -> tuple[LiveRun, float]:
    """Start the trainer and serve its endpoints to Prometheus. LiveRun's free base port lies in the
    ephemeral range, where the ranks' own gloo connections can take one of its ports before the agent
    binds it (the rank then serves nothing): start again on another base port."""
    for attempt in range(3):
        run = LiveRun(where / f"live-{job}-{attempt}", args)
        try:
            return run, _serve(stack, job, run)
        except _PortTaken:
            _stop(run)
        except BaseException:
            _stop(run)
            raise
    raise RuntimeError(f"three {job} runs found a metrics port taken")


def _ranks_fired(stack: PromStack, start: float, end: float) -> dict[str, set[str]]:
    """alertname -> the leak run's ranks on which that detector alert fired between start and end."""
    fired = stack.query_range(
        f'ALERTS{{job="{LEAK_JOB}",alertstate="firing",signal="detector"}}', start, end, step=1
    )
    ranks: dict[str, set[str]] = {}
    for series in fired:
        ranks.setdefault(series["metric"]["alertname"], set()).add(series["metric"]["rank"])
    return ranks


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    s = PromStack(tmp_path_factory.mktemp("prom"), [LEAK_JOB, CLEAN_JOB])
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def leak(stack: PromStack, tmp_path_factory: pytest.TempPathFactory) -> Run:
    run, start = _launch(stack, LEAK_JOB, LEAK_ARGS, tmp_path_factory.mktemp("leak"))
    try:

        def firing() -> bool:
            """MemoryLeak firing, and the compile alerts on every rank (a loaded machine compiles slowly)."""
            _alive(run)
            leaking = any(
                a["labels"].get("alertname") == "MemoryLeak" and a["labels"].get("job") == LEAK_JOB
                for a in stack.alerts()
                if a["state"] == "firing"
            )
            fired = _ranks_fired(stack, start, time.time())
            return leaking and all(fired.get(a) == EVERY_RANK for a in COMPILE_ALERTS)

        wait_for(firing, RUN_TIMEOUT, "MemoryLeak and the compile alerts firing in Prometheus")
        prom_alerts = stack.alerts()
        rules = stack.api("rules")["groups"]

        def delivered() -> list[dict[str, Any]]:
            _alive(run)
            return stack.webhook.alerts(alertname="MemoryLeak", job=LEAK_JOB)

        wait_for(delivered, 30, "MemoryLeak at the Alertmanager webhook")

        def recorded() -> bool:
            """The ratios of accounted steps have a value: they need two scrapes of series that start a
            step or two behind the clock, and a fast leak can page before that."""
            _alive(run)
            return all(finite_values(stack.query(f'{r}{{job="{LEAK_JOB}"}}')) for r in STEP_RATIOS)

        wait_for(recorded, 60, "the goodput and step-phase ratios recorded")
        end = time.time()
        notes = list(stack.webhook.notifications)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.set_targets(LEAK_JOB, [])
        _stop(run)
    return Run(run, LEAK_JOB, start, end, prom_alerts, rules, notes)


@pytest.fixture(scope="module")
def clean(stack: PromStack, tmp_path_factory: pytest.TempPathFactory) -> Run:
    run, start = _launch(stack, CLEAN_JOB, CLEAN_ARGS, tmp_path_factory.mktemp("clean"))
    try:
        prom_alerts: list[dict[str, Any]] = []
        rules: list[dict[str, Any]] = []
        # Poll until the trainer exits: the last answers while it is live are the ones kept.
        while run.proc.poll() is None:
            prom_alerts, rules = stack.alerts(), stack.api("rules")["groups"]
            if time.time() - start > RUN_TIMEOUT:
                raise TimeoutError(f"clean run did not finish: {run.tail()}")
            time.sleep(1)
        end = time.time()
        assert run.wait(60) == 0, run.tail()
    finally:
        stack.set_targets(CLEAN_JOB, [])
        _stop(run)
    return Run(run, CLEAN_JOB, start, end, prom_alerts, rules, list(stack.webhook.notifications))


# ------------------------------------------------------------------------------------------ alerts
def test_memory_leak_fires_in_prometheus_on_the_leaking_rank(stack: PromStack, leak: Run) -> None:
    mine = [a for a in leak.prom_alerts if a["labels"].get("job") == LEAK_JOB]
    leaks = [a for a in mine if a["labels"]["alertname"] == "MemoryLeak" and a["state"] == "firing"]
    assert leaks, mine
    for a in leaks:
        assert a["labels"]["rank"] == str(LEAK_RANK) and a["labels"]["pp_stage"] == str(LEAK_STAGE), a
        assert a["labels"]["signal"] == "detector" and a["labels"]["severity"] == "warning", a
        assert f"rank {LEAK_RANK} (stage {LEAK_STAGE}) of {LEAK_JOB}" in a["annotations"]["summary"], a
        assert "memory_viz" in a["annotations"]["description"], a
        assert a["annotations"]["runbook_url"] == cat.ALERTS_BY_NAME["MemoryLeak"].runbook_url, a
        assert a["annotations"]["dashboard_url"] == f"/d/{cat.DASH_MEMORY}", a
    # Attribution: in the whole run, MemoryLeak never fired for a rank that does not leak.
    others = stack.query_range(
        f'ALERTS{{alertname="MemoryLeak",alertstate="firing",job="{LEAK_JOB}",rank!="{LEAK_RANK}"}}',
        leak.start,
        leak.end,
    )
    assert others == [], others


def test_memory_leak_reaches_the_alertmanager_webhook(stack: PromStack, leak: Run) -> None:
    notes = [n for n in leak.delivered if n["groupLabels"] == {"job": LEAK_JOB, "alertname": "MemoryLeak"}]
    assert notes, leak.delivered
    assert all(n["receiver"] == "webhook" and n["path"] == "/hook" for n in notes), notes
    got = [a for n in notes for a in n["alerts"]]
    assert got and all(a["labels"]["alertname"] == "MemoryLeak" for a in got), got
    for a in got:
        assert a["status"] == "firing", a
        assert a["labels"]["rank"] == str(LEAK_RANK) and a["labels"]["signal"] == "detector", a
        assert a["annotations"]["summary"].startswith(f"Post-step memory keeps rising on rank {LEAK_RANK}"), a
        assert a["annotations"]["runbook_url"].endswith("/alerts.md#memoryleak"), a
        url = urllib.parse.urlsplit(a["generatorURL"])  # Prometheus names itself by its host name
        assert url.port == urllib.parse.urlsplit(stack.url).port, a
        assert urllib.parse.parse_qs(url.query)["g0.expr"] == [
            'hpar_alert_active{alert="MemoryLeak"} == 1'
        ], a


def test_the_detector_value_behind_the_alert_is_a_leak(stack: PromStack, leak: Run) -> None:
    """The series the alert reads agree: the detector's slope on rank 3 is above its 1 MiB/step
    threshold, and the rank's post-step RSS grew by about the injected 4 MiB per step."""
    sel = f'job="{LEAK_JOB}",rank="{LEAK_RANK}"'
    value = finite_values(stack.query(f'hpar_detector_value{{alert="MemoryLeak",{sel}}}', at=leak.end))
    assert value and value[0] >= 2**20, value
    rss = stack.query_range(f'hpar_memory_post_step_bytes{{source="rss",{sel}}}', leak.start, leak.end)
    points = finite_values(rss)
    assert points and points[-1] - min(points) >= 16 * 2**20, points


def test_injected_compile_failures_fire_their_alerts_too(stack: PromStack, leak: Run) -> None:
    """graph-break and recompile-storm (injected on every rank for the compile panels) reach
    Prometheus as their detector alerts during the run, on all four ranks."""
    ranks = _ranks_fired(stack, leak.start, leak.end)
    for alert in COMPILE_ALERTS:
        assert ranks.get(alert) == EVERY_RANK, ranks


def test_every_shipped_rule_evaluates_cleanly_on_live_data(leak: Run) -> None:
    rules = [r for g in leak.rules for r in g["rules"]]
    assert {r["name"] for r in rules if r["type"] == "alerting"} == {a.name for a in cat.ALERTS} | {
        "GpuMemoryNearFull",
        "GpuEccErrors",
        "GpuHardwareErrors",
        "GpuThrottled",
        "HparAgentDown",
        "HparAgentErrors",
        "InputBound",
    }
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert bad == [], bad


def test_clean_run_raises_no_alert(stack: PromStack, clean: Run) -> None:
    """No alert fires, in-process or from Prometheus' own rules. Rules with a ``for`` may go pending in
    a run this short, by design: MemoryLeak's 10m memory slope sees the warm-up, stage peers' graph
    fingerprints differ for the seconds between their first compiles, the 5m step-time means hold the
    first step's compile, and HparAgentDown holds from the ranks' exit until the targets are removed."""
    assert stack.query_range(f'up{{job="{CLEAN_JOB}"}} == 1', clean.start, clean.end), "never scraped"
    detectors = stack.query_range(f'hpar_detector_value{{job="{CLEAN_JOB}"}}', clean.start, clean.end)
    judged = {s["metric"]["alert"] for s in detectors}
    assert {"MemoryLeak", "Straggler", "CompileDivergence"} <= judged, judged  # the detectors did judge
    fired = stack.query_range(
        f'ALERTS{{job="{CLEAN_JOB}",alertstate="firing"}}', clean.start, clean.end, step=1
    )
    live = [a for a in clean.prom_alerts if a["labels"].get("job") == CLEAN_JOB and a["state"] == "firing"]
    delivered = stack.webhook.alerts(job=CLEAN_JOB)
    assert [s["metric"] for s in fired] == [], "fired in Prometheus during the clean run"
    assert [a["labels"] for a in live] == [], "firing at the clean run's end"
    assert [a["labels"] for a in delivered] == [], "delivered to the webhook"
    bad = [(r["name"], r.get("lastError")) for g in clean.rules for r in g["rules"] if r["health"] != "ok"]
    assert bad == [], bad


# ------------------------------------------------------------------------------------------ dashboards
def _panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], list(dash.get("panels", []))
    while stack:
        p = stack.pop()
        stack.extend(p.get("panels", []))
        if p.get("targets"):
            out.append(p)
    return out


def _expand(expr: str, job: str, range_s: int = 300) -> str:
    subs = {
        "$__rate_interval": RATE_INTERVAL,
        "$job": job,  # a plain name: no regex metacharacters
        "$rank": ".*",
        "$pp_stage": ".*",
        "$pg": ".*",
        "$job_id": ".*",
        "$topn": "5",
        "$__range": f"{range_s}s",
        "$__interval": "2s",
    }
    for k in sorted(subs, key=len, reverse=True):
        expr = expr.replace(k, subs[k])
    assert "$" not in expr, f"unreplaced Grafana variable in {expr!r}"
    return expr


DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))


def test_exclusions_name_real_cpu_panels() -> None:
    panels = {p["title"]: p for d in DASHBOARDS for p in _panels(json.loads(d.read_text()))}
    for title in NO_DATA_ON_CPU:
        assert title in panels, f"excluded panel {title!r} does not exist"
        assert not panels[title].get("description", "").endswith(GPU_MARK), title


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_dashboard_panels_have_live_data(stack: PromStack, leak: Run, path: Path) -> None:
    """Every target of every panel that can have data on CPU returns finite samples for the leak
    run's job: range queries over the run (as a time-series panel asks), instant ones at its end."""
    missing, checked = [], 0
    for panel in _panels(json.loads(path.read_text())):
        if panel.get("description", "").endswith(GPU_MARK) or panel["title"] in NO_DATA_ON_CPU:
            continue
        for t in panel["targets"]:
            expr = _expand(t["expr"], leak.job)
            if t.get("instant"):
                result = stack.query(expr, at=leak.end)
            else:
                result = stack.query_range(expr, leak.start, leak.end)
            checked += 1
            if not finite_values(result):
                missing.append(f"{panel['title']}: {expr}")
            jobs = {s["metric"].get("job") for s in result} - {None}
            assert jobs <= {leak.job}, (panel["title"], jobs)
    assert checked, path.name
    assert missing == [], "panels without data:\n" + "\n".join(missing)


def test_latency_exemplars_carry_the_step_trace_id(stack: PromStack, leak: Run) -> None:
    """The exemplars the latency panels ask for reach Prometheus with the trace id of their step."""
    job_id = leak.run.run_dir.name  # LiveRun sets HPAR_JOB_ID to the run directory's name
    steps = {trace_id_hex(job_id, s) for s in range(1000)}
    for metric in ("hpar_step_duration_seconds_bucket", "hpar_collective_duration_seconds_bucket"):
        data = stack.api(
            "query_exemplars", query=f'{metric}{{job="{leak.job}"}}', start=leak.start, end=leak.end
        )
        ids = {e["labels"]["trace_id"] for s in data for e in s["exemplars"]}
        assert ids, metric
        assert ids <= steps, ids - steps
