"""What the benchmarks share: the statistics of paired ratios, the twin design's estimator, a time
budget for pairs, CPU clocks of threads, ``/proc`` readers, the garbage collector's pauses, and the
header of every JSON result."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch


# --------------------------------------------------------------------------------------------- statistics
def p99(values: list[float]) -> float:
    """The 99th percentile, ``statistics.quantiles`` inclusive method: linear interpolation between the
    two order statistics around position 0.99 * (n - 1) (0-based), so never above the maximum."""
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Distribution-free interval of the median from order statistics: ``(x_(k), x_(n+1-k), coverage)``
    for the largest k whose coverage ``1 - 2 P(Binom(n, 1/2) <= k-1)`` is at least ``level``. With too
    few values (n <= 5 at 95 %) even [min, max] falls short: it is returned with its actual coverage,
    which the caller must report (a bootstrap over 3-9 values claims 95 % and covers 75-96 %)."""
    n = len(values)
    if n < 2:
        return (float("nan"), float("nan"), float("nan"))
    xs = sorted(values)

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def ratio_stats(ratios: list[float]) -> dict[str, Any]:
    """Median with its order-statistic interval and that interval's coverage, mean with its standard
    error, min and max of per-pair ratios (or differences)."""
    sem = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    lo, hi, cov = median_interval(ratios)
    return {
        "median": statistics.median(ratios),
        "ci_lo": lo,
        "ci_hi": hi,
        "ci_coverage": cov,
        "mean": statistics.fmean(ratios),
        "sem": sem,
        "min": min(ratios),
        "max": max(ratios),
        "pairs": len(ratios),
        "ratios": ratios,
    }


def paired(runs: list[dict[str, Any]], arms: Iterable[str], key: str = "step_s") -> dict[str, dict[str, Any]]:
    """Per arm other than off: ``ratio_stats`` of ``run[key]`` over off's of the same pair (``runs``:
    dicts with ``arm``, ``pair`` and ``key``; pair -1 is warm-up, left out)."""
    by_pair: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["pair"] >= 0 and r.get(key) is not None:
            by_pair.setdefault(r["pair"], {})[r["arm"]] = r[key]
    out = {}
    for arm in arms:
        ratios = [p[arm] / p["off"] for p in by_pair.values() if arm != "off" and arm in p and "off" in p]
        if ratios:
            out[arm] = ratio_stats(ratios)
    return out


def adjacent_aa(runs: list[dict[str, Any]], key: str = "step_s") -> list[float]:
    """The runs design's A/A: the ratio of every two consecutive runs of the same arm (the arm order
    reverses from pair to pair, so each pair boundary runs one arm twice in a row), later over earlier
    and earlier over later in turn, so that a drift of the machine cancels as in the on/off pairs. Runs
    of separate results (``source``, pooled by ``--merge``) are never compared."""
    out: list[float] = []
    for prev, cur in itertools.pairwise(runs):
        if (
            prev["pair"] >= 0
            and cur["arm"] == prev["arm"]
            and cur["pair"] != prev["pair"]
            and cur.get("source") == prev.get("source")
        ):
            r = cur[key] / prev[key]
            out.append(r if len(out) % 2 == 0 else 1.0 / r)
    return out


def describe(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """Count, median, p99, max and mean of samples (times ``scale``)."""
    if not values:
        return {}
    return {
        "n": len(values),
        "median": statistics.median(values) * scale,
        "p99": p99(values) * scale,
        "max": max(values) * scale,
        "mean": statistics.fmean(values) * scale,
    }


def stats_line(name: str, st: dict[str, Any], fmt: str = ".4f") -> str:
    """One line of ``ratio_stats``: median, interval (coverage), mean +- sem, min/max, pairs."""
    return (
        f"{name:10} {st['median']:{fmt}} {st['ci_lo']:{fmt}}-{st['ci_hi']:{fmt}} ({st['ci_coverage']:5.1%}) "
        f"mean {st['mean']:{fmt}} +- {st['sem']:{fmt}}, min {st['min']:{fmt}} max {st['max']:{fmt}}, "
        f"{st['pairs']} pairs"
    )


def pooled_p99(jobs: list[list[dict[str, Any]]], arms: list[str]) -> dict[str, float]:
    """Per arm other than off: the p99 of every kept step of its paired blocks (or runs) over off's, in
    each job; with two jobs (twin) the geometric mean of theirs."""
    out: dict[str, float] = {}
    per_job = []
    for job in jobs:
        kept: dict[str, list[float]] = {}
        for b in job:
            if b["pair"] >= 0:
                kept.setdefault(b["arm"], []).extend(b["times"])
        per_job.append(
            {
                arm: p99(kept[arm]) / p99(kept["off"])
                for arm in arms
                if arm != "off" and kept.get(arm) and kept.get("off")
            }
        )
    for arm in arms:
        vals = [r[arm] for r in per_job if arm in r]
        if vals and len(vals) == len(jobs):
            out[arm] = statistics.geometric_mean(vals)
    return out


def pooled_p99_report(
    jobs: list[list[dict[str, Any]]], arms: list[str], reps: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """``pooled_p99`` and, per arm, the 2.5th and 97.5th percentiles of it over the pairs resampled
    with replacement (a pair's blocks go together, as a stall they share does); no interval with fewer
    than 3 pairs."""
    out: dict[str, Any] = {"p99_pooled": pooled_p99(jobs, arms), "p99_pooled_interval": {}}
    pairs = sorted({b["pair"] for job in jobs for b in job if b["pair"] >= 0})
    if len(pairs) < 3:
        return out
    by_pair = [{p: [b for b in job if b["pair"] == p] for p in pairs} for job in jobs]
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(reps):
        pick = rng.choices(pairs, k=len(pairs))
        sample = [[{**b, "pair": i} for i, p in enumerate(pick) for b in job[p]] for job in by_pair]
        for arm, v in pooled_p99(sample, arms).items():
            draws.setdefault(arm, []).append(v)
    for arm, vals in draws.items():
        vals.sort()
        out["p99_pooled_interval"][arm] = (
            vals[int(0.025 * (len(vals) - 1))],
            vals[int(0.975 * (len(vals) - 1))],
        )
    return out


class PairBudget:
    """``--max-s`` for a design that runs pair after pair: no pair starts that would end past it at the
    pace of the slowest pair so far (a cut-off run loses the pair it was in)."""

    def __init__(self, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s, self.clock = max_s, clock
        self.t0 = clock()  # the budget counts from here (warm-up included)
        self.pair_t0: float | None = None
        self.slowest = 0.0

    def pair_starts(self) -> bool:
        """A pair is about to start: whether it may (the first one always does)."""
        t = self.clock()
        if self.pair_t0 is not None:
            self.slowest = max(self.slowest, t - self.pair_t0)
            if self.max_s and t - self.t0 + self.slowest > self.max_s:
                print(
                    f"--max-s {self.max_s:g}: another pair ({self.slowest:.0f} s) would end past it; stopping",
                    flush=True,
                )
                return False
        self.pair_t0 = t
        return True

    def left_s(self) -> float:
        return self.max_s - (self.clock() - self.t0) if self.max_s else math.inf


# --------------------------------------------------------------------------------------------- environment
@contextlib.contextmanager
def patched_env(env: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------- CPU clocks
class ThreadClocks:
    """CPU time of a set of Python threads, each read through its own CPU clock
    (``pthread_getcpuclockid``): what they ran, however loaded the machine is. A thread that has ended
    keeps the last value read."""

    def __init__(self, threads: Iterable[threading.Thread]) -> None:
        self.clocks: dict[str, int] = {}
        self.last: dict[str, float] = {}
        for t in threads:
            if t.ident is not None and t.is_alive():
                with contextlib.suppress(OSError, AttributeError):
                    self.clocks[f"{t.name}#{t.native_id}"] = time.pthread_getcpuclockid(t.ident)

    def read(self) -> dict[str, float]:
        for name, clock in self.clocks.items():
            with contextlib.suppress(OSError):
                self.last[name] = time.clock_gettime(clock)
        return dict(self.last)

    def total(self) -> float:
        return sum(self.read().values())


def started_since(before: Iterable[threading.Thread]) -> list[threading.Thread]:
    """The Python threads alive now that were not in ``before`` (what an attach started)."""
    seen = set(before)
    return [t for t in threading.enumerate() if t not in seen]


def thread_group(name: str) -> str:
    """What a ``ThreadClocks`` name is: the agent thread, the span exporter (the OTel SDK's batch
    processor), the metrics server, or the thread's own name."""
    name = name.split("#")[0]
    if name.startswith("OtelBatch"):
        return "span exporter"
    return {"hpar-agent": "agent thread", "hpar-metrics": "metrics server"}.get(name, name)


def time_parts(agent: Any, acc: dict[str, float]) -> None:
    """Wrap (on the instances) every component's ``poll``, ``on_step`` and ``end_pass`` and the tracer's
    ``export_step`` to add up the CPU time (``time.thread_time``) of the calling thread spent in each,
    under ``<component>.poll`` etc.; ``tracing.export_step`` is the span building."""

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.thread_time() - c0

        return wrapper

    for comp in agent.components:
        for method in ("poll", "on_step", "end_pass"):
            if hasattr(comp, method):
                setattr(comp, method, timed(f"{comp.name}.{method}", getattr(comp, method)))
    if getattr(agent, "tracing", None) is not None:
        agent.tracing.export_step = timed("tracing.export_step", agent.tracing.export_step)


# --------------------------------------------------------------------------------------------- twin
# The twin design of ``benchmarks.overhead`` (``--twin``): two copies of a job side by side, one on each
# half of the cores (``core_halves``). The parts that start no process: the slots' order, the estimator
# in which the halves' speeds cancel, the seconds two runs share, the gate that keeps the jobs' blocks
# in lockstep.
#: The two halves of the cores, and the keys of a slot's values on each.
HALVES = ("A", "B")


def slot_order(arms: list[str], pairs: int) -> list[tuple[str, str, int]]:
    """``(arm on half A, arm on half B, pair)`` of every slot: per pair and per arm X other than off,
    ``(X, off)`` and ``(off, X)``, which of them first alternating from pair to pair."""
    out = []
    for p in range(pairs):
        for arm in arms[1:]:
            slots = [(arm, "off", p), ("off", arm, p)]
            out += slots if p % 2 == 0 else slots[::-1]
    return out


def twin_estimates(slots: list[dict[str, Any]], key: str = "median_s") -> dict[str, dict[str, Any]]:
    """Per arm: ``ratio_stats`` over the pairs of ``sqrt(X_A / off_B * X_B / off_A)`` (``slots``: dicts
    with ``a``, ``b`` (arms), ``pair``, ``A``, ``B`` (dicts of values)); a pair missing a value has none."""
    halves: dict[tuple[str, int], dict[str, float]] = {}
    for s in slots:
        if s["A"].get(key) is None or s["B"].get(key) is None:
            continue
        if s["b"] == "off" and s["a"] != "off":
            halves.setdefault((s["a"], s["pair"]), {}).update(XA=s["A"][key], offB=s["B"][key])
        elif s["a"] == "off" and s["b"] != "off":
            halves.setdefault((s["b"], s["pair"]), {}).update(XB=s["B"][key], offA=s["A"][key])
    by_arm: dict[str, list[float]] = {}
    for (arm, _pair), v in halves.items():  # the slots' order: the arms' own
        if len(v) == 4:
            by_arm.setdefault(arm, []).append((v["XA"] / v["offB"] * v["XB"] / v["offA"]) ** 0.5)
    return {arm: ratio_stats(r) for arm, r in by_arm.items()}


def common_seconds(runs: list[dict[str, Any]], skip: int) -> list[list[float]]:
    """Each of two runs' step times after ``skip`` that lie within the seconds both ran steps in (all of
    its kept steps where that leaves fewer than 10)."""
    kept = [list(zip(r["step_starts"][skip:], r["step_times"][skip:], strict=True)) for r in runs]
    lo, hi = max(k[0][0] for k in kept), min(k[-1][0] + k[-1][1] for k in kept)
    out = []
    for k in kept:
        same = [d for s, d in k if s >= lo and s + d <= hi]
        out.append(same if len(same) >= 10 else [d for _, d in k])
    return out


def twin_gate(twin: dict[str, Any], i: int, stop: bool) -> bool:
    """Rank 0 of a twin job before its block ``i``: mark this job's arrival and wait for the other's,
    so both run block ``i`` over the same seconds; the leader's ``stop`` ends both. True: run it."""
    d = Path(twin["dir"])
    if stop:
        (d / f"stop.{i}").touch()
        return False
    (d / f"{twin['me']}.{i}").touch()
    deadline = time.monotonic() + 900
    while not (d / f"{twin['other']}.{i}").exists():
        if (d / f"stop.{i}").exists():
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"twin job {twin['other']} did not reach block {i}")
        time.sleep(0.002)
    return True


# --------------------------------------------------------------------------------------------- /proc
def core_halves(cpus: list[int]) -> tuple[list[int], list[int]]:
    """The CPUs split in two by physical core (hyperthread siblings stay together, as sysfs lists them),
    so that two jobs side by side share no core; the first half gets the odd core out."""
    groups: dict[str, list[int]] = {}
    for c in cpus:
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(c)
        groups.setdefault(key, []).append(c)
    cores = sorted(groups.values())
    if len(cores) < 2:
        raise SystemExit("--twin needs at least two physical cores")
    cut = (len(cores) + 1) // 2
    return sorted(c for g in cores[:cut] for c in g), sorted(c for g in cores[cut:] for c in g)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / VmSize (bytes) and Threads of this process (or ``pid``)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSize"):
            out[key] = int(rest.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(rest)
    return out


class GcWatch:
    """The garbage collector's pauses (any thread; a collection holds the GIL) while inside the block."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (start, end, generation), perf_counter
        self._t: float | None = None

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.pauses.append((self._t, time.perf_counter(), info["generation"]))
            self._t = None

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            d = [e - b for b, e, g in self.pauses if g == gen]
            if d:
                out[f"gen{gen}"] = {"count": len(d), "max_ms": max(d) * 1e3, "total_ms": sum(d) * 1e3}
        return out


# --------------------------------------------------------------------------------------------- results
def need_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a GPU")


def results(script: str, device: str, argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """The header of every benchmark's results: machine, torch, date, command, load."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": f"python -m benchmarks.{script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        **extra,
        "load_avg_start": os.getloadavg(),
        "t_start": time.time(),
    }


def finish(r: dict[str, Any], json_path: str | None) -> None:
    """Close the results (wall time, load) and write them to ``json_path`` when given."""
    r["load_avg_end"] = os.getloadavg()
    r["wall_s"] = time.time() - r["t_start"]
    if json_path:
        Path(json_path).write_text(json.dumps(r, indent=1, default=str))


def title(r: dict[str, Any], what: str) -> str:
    return (
        f"\n=== {what} ({r['device']}, torch {r['torch']}, {r['cpu_count']} cores, {r['wall_s']:.0f} s) ==="
    )


def write_rows(path: str, module: str, argv: list[str] | None, rows: list[dict[str, Any]]) -> None:
    """A table-printing benchmark's rows to ``path`` as JSON, with the date, machine and command."""
    import datetime
    import platform

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.platform(),
        "python": sys.version.split()[0],
        "command": f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=1)
