"""``/metrics`` render and scrape time, and how it grows with the series count.

(a) the one-rank run's real registry (the reference trainer in-process, every step traced):
``generate_latest`` (text and OpenMetrics) in-process and GET over HTTP as Prometheus asks (OpenMetrics,
gzip); (b) rank 0 of a torchrun gloo run at the multi-rank series count (8 ranks dp2 x tp2 x pp2,
BENCHMARKS.md's 265-series configuration, with >= 8 cores; else 2 ranks pp2), rendered in the rank
after its last step and scraped from this process; (c) the one-rank registry scaled k-fold (the
agent's collectors run k times, copies relabelled) up to the every-cap worst case of
``series_count.worst_case``: the slope is the cost per series, the last point the worst case measured
rather than extrapolated.

    python -m benchmarks.metrics_render --json render-cpu.json
    python -m benchmarks.metrics_render --device cuda --json render-gpu.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CONFIGS,
    GcWatch,
    before_detach,
    current_agent,
    finish,
    need_device,
    results,
    summarize,
    title,
)

RENDER_LAYOUTS = {
    8: ["--dp", "2", "--tp", "2", "--pp", "2"],  # BENCHMARKS.md "Series per rank": 265 per rank
    2: ["--dp", "1", "--tp", "1", "--pp", "2"],
}
RENDER_TRAINER = ["--schedule", "1f1b", "--compile", "aot_eager", "--layers", "4", "--dim", "64", "--heads", "4",
                  "--seq-len", "32", "--global-batch", "16", "--steps", "10", "--log-every", "1000",
                  "--device", "cpu"]  # fmt: skip
PROM_HEADERS = {  # what Prometheus 2.x sends
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}


def count_series(text: str) -> dict[str, Any]:
    from benchmarks.series_count import count_series as count

    return count(text)


def render_direct(registry: Any, n: int) -> dict[str, Any]:
    """Series in the registry and the time of ``generate_latest`` (text 0.0.4 and OpenMetrics), in this thread."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    text = generate_latest(registry).decode()
    counted = count_series(text)
    out: dict[str, Any] = {"series": counted["total"], "by_metric": counted["by_metric"], "text_bytes": len(text)}
    for key, fn in (("text", generate_latest), ("openmetrics", generate_openmetrics)):
        fn(registry)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            body = fn(registry)
            times.append(time.perf_counter() - t0)
        out[f"direct_{key}_ms"] = summarize(times, 1e3)
        out[f"{key}_bytes"] = len(body)
    out["openmetrics_gzip_bytes"] = len(gzip.compress(generate_openmetrics(registry)))
    return out


def http_bench(url: str, n: int) -> dict[str, Any]:
    """Client-side time of GET /metrics: as Prometheus asks (OpenMetrics, gzip) and plain text."""
    out: dict[str, Any] = {}
    for key, headers in (("prometheus", PROM_HEADERS), ("plain", {})):
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).read()
            times.append(time.perf_counter() - t0)
        out[f"{key}_ms"] = summarize(times, 1e3)
    return out


def settle(agent: Any) -> None:
    """Wait until the agent thread has drained every step and read the flight recorder in full once
    after the last step (full reads happen once per ``fr_interval``), so the registry is complete."""
    cfg = agent.config
    time.sleep(getattr(cfg, "fr_interval", 0.0) + 2 * cfg.interval)
    steps = agent.component("steps")
    deadline = time.time() + 10
    while steps is not None and steps.total < steps.count and time.time() < deadline:
        time.sleep(0.1)


def measure_one_rank(cfg: dict[str, Any], work: str, steps: int, n: int) -> dict[str, Any]:
    """The reference trainer in-process (world size 1, ``overhead.run_inprocess``'s "on" arm, every step
    traced); after its last step, before detach: the registry rendered directly, scaled k-fold up to the
    every-cap worst case, and scraped over HTTP."""
    from benchmarks.overhead import arm_env, run_inprocess
    from benchmarks.series_count import worst_case

    render: dict[str, Any] = {}

    def at_end() -> None:
        agent = current_agent()
        if agent is None:
            return
        render.update(render_direct(agent.registry, n))
        worst = sum(worst_case(render["by_metric"]).values())
        render["scaled"] = render_scaled(agent.registry, render["series"], worst, n)
        if agent.metrics_url:
            render["http"] = http_bench(agent.metrics_url, n)
        trace = getattr(agent, "tracing", None)
        render["tracing"] = trace.summary() if trace is not None else None

    env = arm_env("on", os.path.join(work, "one-rank"), "comp-render1")
    env["HPAR_TRACE_EVERY"] = "1"
    args = [*cfg["trainer"], "--steps", str(steps), "--log-every", "100000", "--out", os.path.join(work, "one-rank.json")]
    with before_detach(at_end):
        run_inprocess("on", args, env)
    if not render:
        raise RuntimeError("the trainer ended without a started agent")
    return render


def child_render(work: str, argv: list[str]) -> int:
    """torchrun entry of every rank: the trainer; rank 0 times its render after the last step and waits
    (bounded) while the parent scrapes it from outside."""
    from hpar_trainer.train import main as train_main

    def at_end() -> None:
        agent = current_agent()
        if agent is None or agent.topology.rank != 0:
            return
        settle(agent)
        d = render_direct(agent.registry, int(os.environ.get("COMPONENTS_RENDER_N", "200")))
        d["url"] = agent.metrics_url
        Path(work, "render-direct.json.tmp").write_text(json.dumps(d))
        os.replace(Path(work, "render-direct.json.tmp"), Path(work, "render-direct.json"))
        deadline = time.time() + 300
        while time.time() < deadline and not Path(work, "render-done").exists():
            time.sleep(0.05)

    with before_detach(at_end):
        return train_main(argv)


def measure_render(work: str, nproc: int, n: int, timeout: float) -> dict[str, Any]:
    """Rank 0 of a torchrun gloo run: direct render (in the rank) and client-side HTTP scrapes (here)."""
    from benchmarks.series_count import worst_case

    rdir = Path(work, f"render{nproc}")
    rdir.mkdir(parents=True, exist_ok=True)
    args = [*RENDER_LAYOUTS[nproc], *RENDER_TRAINER]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HPAR_RUN_DIR": str(rdir),
           "HPAR_JOB_ID": f"comp-render{nproc}", "HPAR_METRICS_PORT": "0", "HPAR_METRICS_ADDR": "127.0.0.1",
           "COMPONENTS_RENDER_N": str(n)}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "benchmarks.metrics_render", "--child", str(rdir), "--", *args]  # fmt: skip
    t0 = time.perf_counter()
    with open(rdir / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            ready = rdir / "render-direct.json"
            while not ready.exists():
                if proc.poll() is not None or time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"render run ended before rank 0 was ready:\n{(rdir / 'torchrun.log').read_text()[-3000:]}")
                time.sleep(0.2)
            direct = json.loads(ready.read_text())
            url = direct.pop("url")
            http = http_bench(url, n) if url else {}
            scrape = urllib.request.urlopen(url, timeout=10).read().decode() if url else ""
        except BaseException:
            proc.terminate()  # torchrun passes SIGTERM on to the ranks
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            Path(rdir, "render-done").write_text("")
        rc = proc.wait(timeout)
    observed = count_series(scrape)["by_metric"] if scrape else direct["by_metric"]
    worst = worst_case(observed)
    return {"nproc": nproc, "trainer_args": args, "trainer_rc": rc, "run_s": time.perf_counter() - t0,
            **direct, "http": http, "worst_case_series": sum(worst.values())}  # fmt: skip


class ScaledRegistry:
    """The agent's registry ``k`` times over: ``collect()`` runs the agent's collectors ``k`` times and
    relabels copy ``i``'s samples with ``rank="<rank>x<i>"``, so every family carries ``k`` times the
    series (the label-value growth the caps allow), built and formatted by the real code paths."""

    def __init__(self, registry: Any, k: int) -> None:
        self.registry, self.k = registry, k

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric

        fams: dict[str, Any] = {}
        for i in range(self.k):
            for fam in self.registry.collect():
                out = fams.get(fam.name)
                if out is None:
                    out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    out.samples.append(smp._replace(labels={**smp.labels, "rank": f"{smp.labels.get('rank', '')}x{i}"}))
        yield from fams.values()


def render_scaled(registry: Any, series: int, worst: int, n: int) -> dict[str, Any]:
    """Render time against series count, in one process: the registry scaled 1x, 8x and up to the
    every-cap worst case; the slope is the cost per series, the last point the worst case measured."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    ks = sorted({1, 8, max(1, -(-worst // max(1, series)))})
    points = []
    for k in ks:
        reg = ScaledRegistry(registry, k)
        reps = max(10, n // k)
        point: dict[str, Any] = {"k": k, "series": series * k, "reps": reps}
        for key, fn in (("text", generate_latest), ("openmetrics", generate_openmetrics)):
            fn(reg)
            times = []
            with GcWatch() as gcw:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(reg)
                    times.append(time.perf_counter() - t0)
            point[f"{key}_ms"] = summarize(times, 1e3)
            point[f"{key}_gc_ms_per_render"] = sum(e - b for b, e, _g in gcw.pauses) * 1e3 / reps
        points.append(point)
    out: dict[str, Any] = {"worst_case_series": worst, "points": points}
    lo, hi = points[0], points[-1]
    for key in ("text", "openmetrics"):
        if hi["series"] > lo["series"]:
            slope = (hi[f"{key}_ms"]["median"] - lo[f"{key}_ms"]["median"]) / (hi["series"] - lo["series"])
            out[f"{key}_us_per_series"] = slope * 1e3
        out[f"{key}_worst_ms"] = hi[f"{key}_ms"]["median"]
    return out


def print_report(r: dict[str, Any]) -> None:
    print(title(r, "/metrics render"))
    print("3. /metrics render (median / p99 ms):")
    for key in ("one_rank", "multi_rank"):
        p = r["render"].get(key)
        if not p:
            continue
        where = "1-rank in-process run" if key == "one_rank" else f"rank 0 of {p['nproc']}-rank gloo run"
        http = p.get("http", {})
        hp = http.get("prometheus_ms", {})
        hpl = http.get("plain_ms", {})
        print(f"   {where}: {p['series']} series, {p['text_bytes']} B text; direct text "
              f"{p['direct_text_ms']['median']:.2f}/{p['direct_text_ms']['p99']:.2f}, OpenMetrics "
              f"{p['direct_openmetrics_ms']['median']:.2f}/{p['direct_openmetrics_ms']['p99']:.2f}; HTTP GET "
              f"(OpenMetrics+gzip) {hp.get('median', float('nan')):.2f}/{hp.get('p99', float('nan')):.2f}, "
              f"plain {hpl.get('median', float('nan')):.2f}/{hpl.get('p99', float('nan')):.2f}")  # fmt: skip
    sc = (r["render"].get("one_rank") or {}).get("scaled")
    if sc:
        pts = "; ".join(f"{p['series']} series {p['text_ms']['median']:.1f} / {p['openmetrics_ms']['median']:.1f} ms "
                        f"(GC {p['text_gc_ms_per_render']:.1f} / {p['openmetrics_gc_ms_per_render']:.1f})"
                        for p in sc["points"])  # fmt: skip
        print(f"   registry scaled k-fold (text / OpenMetrics, median): {pts}")
        print(f"   -> {sc.get('text_us_per_series', float('nan')):.2f} / {sc.get('openmetrics_us_per_series', float('nan')):.2f} "
              f"us per series; at the every-cap worst case ({sc['worst_case_series']} series): "
              f"{sc['text_worst_ms']:.1f} / {sc['openmetrics_worst_ms']:.1f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--runs", default="one,multi", help="comma-separated subset: one (in-process), multi (torchrun)")
    ap.add_argument("--steps", type=int, default=40, help="steps of the one-rank run")
    ap.add_argument("--render-n", type=int, default=200, help="renders / scrapes timed per format")
    ap.add_argument("--render-nproc", type=int, choices=(2, 8), default=0,
                    help="ranks of the multi-rank run (default 8 with >= 8 cores, else 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the multi-rank run")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    cfg = CONFIGS[a.device]
    runs = {p.strip() for p in a.runs.split(",") if p.strip()}
    work = tempfile.mkdtemp(prefix="hpar-render-")
    r = results("metrics_render", a.device, argv, trainer_args=cfg["trainer"])
    r["render"] = {}
    if "one" in runs:
        r["render"]["one_rank"] = measure_one_rank(cfg, work, a.steps, a.render_n)
    if "multi" in runs:
        nproc = a.render_nproc or (8 if (os.cpu_count() or 1) >= 8 else 2)
        r["render"]["multi_rank"] = measure_render(work, nproc, a.render_n, a.timeout)
    finish(r, a.json)
    print_report(r)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # a torchrun rank of the multi-rank run
        rest = sys.argv[2:]
        sys.exit(child_render(rest[0], rest[2:] if len(rest) > 1 and rest[1] == "--" else rest[1:]))
    sys.exit(main())
