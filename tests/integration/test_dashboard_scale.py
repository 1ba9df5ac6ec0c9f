"""The dashboards at scale: a real Prometheus (shipped rules loaded, 1 s scrapes) scraping 256 simulated
ranks, and every panel's query returning at most the series the panel is meant to draw.

The ranks are ``testkit/metrics_sim.py``'s simulator replaying one exposition per rank, each built
with the agent's own metric families (:class:`hpar_agent.families.Families`) for every metric of the
catalogue, so every panel (GPU ones included) has data. Values grow with the rank, so the worst-N panels
must pick the highest ranks and the best-N ones the lowest. Ranks 0-127 belong to run ``run-a`` and
128-255 to ``run-b`` (the ``job_id`` of ``hpar_rank_info``), both in one scrape job.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest

from hpar_agent import catalogue as cat
from hpar_agent.families import Families
from testkit.ports import free_base_port
from testkit.prom_stack import ALERTMANAGER, PROMETHEUS, ROOT, PromStack, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="prometheus / prometheus-alertmanager not installed (.ci/setup installs them)",
    ),
]

RANKS = 256
TOPN = 5
JOB = "hpar-sim"
SCRAPES = 8  # scrapes of every rank before querying: enough for rate() over RATE_INTERVAL
RATE_INTERVAL = "4s"
#: One value per label, two where a panel compares them; label values the dashboards filter on.
DOMAIN: dict[str, tuple[str, ...]] = {
    cat.COMPONENT: ("steps",),
    cat.ALERT: ("MemoryLeak", "Straggler"),
    cat.REASON: ("gb0001",),
    cat.PHASE: ("forward", "backward"),
    cat.OUTCOME: ("success",),
    cat.TRIGGER: ("recompile",),
    cat.CACHE: ("fx_graph",),
    cat.RESULT: ("hit", "miss"),
    cat.KIND: ("allocated", "pending"),
    cat.SOURCE: ("allocator", "rss"),
    cat.BUFFER: ("steps",),
    cat.CLOCK: ("sm",),
    cat.ERROR_TYPE: ("uncorrected",),
    cat.PEER: ("0",),
    cat.VERDICT: ("input-bound",),
    cat.PG: ("tp", "dp"),
    cat.OP: ("all_reduce",),
    cat.STREAM: ("cpu",),
    cat.BACKEND: ("inductor",),
    cat.GROUP: ("dp",),
    cat.CULPRIT: ("3",),
    cat.CAUSE: ("compile", "wait"),
    cat.GPU: ("0",),
    cat.WHICH: ("current", "max"),
    cat.XID: ("79",),
}
BUCKETS = (0.01, 0.1, 1.0)
#: 0/1 state gauges (the simulator keeps 0 and 1 as they are).
FLAGS = {
    "hpar_alert_active",
    "hpar_step_bottleneck",
    "hpar_gpu_throttle_active",
    "hpar_agent_component_up",
    "hpar_alert_culprit",
}
#: worst/best-N panels whose order follows the rank here (values grow with it): they must pick the
#: highest (worst-N) or lowest (best-N) ranks. Elsewhere ranks tie, or a bare rate() (its scrape-timing
#: noise is larger than one rank's step) decides: any $topn of them will do.
ORDERED = {
    "Slowest $topn ranks: step time p99",
    "Step time vs job median: slowest $topn ranks",
    "Slowest $topn: p99 latency by rank",
    "Lowest $topn: bus bandwidth by rank",
    "Mean latency by rank: lowest $topn",
    "Host RSS: highest $topn",
    "Mean chunk time: slowest $topn",
}
GPU_UUID = "GPU-00000000-0000-4000-8000-{:012d}"


def job_id(rank: int) -> str:
    return "run-a" if rank < RANKS // 2 else "run-b"


def exposition(rank: int) -> str:
    """One rank's scrape: every catalogued metric, values growing with the rank (OpenMetrics, as the
    agent's endpoint serves it to Prometheus)."""
    f = Families([str(rank), str(rank % 2)])
    scale = 1.0 + rank / RANKS
    fams: list[Any] = []
    for spec in cat.METRICS:
        if spec.type == "info":
            info = {k: "0" for k in cat.INFO_LABELS}
            info.update(
                job_id=job_id(rank),
                host=f"node{rank // 8}",
                local_rank=str(rank % 8),
                gpu_index=str(rank % 8),
                gpu_uuid=GPU_UUID.format(rank),
            )
            fams.append(f.info(spec.name, info))
            continue
        fam = getattr(f, spec.type)(spec.name)
        for labels in itertools.product(*(DOMAIN[label] for label in spec.labels)):
            if spec.type == "histogram":  # higher ranks: more observations, and slower ones
                total = round(300 * scale)
                below = (0.5 - 0.4 * rank / RANKS, 0.98 - 0.5 * rank / RANKS, 1.0)
                buckets = [(str(le), float(round(total * b))) for le, b in zip(BUCKETS, below, strict=True)]
                fam.add_metric(f.labels(*labels), [*buckets, ("+Inf", float(total))], 50.0 * scale * scale)
            elif spec.name == "hpar_last_step_timestamp_seconds":
                f.add(fam, labels, time.time())
            elif spec.name in FLAGS:
                f.add(fam, labels, 1.0)
            else:
                f.add(fam, labels, 1000.0 * scale)
        fams.append(fam)

    class Collector:
        def collect(self) -> Iterator[Any]:
            return iter(fams)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromStack]:
    work = tmp_path_factory.mktemp("dash-scale")
    files = []
    for r in range(RANKS):
        path = work / f"rank{r}.om"
        path.write_text(exposition(r))
        files.append(str(path))
    for _attempt in range(5):  # a port of the range can be taken between the check and the bind
        base = free_base_port(RANKS)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "testkit.metrics_sim",
                "--base",
                str(base),
                "--targets",
                str(RANKS),
                "--interval",
                "1",
                "--scrapes",
                *files,
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() == "ready":
            break
        proc.wait(30)
    else:
        pytest.fail("the simulator could not bind its ports")
    stack = PromStack(work / "prom", [JOB])
    try:
        stack.set_targets(JOB, [f"127.0.0.1:{base + i}" for i in range(RANKS)])

        def scraped() -> bool:
            got = stack.query(f'count(count_over_time(hpar_steps_total{{job="{JOB}"}}[1m]) >= {SCRAPES})')
            return bool(got) and float(got[0]["value"][1]) == RANKS

        wait_for(scraped, 45, f"{SCRAPES} scrapes of {RANKS} ranks")
        yield stack
    finally:
        stack.close()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(15)


def _expand(expr: str, range_s: int, job_id_re: str = ".*") -> str:
    subs = {
        "$__rate_interval": RATE_INTERVAL,
        "$__interval": "1s",
        "$__range": f"{range_s}s",
        "$job_id": job_id_re,
        "$job": JOB,
        "$rank": ".*",
        "$pp_stage": ".*",
        "$pg": ".*",
        "$topn": str(TOPN),
    }
    for k in sorted(subs, key=len, reverse=True):
        expr = expr.replace(k, subs[k])
    assert "$" not in expr, expr
    return expr


def _panels() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.stem, p)
        for path in sorted((ROOT / "dashboards").glob("*.json"))
        for p in json.loads(path.read_text())["panels"]
        if p.get("targets")
    ]


def _ranks(result: list[dict[str, Any]]) -> set[int]:
    return {int(s["metric"]["rank"]) for s in result if "rank" in s["metric"]}


@pytest.mark.parametrize("board", ["overview", "collectives", "compile", "memory", "pipeline"])
def test_every_panel_draws_at_most_what_it_is_meant_to(sim: PromStack, board: str) -> None:
    """worst/best-N panels: <= $topn series over the whole range, and the right ranks; heatmaps: one
    row per rank; tables: at most one row per rank; other panels: a few series, whatever the rank
    count. Every target has data."""
    end = time.time()
    start, range_s = end - 6, 6
    empty, checked = [], 0
    for name, panel in _panels():
        if name != board:
            continue
        for t in panel["targets"]:
            expr = _expand(t["expr"], range_s)
            if t.get("instant"):
                result = sim.query(expr, at=end)
            else:
                result = sim.query_range(expr, start, end, step=1)
            checked += 1
            what = f"{panel['title']}: {expr}"
            if not result:
                empty.append(what)
                continue
            n = len(result)
            if "$topn" in t["expr"]:
                assert n <= TOPN, f"{n} series > $topn: {what}"
                ranks = _ranks(result)
                assert ranks, what
                if panel["title"] not in ORDERED:
                    continue
                if "bottomk($topn" in t["expr"]:
                    assert max(ranks) < RANKS // 2, f"best-N picked high ranks {sorted(ranks)}: {what}"
                else:
                    assert min(ranks) >= RANKS // 2, f"worst-N picked low ranks {sorted(ranks)}: {what}"
            elif panel["type"] == "heatmap":
                assert _ranks(result) == set(range(RANKS)) and n == RANKS, f"{n} rows: {what}"
            elif panel["type"] == "table":
                assert n <= RANKS * len(DOMAIN[cat.ALERT]), f"{n} rows: {what}"
                assert len(_ranks(result)) <= RANKS, what
            else:
                assert n <= 8, f"{n} series on a panel that is not per rank: {what}"
    assert checked
    assert empty == [], "targets without data:\n" + "\n".join(empty)


def test_job_id_selects_one_runs_ranks(sim: PromStack) -> None:
    """$job_id filters per-rank panels to one run's ranks (both runs share the scrape job)."""
    panels = {p["title"]: p for _, p in _panels()}
    (t,) = panels["Ranks: host and GPU"]["targets"]
    rows = sim.query(_expand(t["expr"], 6, job_id_re="run-b"))
    assert _ranks(rows) == set(range(RANKS // 2, RANKS))
    assert {r["metric"]["job_id"] for r in rows} == {"run-b"}
    row = next(r["metric"] for r in rows if r["metric"]["rank"] == "200")
    assert (row["host"], row["gpu_index"], row["gpu_uuid"]) == ("node25", "0", GPU_UUID.format(200))
    (t,) = panels["Step time by rank (heatmap)"]["targets"]
    assert _ranks(sim.query(_expand(t["expr"], 6, job_id_re="run-a"))) == set(range(RANKS // 2))


def test_annotations_mark_alerts_and_compiles(sim: PromStack) -> None:
    """The alert and compile annotations return one series per run and alert / trigger, not per rank."""
    dash = json.loads((ROOT / "dashboards" / "overview.json").read_text())
    end = time.time()
    for anno in dash["annotations"]["list"]:
        if "expr" not in anno:
            continue
        result = sim.query_range(_expand(anno["expr"], 6), end - 6, end, step=1)
        assert result, anno["name"]
        assert {s["metric"]["job_id"] for s in result} == {"run-a", "run-b"}, anno["name"]
        assert len(result) <= 2 * len(DOMAIN[cat.ALERT]), anno["name"]
