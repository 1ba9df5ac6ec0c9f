"""What one real Prometheus pays to scrape 64-256 hpar-agent ranks, with the shipped rules loaded.

A simulator serves N rank endpoints on loopback (one asyncio process, one listening port per rank) by
replaying real scrapes of the agent (the OpenMetrics text ``benchmarks/series_count.py --save-scrapes``
keeps, as Prometheus negotiates it): simulated rank i replays recorded rank ``i % len(scrapes)`` with its
``rank`` label rewritten to i (``pp_stage`` stays the recorded rank's stage). Values move every scrape
interval: counters and histogram buckets/sums/counts grow by the same factor (so buckets stay
cumulative), gauges jitter by +-1 % (0/1 state flags stay as recorded) and timestamps advance.

Then, for each (targets, interval) case, a real Prometheus (the Debian 2.42 binary) scrapes them with
``deploy/prometheus/rules/*.yml`` loaded (evaluation interval = scrape interval) for ``--duration``
seconds. Measured from Prometheus's own /metrics and query API: CPU (process_cpu_seconds_total, rate over
the second half of the run), memory (process_resident_memory_bytes, Go heap in use), head series,
samples appended per second, scrape durations, rule-group evaluation time
(prometheus_rule_group_last_duration_seconds) and missed evaluations; plus the simulator's own CPU.

    python -m benchmarks.scrape_sim --scrapes scrapes/ --cases 64:1 64:15 256:1 256:5 256:15 --json scrape-sim.json

Everything listens on 127.0.0.1 only. ``--serve`` is the simulator process (started by the cases).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from testkit.ports import free_base_port

ROOT = Path(__file__).resolve().parents[1]

RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
CONTENT_TYPE = b"application/openmetrics-text; version=1.0.0; charset=utf-8"
GROWTH_PER_TICK = 0.05  # counters grow 5 % of their recorded value per scrape interval


# ------------------------------------------------------------------------------------- templates
def _label_end(line: str) -> int:
    """Index just past the metric name and label set of an exposition sample line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or (0 <= space < brace):
        return space
    i, quoted = brace + 1, False
    while i < len(line):
        c = line[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i + 1
        i += 1
    raise ValueError(f"unterminated label set: {line[:80]}")


class Template:
    """One recorded scrape as a %-format string with the rank label and every value as placeholders."""

    def __init__(self, text: str) -> None:
        parts: list[str] = []
        self.values: list[float] = []
        self.kinds: list[str] = []  # counter | gauge | timestamp | static
        family_type = "untyped"
        for line in text.splitlines():
            if line.startswith("#"):
                if line.startswith("# TYPE "):
                    family_type = line.split()[3]
                parts.append(line.replace("%", "%%"))
                continue
            if not line.strip():
                continue
            end = _label_end(line)
            head, rest = line[:end], line[end:].strip()
            value, _, suffix = rest.partition(" ")
            head = head.replace("%", "%%")
            head = _sub_label(head, "rank", "%(rank)s")
            name = head.split("{", 1)[0]
            if family_type in ("counter", "histogram", "summary") and not name.endswith("_created"):
                kind = "counter"
            elif family_type == "gauge" and name.endswith("_timestamp_seconds"):
                kind = "timestamp"
            elif family_type == "gauge" and float(value) in (0.0, 1.0):
                kind = "static"  # a state flag (alert active, verdict, component up): stays 0 or 1
            elif family_type == "gauge":
                kind = "gauge"
            else:
                kind = "static"
            self.values.append(float(value))
            self.kinds.append(kind)
            n = len(self.values) - 1
            parts.append(f"{head} %(v{n})s" + (" " + suffix.replace("%", "%%") if suffix else ""))
        self.format = "\n".join(parts) + "\n"

    def render_values(self, tick: int, interval: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for n, (v, kind) in enumerate(zip(self.values, self.kinds, strict=True)):
            if kind == "counter" and v == int(v):  # counts and buckets stay integers (OpenMetrics)
                x = v + round(v * GROWTH_PER_TICK * tick)
            elif kind == "counter":
                x = v * (1.0 + GROWTH_PER_TICK * tick)
            elif kind == "gauge":
                x = v * (1.0 + 0.01 * (((tick * 7 + n) % 11) - 5) / 5)
            elif kind == "timestamp":
                x = v + tick * interval
            else:
                x = v
            out[f"v{n}"] = repr(x) if x != int(x) or abs(x) >= 1e15 else str(int(x)) + ".0"
        return out


def _sub_label(head: str, label: str, new: str) -> str:
    key = f'{label}="'
    for sep in ("{", ","):
        i = head.find(sep + key)
        if i >= 0:
            j = i + 1 + len(key)
            k = head.index('"', j)
            return head[:j] + new + head[k:]
    return head


# ------------------------------------------------------------------------------------- simulator
def serve(scrapes: list[Path], base: int, n: int, interval: float, use_gzip: bool) -> None:
    templates = [Template(p.read_text()) for p in scrapes]
    formats = [templates[i % len(templates)].format.replace("%(rank)s", str(i)) for i in range(n)]
    t0 = time.monotonic()
    cache: dict[tuple[int, int], dict[str, str]] = {}

    def body(i: int) -> bytes:
        tick = int((time.monotonic() - t0) / interval)
        key = (i % len(templates), tick)
        vals = cache.get(key)
        if vals is None:
            for old in [k for k in cache if k[1] < tick - 1]:
                del cache[old]
            vals = cache[key] = templates[key[0]].render_values(tick, interval)
        return (formats[i] % vals).encode()

    async def handle(i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                data = body(i)
                extra = b""
                if use_gzip and b"gzip" in head.lower():
                    data = gzip.compress(data, compresslevel=1)
                    extra = b"Content-Encoding: gzip\r\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE + b"\r\n" + extra
                    + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
                )  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        servers = []
        for i in range(n):
            servers.append(
                await asyncio.start_server(functools.partial(handle, i), "127.0.0.1", base + i, backlog=64)
            )
        print("ready", flush=True)
        await asyncio.Event().wait()

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(main())


# ------------------------------------------------------------------------------------- measuring


def prom_metrics(port: int) -> dict[str, float]:
    """Prometheus's own /metrics, the series this benchmark reads, flattened to name{labels} -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = (
        "process_cpu_seconds_total", "process_resident_memory_bytes", "go_memstats_heap_inuse_bytes",
        "prometheus_tsdb_head_series", "prometheus_tsdb_head_chunks", "prometheus_tsdb_head_samples_appended_total",
        "prometheus_rule_group_last_duration_seconds", "prometheus_rule_group_iterations_missed_total",
        "prometheus_rule_evaluation_failures_total", "prometheus_target_interval_length_seconds",
        "prometheus_rule_group_rules",
    )  # fmt: skip
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(want):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def query(port: int, expr: str) -> float | None:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        doc = json.loads(urllib.request.urlopen(url, timeout=20).read())
    except OSError:
        return None
    res = doc.get("data", {}).get("result") or []
    return float(res[0]["value"][1]) if res else None


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


def rule_query_stats(port: int) -> list[dict[str, Any]]:
    """Each recording rule's expression run once as an instant query with ``stats=all``: the samples it
    touches (load-independent work) and its evaluation time."""
    import yaml

    out = []
    for group in yaml.safe_load((RULES_DIR / "hpar-recording.yml").read_text())["groups"]:
        for rule in group["rules"]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(
                {"query": rule["expr"], "stats": "all"}
            )
            try:
                doc = json.loads(urllib.request.urlopen(url, timeout=60).read())["data"]
            except (OSError, KeyError, ValueError):
                continue
            out.append({
                "record": rule["record"],
                "series_out": len(doc.get("result") or ()),
                "samples": doc["stats"]["samples"]["totalQueryableSamples"],
                "eval_s": doc["stats"]["timings"]["evalTotalTime"],
            })  # fmt: skip
    return out


def run_case(
    targets: int,
    interval: float,
    duration: float,
    scrapes: list[Path],
    use_gzip: bool,
    rules_on: bool = True,
    nice: int = 0,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hpar-scrape-sim-"))
    for _attempt in range(5):  # a port of the range can still be taken between the check and the bind
        base = free_base_port(targets)
        sim = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scrape_sim", "--serve", "--base", str(base), "--targets", str(targets),
             "--interval", str(interval), "--scrapes", *map(str, scrapes), *(["--gzip"] if use_gzip else [])],
            stdout=subprocess.PIPE, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip
        assert sim.stdout is not None
        if sim.stdout.readline().strip() == "ready":
            break
        sim.wait(30)
    else:
        raise RuntimeError("the simulator could not bind its ports")
    prom_port = free_base_port(1)
    prom: subprocess.Popen[bytes] | None = None
    try:
        rules = work / "rules"
        shutil.copytree(RULES_DIR, rules)
        timeout = min(interval, 10.0)
        config = {
            "global": {"scrape_interval": f"{interval:g}s", "evaluation_interval": f"{interval:g}s"},
            "rule_files": [str(rules / "*.yml")] if rules_on else [],
            "scrape_configs": [
                {
                    "job_name": "hpar",
                    "scrape_timeout": f"{timeout:g}s",
                    "static_configs": [{"targets": [f"127.0.0.1:{base + i}" for i in range(targets)]}],
                }
            ],
        }
        (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w"),  # noqa: SIM115
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )  # fmt: skip
        t0 = time.time()
        load0 = os.getloadavg()[0]
        sim_cpu0 = proc_cpu_s(sim.pid)
        polls: list[dict[str, Any]] = []
        while time.time() - t0 < duration:
            time.sleep(min(5.0, max(0.5, duration / 20)))
            try:
                m = prom_metrics(prom_port)
            except OSError:
                continue
            polls.append({"t": time.time() - t0, "sim_cpu_s": proc_cpu_s(sim.pid) - sim_cpu0, **m})
        last = polls[-1]
        mid = min(polls, key=lambda p: abs(p["t"] - last["t"] / 2))
        span = last["t"] - mid["t"]
        groups = sorted(
            {k for p in polls for k in p if k.startswith("prometheus_rule_group_last_duration_seconds")}
        )
        job = '{job="hpar"}'
        rule_stats = rule_query_stats(prom_port) if rules_on else []
        result = {
            "targets": targets,
            "interval_s": interval,
            "rules": rules_on,
            "nice": nice,
            "loadavg_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
            "duration_s": round(last["t"], 1),
            "gzip": use_gzip,
            "up": query(prom_port, f"count(up{job} == 1)"),
            "down": query(prom_port, f"count(up{job} == 0)"),
            "samples_per_scrape_total": query(prom_port, f"sum(scrape_samples_scraped{job})"),
            "head_series": last.get("prometheus_tsdb_head_series"),
            "samples_per_s": round(
                (
                    _sum(last, "prometheus_tsdb_head_samples_appended_total")
                    - _sum(mid, "prometheus_tsdb_head_samples_appended_total")
                )
                / span
            ),
            "cpu_cores": round(
                (last["process_cpu_seconds_total"] - mid["process_cpu_seconds_total"]) / span, 3
            ),
            "rss_mb": round(last["process_resident_memory_bytes"] / 2**20, 1),
            "rss_max_mb": round(max(p["process_resident_memory_bytes"] for p in polls) / 2**20, 1),
            "heap_inuse_mb": round(last["go_memstats_heap_inuse_bytes"] / 2**20, 1),
            "scrape_duration_avg_s": query(
                prom_port, f"avg(avg_over_time(scrape_duration_seconds{job}[1m]))"
            ),
            "scrape_duration_max_s": query(
                prom_port, f"max(max_over_time(scrape_duration_seconds{job}[1m]))"
            ),
            "interval_p99_s": last.get(
                f'prometheus_target_interval_length_seconds{{interval="{interval:g}s",quantile="0.99"}}'
            ),
            "rule_groups": {
                g.split('rule_group="', 1)[1].split('"', 1)[0].rsplit(";", 1)[-1]: {
                    "last_s": last.get(g),
                    "max_s": max(p.get(g, 0.0) for p in polls),
                    "trajectory": [(round(p["t"]), p.get(g)) for p in polls if g in p],
                }
                for g in groups
            },
            "rule_iterations_missed": _sum(last, "prometheus_rule_group_iterations_missed_total"),
            "rule_evaluation_failures": _sum(last, "prometheus_rule_evaluation_failures_total"),
            "simulator_cpu_cores": round((last["sim_cpu_s"] - mid["sim_cpu_s"]) / span, 3),
            "recording_rules_samples": sum(r["samples"] for r in rule_stats),
            "recording_rules_query_eval_s": round(sum(r["eval_s"] for r in rule_stats), 4),
            "recording_rules_series_out": sum(r["series_out"] for r in rule_stats),
            "recording_rule_stats": rule_stats,
        }
        hs = result["head_series"] or 0
        result["rss_bytes_per_head_series"] = (
            round(last["process_resident_memory_bytes"] / hs) if hs else None
        )
        result["cpu_core_seconds_per_million_samples"] = (
            round(result["cpu_cores"] / result["samples_per_s"] * 1e6, 3) if result["samples_per_s"] else None
        )
        return result
    finally:
        for p in (prom, sim):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--scrapes", nargs="+", required=True, help="recorded scrapes (files, or a directory of *.om)"
    )
    p.add_argument("--cases", nargs="+", default=["64:1", "64:15", "256:1", "256:5", "256:15"],
                   help="TARGETS:INTERVAL_S[:norules] (norules: no rule files loaded)")  # fmt: skip
    p.add_argument("--duration", type=float, default=75.0, help="seconds per case")
    p.add_argument("--gzip", action="store_true", help="gzip responses when asked (prometheus_client does)")
    p.add_argument(
        "--nice", type=int, default=0,
        help="niceness of Prometheus and the simulator (negative needs root): on a shared, loaded machine a "
        "negative value gives them the CPU they ask for, as on a dedicated host; their CPU use is still measured",
    )  # fmt: skip
    p.add_argument("--json", help="write the results here")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--base", type=int, help=argparse.SUPPRESS)
    p.add_argument("--targets", type=int, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    files: list[Path] = []
    for s in a.scrapes:
        files += (
            sorted(Path(s).glob("*.om"), key=lambda f: (len(f.name), f.name))
            if Path(s).is_dir()
            else [Path(s)]
        )
    if a.serve:
        serve(files, a.base, a.targets, a.interval, a.gzip)
        return 0
    if not shutil.which("prometheus"):
        print("prometheus is not on the PATH (apt-get install prometheus)", file=sys.stderr)
        return 2
    import torch

    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "prometheus": subprocess.run(
            ["prometheus", "--version"], capture_output=True, text=True
        ).stdout.split("\n")[0],
        "command": "python -m benchmarks.scrape_sim " + " ".join(argv if argv is not None else sys.argv[1:]),
        "recorded_scrapes": [f.name for f in files],
        "recorded_series": [len(Template(f.read_text()).values) for f in files],
        "cases": [],
    }
    for case in a.cases:
        targets, interval, *flags = case.split(":")
        r = run_case(
            int(targets),
            float(interval),
            a.duration,
            files,
            a.gzip,
            rules_on="norules" not in flags,
            nice=a.nice,
        )
        results["cases"].append(r)
        rec = r["rule_groups"].get("hpar-recording", {})
        ms = 1e3
        print(
            f"{r['targets']:4d} targets @ {r['interval_s']:g}s{'' if r['rules'] else ' (no rules)'}: "
            f"up {r['up']}, head series {r['head_series']:.0f}, {r['samples_per_s']} samples/s, "
            f"CPU {r['cpu_cores']} cores, RSS {r['rss_mb']} MB (heap {r['heap_inuse_mb']}), "
            f"scrape avg {(r['scrape_duration_avg_s'] or 0) * ms:.1f} ms max {(r['scrape_duration_max_s'] or 0) * ms:.0f} ms; "
            f"recording group last {rec.get('last_s', 0) * ms:.1f} ms max {rec.get('max_s', 0) * ms:.0f} ms, "
            f"{r['recording_rules_samples']} samples/eval; missed {r['rule_iterations_missed']:.0f}; "
            f"simulator {r['simulator_cpu_cores']} cores",
            flush=True,
        )
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
