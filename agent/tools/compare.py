"""``hpar-agent compare RUN_A RUN_B``: two runs side by side, and a regression gate for CI.

RUN_A is the baseline. The gate judges distributions, not two numbers: the job's time of every step
(the slowest rank's, step by step, after ``WARMUP_STEPS``) from each rank's summary, which carries its
last 512 step times (or, from an agent that did not write them, the steps the traces files sampled),
compared with a block-bootstrap interval of the ratio of medians (``stats``). A change is a
regression when its interval excludes "no change" and it exceeds ``--max-regression``; inside the
noise it is "no significant change". ``--phase NAME`` judges a phase the same way, from the
``step.<phase>`` spans of the sampled traces.

The other rows (phases' p50s, collectives, memory, compile time, alerts, loss) are shown, not judged.

The machine's own load is the one cause the interval cannot see when it is flat within each run: the
summaries record how much of the time each training thread waited for a CPU, and a verdict is withheld
only when that difference could explain it, in its direction and size (``load_guard``): a quiet run
slower than a loaded baseline is judged.

The run files are streamed: memory grows with the steps kept, not with the size of the event logs and
traces.

Exit status (``EXIT_CODES``): 0 nothing judged regressed, 1 a regression, 2 bad usage or input, or
no verdict (a run without readable summaries, a rank's summary missing or unreadable, too few steps
to judge, a difference in the machine's load that could explain the verdict), 3 an error in the tool itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import traceback
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpar_agent import catalogue as cat
from hpar_agent.catalogue import STEP_PHASES
from hpar_agent.safefiles import not_a_directory
from hpar_agent.tools import units
from hpar_agent.tools.run_files import (
    Span,
    iter_events,
    iter_spans,
    num,
    rank_files,
    read_doc,
    read_summaries,
)
from hpar_agent.tools.safe_read import Budget
from hpar_agent.tools.stats import LEVEL, MIN_STEPS, Change, compare_medians
from hpar_agent.tools.summary_schema import TRAINER

#: The spans each judged series sums, a step at a time: a pipeline stage's forward and backward are its
#: microbatches' ``pp.forward`` / ``pp.backward`` spans (its steps have no ``step.forward``).
SERIES_SPANS: dict[str, tuple[str, ...]] = {
    "step": (cat.SPAN_STEP,),
    **{p: (cat.SPAN_STEP_PHASES[p],) for p in STEP_PHASES},
    "forward": (cat.SPAN_STEP_PHASES["forward"], cat.SPAN_PP_FORWARD),
    "backward": (cat.SPAN_STEP_PHASES["backward"], cat.SPAN_PP_BACKWARD),
}
#: Steps of the traces kept per rank, the last ones (the summaries carry 512): memory stays bounded
#: whatever the traces' size.
MAX_TRACED_STEPS = 4096
_UNTRACED = object()  # a step whose train.step span was not (yet) seen
#: The first steps compile and allocate: left out of the judged series.
WARMUP_STEPS = 2
#: A training thread waiting for a CPU more of the time than this: the machine is oversubscribed, and
#: equal waits no longer mean equal treatment (docs/tools.md).
OVERSUBSCRIBED = 0.25
EXIT_CODES = {
    0: "no significant regression",
    1: "regression",
    2: "bad usage or input, or no verdict (no readable summaries, a rank's summary missing or "
    "unreadable, too few steps to judge, a difference in the machine's load that could explain the verdict)",
    3: "error in the tool",
}
EPILOG = "exit status: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
DESCRIPTION = (
    "Two runs side by side (RUN_A is the baseline), and a gate on step time. Each run's step times "
    f"(every step's slowest rank, after the first {WARMUP_STEPS} steps, from the ranks' summaries) are compared "
    f"as distributions: the ratio of the medians with a {LEVEL:.0%} block-bootstrap interval. 'no significant change': "
    "the interval holds no change; 'slower' or 'faster': a significant change within the limit; "
    "'regressed': a significant slowdown past --max-regression; 'unknown' when the difference in the "
    "machine's load (how long the training threads waited for a CPU) could explain the verdict, or they "
    f"waited over {OVERSUBSCRIBED:.0%} of the time in a run whose load could explain it."
)


@dataclass
class Row:
    key: str  # what --phase names: step, data_wait, forward, ... (others are informational)
    label: str
    a: float | None
    b: float | None
    unit: str  # s | bytes | count | "" (a plain number)

    @property
    def change(self) -> float | None:
        """Relative change from A to B (0.12 = 12% more)."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / abs(self.a)


@dataclass
class Judged:
    """A checked figure: the comparison, or why there is none."""

    key: str
    label: str
    change: Change | None = None
    unknown: str = ""
    note: str = ""  # what the load guard saw when it let the verdict stand

    def verdict(self, limit: float) -> str:
        return "unknown" if self.unknown or self.change is None else self.change.verdict(limit)


@dataclass
class Digest:
    """What one run directory says, read once."""

    run_dir: Path
    summaries: dict[int, dict[str, Any]]
    problems: list[str] = field(default_factory=list)  # named, shown; the run can still be judged
    blockers: list[str] = field(default_factory=list)  # why the run cannot be judged at all
    figures: dict[str, Any] = field(default_factory=dict)
    budget: Budget = field(default_factory=Budget)  # what may still be read of this run
    wanted: tuple[str, ...] = ("step",)  # the series read from the traces, in one pass
    _traced: dict[str, dict[int, dict[int, float]]] | None = None
    _traces_budget: int = 0

    def traced(self, key: str) -> dict[int, dict[int, float]]:
        """``key``'s per-rank series from the traces, read on first use (most comparisons need none;
        the traces are streamed, keeping a number per step)."""
        if self._traced is None or key not in self._traced:
            if self._traced is None:
                self._traces_budget = self.budget.left  # a second read (a key not wanted) spends it again
            self.wanted = tuple(dict.fromkeys((*self.wanted, key)))
            budget = Budget(self._traces_budget)
            self._traced = traced_series(
                iter_spans(self.run_dir, self.problems, budget), {k: SERIES_SPANS[k] for k in self.wanted}
            )
            self.budget.left = budget.left
        return self._traced[key]


def _max(values: list[Any]) -> float | None:
    nums = [f for v in values if (f := num(v)) is not None]
    return max(nums) if nums else None


def _comps(s: dict[str, Any]) -> dict[str, Any]:
    return s.get("components") or {}


def load(run_dir: Path, checked: tuple[str, ...] = ("step",)) -> Digest:
    """Read a run's summaries, events and ``trainer.json``; name what cannot be read. Events are
    streamed (only the alerts are counted), so memory stays bounded whatever the files' size."""
    d = Digest(run_dir, {}, wanted=checked)
    d.summaries = read_summaries(run_dir, d.problems, d.budget)
    unreadable = sorted({r for r, _ in rank_files(run_dir, "summary", "json")} - set(d.summaries))
    if not d.summaries:
        d.blockers.append("no readable summary.rank<R>.json")
        return d
    if unreadable:
        d.blockers.append(
            f"the summaries of rank(s) {_ranks(unreadable)} are unreadable (see above): "
            "the slowest rank may be among them"
        )
    world = max(int((s.get("topology") or {}).get("world_size") or 0) for s in d.summaries.values())
    missing = [r for r in range(world) if r not in d.summaries and r not in unreadable]
    if missing:
        d.blockers.append(
            f"rank(s) {_ranks(missing)} of {world} wrote no summary: the slowest rank may be among them"
        )
    d.figures = figures(
        d.summaries, alert_counts(iter_events(run_dir, d.problems, d.budget)), _trainer(run_dir, d)
    )
    return d


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")


def _trainer(run_dir: Path, d: Digest) -> dict[str, Any]:
    path = run_dir / "trainer.json"
    return (read_doc(path, TRAINER, d.problems, d.budget) or {}) if path.exists() or path.is_symlink() else {}


def alert_counts(events: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many times each alert fired."""
    alerts: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("kind") == "alert" and e.get("state") == "firing":
            alerts[str(e.get("alert"))] += 1
    return dict(alerts)


def figures(
    summaries: dict[int, dict[str, Any]], alerts: dict[str, int], trainer: dict[str, Any]
) -> dict[str, Any]:
    """The job-level figures shown beside the judgement (slowest rank for times, highest for memory)."""
    comps = [_comps(s) for _, s in sorted(summaries.items())]
    anat = [c.get("anatomy") or {} for c in comps]
    collectives: dict[str, dict[str, float | None]] = {}
    for c in comps:
        for t in (c.get("collectives") or {}).get("table") or ():
            row = collectives.setdefault(f"{t['pg']}/{t['op']}", {"count": 0.0, "p50_s": None})
            row["count"] = (row["count"] or 0.0) + (num(t.get("count")) or 0.0)
            row["p50_s"] = _max([row["p50_s"], t.get("p50_s")])
    memory = [(c.get("memory") or {}).get("rss_bytes") for c in comps]
    memory += [
        v for c in comps for k, v in ((c.get("memory") or {}).get("allocator") or {}).items() if "peak" in k
    ]
    losses = [f for v in trainer.get("losses") or () if (f := num(v)) is not None]
    return {
        "ranks": len(summaries),
        "steps": _max([(c.get("steps") or {}).get("steps") for c in comps]),
        "step_p50": _max([a.get("step_seconds_p50") for a in anat])
        or _max([(c.get("steps") or {}).get("step_seconds_p50") for c in comps]),
        "phases": {p: _max([(a.get("phase_seconds_p50") or {}).get(p) for a in anat]) for p in STEP_PHASES},
        "verdicts": {
            r: (_comps(s).get("anatomy") or {}).get("verdict") for r, s in sorted(summaries.items())
        },
        "collectives": collectives,
        "memory_peak": _max(memory),
        "compile": _max([(c.get("compile") or {}).get("compile_seconds_total") for c in comps]),
        "alerts": alerts,
        "final_loss": losses[-1] if losses else None,
        "cpu_wait": _max_of_all([(c.get("steps") or {}).get("cpu_wait_share") for c in comps]),
    }


def _max_of_all(values: list[Any]) -> float | None:
    """The largest, or None unless every value is a number (an unmeasured rank may be the largest)."""
    nums = [f for v in values if (f := num(v)) is not None]
    return max(nums) if nums and len(nums) == len(values) else None


# ------------------------------------------------------------------------------- per-step series
def summary_steps(summaries: dict[int, dict[str, Any]]) -> dict[int, dict[int, float]] | None:
    """Per rank, {step: seconds} of the step times its summary carries (a rank without them is left
    out); None when no summary carries any (an older agent wrote them)."""
    out = {}
    for rank, s in summaries.items():
        st = _comps(s).get("steps") or {}
        values, first = st.get("recent_step_seconds"), st.get("recent_first_step")
        if values is not None and first is not None:
            out[rank] = {first + i: v for i, v in enumerate(values) if first + i >= WARMUP_STEPS and v > 0}
    return out or None


def traced_steps(spans: Iterable[Span], name: str) -> dict[int, dict[int, float]]:
    """Per rank, {step: seconds} of the spans called ``name`` in the steps of the traces' cadence."""
    return traced_series(spans, {name: (name,)})[name]


def traced_series(
    spans: Iterable[Span], wanted: Mapping[str, tuple[str, ...]]
) -> dict[str, dict[int, dict[int, float]]]:
    """For each key of ``wanted``, per rank, {step: seconds} summed over its span names, in the steps
    of the traces' cadence (``HPAR_TRACE_EVERY``, read off the steps kept as ``sampled``, whatever
    their own reason says): the slow and anomalous steps kept besides would bias a median, and so
    would dropping a step of the cadence that was kept as slow. One pass over ``spans`` (a stream:
    the traces can be GiBs), keeping each rank's last ``MAX_TRACED_STEPS`` steps, a few numbers each."""
    of_name: dict[str, list[str]] = defaultdict(list)
    for key, names in wanted.items():
        for n in names:
            of_name[n].append(key)
    # rank -> step -> [its train.step span's reason, {key: seconds}], in the order the steps came
    per_rank: dict[int, OrderedDict[int, list[Any]]] = defaultdict(OrderedDict)
    for s in spans:
        step, keys = s.attrs.get(cat.ATTR_STEP), of_name.get(s.name)
        if s.rank is None or not isinstance(step, int) or not (keys or s.name == cat.SPAN_STEP):
            continue
        steps = per_rank[s.rank]
        rec = steps.get(step)
        if rec is None:
            rec = steps[step] = [_UNTRACED, {}]
            if len(steps) > MAX_TRACED_STEPS:
                steps.popitem(last=False)
        if s.name == cat.SPAN_STEP:
            rec[0] = s.attrs.get(cat.ATTR_TRACE_REASON)
        if keys and step >= WARMUP_STEPS and s.end_ns > s.start_ns:
            for key in keys:
                rec[1][key] = rec[1].get(key, 0.0) + s.seconds
    sampled = (st for steps in per_rank.values() for st, (why, _) in steps.items() if why == "sampled")
    every = functools.reduce(math.gcd, sampled, 0)
    out: dict[str, dict[int, dict[int, float]]] = {key: {} for key in wanted}
    for rank, steps in per_rank.items():
        for step, (why, sums) in sorted(steps.items()):
            if why is _UNTRACED or not (step % every == 0 if every else why == "sampled"):
                continue
            for key, secs in sums.items():
                out[key].setdefault(rank, {})[step] = secs
    return out


def job_series(per_rank: dict[int, dict[int, float]], ranks: list[int]) -> tuple[np.ndarray, str]:
    """The slowest rank's time of every step all ``ranks`` have, in step order; or an empty array and
    the reason."""
    lacking = [r for r in ranks if not per_rank.get(r)]
    if not ranks:
        return np.empty(0), "no ranks"
    if lacking:
        return np.empty(0), f"none from rank(s) {', '.join(map(str, lacking[:16]))}"
    common = set.intersection(*(set(per_rank[r]) for r in ranks))
    if not common:
        return np.empty(0), "the ranks have no step in common"
    return np.array([max(per_rank[r][k] for r in ranks) for k in sorted(common)]), ""


def series(d: Digest, key: str) -> tuple[np.ndarray, str, str]:
    """(job series, where it came from, why it is empty) of ``step`` or a phase."""
    ranks = sorted(d.summaries)
    if key == "step":
        per_rank = summary_steps(d.summaries)
        if per_rank is not None:
            x, why = job_series(per_rank, ranks)
            return x, "the summaries' step times", why and f"{why} (the summaries' step times)"
        where = f"sampled {cat.SPAN_STEP} spans (the summaries carry no step times)"
    else:
        where = f"sampled {' or '.join(SERIES_SPANS[key])} spans"
    x, why = job_series(d.traced(key), ranks)
    return x, where, why and f"{why} ({where} in traces.rank<R>.jsonl)"


def judge(a: Digest, b: Digest, key: str, label: str) -> Judged:
    """``key``'s job series of both runs compared, or why they cannot be."""
    pair = []
    for run, d in (("A", a), ("B", b)):
        x, source, why = series(d, key)
        if why:
            return Judged(key, label, unknown=f"run {run}: {why}")
        if len(x) < MIN_STEPS:
            return Judged(
                key,
                label,
                unknown=f"run {run}: {len(x)} steps after warm-up from {source}; "
                f"an interval needs {MIN_STEPS}",
            )
        pair.append(x)
    return Judged(key, label, change=compare_medians(pair[0], pair[1]))


# ----------------------------------------------------------------------------------------- table
def rows(a: dict[str, Any], b: dict[str, Any], judged: list[Judged]) -> list[Row]:
    steps = next((j for j in judged if j.key == "step" and j.change is not None), None)
    if steps is not None and steps.change is not None:
        out = [
            Row(
                "step",
                "step time median (slowest rank each step)",
                steps.change.median_a,
                steps.change.median_b,
                "s",
            )
        ]
    else:
        out = [Row("step", "step time p50 (slowest rank)", a["step_p50"], b["step_p50"], "s")]
    for p in STEP_PHASES:
        if a["phases"].get(p) is not None or b["phases"].get(p) is not None:
            out.append(Row(p, f"  {p} p50 (slowest rank)", a["phases"].get(p), b["phases"].get(p), "s"))
    for key in sorted(set(a["collectives"]) | set(b["collectives"])):
        ca, cb = a["collectives"].get(key, {}), b["collectives"].get(key, {})
        out.append(
            Row(f"collective:{key}", f"collectives {key} count", ca.get("count"), cb.get("count"), "count")
        )
        if ca.get("p50_s") is not None or cb.get("p50_s") is not None:
            out.append(
                Row(f"collective_p50:{key}", f"collectives {key} p50", ca.get("p50_s"), cb.get("p50_s"), "s")
            )
    out.append(
        Row(
            "memory_peak",
            "memory peak (RSS / allocator, highest rank)",
            a["memory_peak"],
            b["memory_peak"],
            "bytes",
        )
    )
    out.append(Row("compile", "compile time (slowest rank)", a["compile"], b["compile"], "s"))
    for name in sorted(set(a["alerts"]) | set(b["alerts"])):
        out.append(
            Row(
                f"alert:{name}",
                f"alert {name} fired",
                a["alerts"].get(name, 0),
                b["alerts"].get(name, 0),
                "count",
            )
        )
    if a["final_loss"] is not None or b["final_loss"] is not None:
        out.append(Row("loss", "final loss", a["final_loss"], b["final_loss"], ""))
    if a["cpu_wait"] is not None or b["cpu_wait"] is not None:
        out.append(
            Row(
                "cpu_wait",
                "time waiting for a CPU (training thread, most-waiting rank)",
                a["cpu_wait"],
                b["cpu_wait"],
                "share",
            )
        )
    return out


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return units.seconds(v)
    if unit == "bytes":
        return units.size(v)
    if unit == "count":
        return f"{v:.0f}"
    if unit == "share":
        return f"{v:.1%}"
    return units.sig(v)


def fmt_change(r: Row) -> str:
    if r.unit == "share":
        return "-" if r.a is None or r.b is None else f"{(r.b - r.a) * 100:+.1f} pts"
    c = r.change
    if c is None:
        return "new" if not r.a and r.b else "-"
    return units.change(c)


def sentence(j: Judged, limit: float) -> str:
    """One line per checked figure: the verdict, the change and its interval."""
    c = j.change
    est = (
        ""
        if c is None
        else (
            f"{units.change(c.ratio - 1)} ({LEVEL:.0%} interval {units.change(c.low - 1)} .. "
            f"{units.change(c.high - 1)}; {c.n_a} and {c.n_b} steps)"
        )
    )
    if j.unknown or c is None:
        return f"UNKNOWN: {j.label}: {j.unknown}" + (f" (measured {est})" if est else "")
    verdict = c.verdict(limit)
    wide = (
        ""
        if verdict == "regressed" or c.high - 1 <= limit
        else (
            f"; the interval reaches past the {units.change(limit)} limit: a regression that large is not ruled out "
            "(more steps narrow the interval)"
        )
    )
    return (
        {
            "regressed": f"REGRESSION: {j.label} regressed by {est}, past the {units.change(limit)} limit",
            "slower": f"{j.label}: slower by {est}, within the {units.change(limit)} limit",
            "faster": f"{j.label}: faster by {est}",
            "no change": f"{j.label}: no significant change, {est}",
        }[verdict]
        + wide
        + (f" ({j.note})" if j.note else "")
    )


def verdict_lines(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> list[str]:
    """The two runs' bottleneck verdicts, and plainly which ranks' changed."""
    va, vb = a["verdicts"], b["verdicts"]
    if not any(va.values()) and not any(vb.values()):
        return []
    changed = [
        f"rank {r}: {va.get(r) or '-'} in {names[0]}, {vb.get(r) or '-'} in {names[1]}"
        for r in sorted(set(va) | set(vb))
        if va.get(r) != vb.get(r)
    ]
    if changed:
        return ["BOTTLENECK CHANGED: " + "; ".join(changed)]
    kinds = sorted({str(v) for v in va.values()})
    same = (
        f"{kinds[0]} on every rank" if len(kinds) == 1 else ", ".join(f"rank {r}: {v}" for r, v in va.items())
    )
    return [f"bottleneck: the same in both runs ({same})"]


@dataclass
class Result:
    a: Digest
    b: Digest
    table: list[Row]
    judged: list[Judged]
    limit: float

    @property
    def status(self) -> int:
        if self.a.blockers or self.b.blockers:
            return 2
        verdicts = [j.verdict(self.limit) for j in self.judged]
        return 1 if "regressed" in verdicts else 2 if "unknown" in verdicts else 0


def compare(run_a: Path, run_b: Path, checked: tuple[str, ...] = ("step",), limit: float = 0.05) -> Result:
    a, b = load(run_a, checked), load(run_b, checked)
    if a.blockers or b.blockers:  # no table either: a run's figures without some ranks would mislead
        return Result(a, b, [], [], limit)
    labels = {"step": "step time", **{p: p for p in STEP_PHASES}}
    judged = [judge(a, b, key, labels[key]) for key in checked]
    for j in judged:
        if not j.unknown and j.change is not None:
            j.unknown, j.note = load_guard(
                a.figures.get("cpu_wait"), b.figures.get("cpu_wait"), j.change, limit
            )
    return Result(a, b, rows(a.figures, b.figures, judged), judged, limit)


def _scaled(c: Change, factor: float) -> Change:
    """``c`` with B's steps divided by ``factor``: what it would read had the load not moved them."""
    return dataclasses.replace(c, ratio=c.ratio / factor, low=c.low / factor, high=c.high / factor)


def load_guard(wait_a: float | None, wait_b: float | None, c: Change, limit: float) -> tuple[str, str]:
    """(why no verdict, or ""; a note on the load, or "") for the change ``c`` between runs whose
    training threads waited for a CPU ``wait_a`` and ``wait_b`` of the time.

    A thread that wants to run but gets a CPU only 1 - w of the time takes 1 / (1 - w) as long, so the
    load alone moves B's steps by f = (1 - w_a) / (1 - w_b); how much of that reached the step time is
    unknown, between none and all of it. The program's own change lies between the measured one and the
    measured one divided by f, and the verdict (monotone in the change) is given when both ends get the
    same one: a quiet B slower than a loaded A is slower still once the load is taken out. A run past
    ``OVERSUBSCRIBED`` may have lost any amount to the load: only a verdict the load works against
    stands (B slower than a busier A; B faster than A when B was the busier). A shift within half the
    limit is noise of the guard's own. Nothing is said when either run did not measure its waits."""
    if wait_a is None or wait_b is None:
        return "", ""
    waits = f"the training threads waited for a CPU {wait_a:.0%} of the time in A and {wait_b:.0%} in B"
    verdict = c.verdict(limit)
    if max(wait_a, wait_b) > OVERSUBSCRIBED:
        against = (verdict == "regressed" and wait_a > wait_b and wait_b <= OVERSUBSCRIBED) or (
            verdict == "faster" and wait_b > wait_a and wait_a <= OVERSUBSCRIBED
        )
        if against:
            return "", f"{waits}: the load can only have hidden part of this change, not made it"
        return (
            f"{waits}: on a machine that busy step times follow its load more than the program; "
            "rerun both on a quiet machine",
            "",
        )
    factor = (1 - wait_a) / (1 - wait_b)
    if abs(factor - 1) <= limit / 2:
        return "", ""
    longer = "longer" if factor > 1 else "shorter"
    moved = f"the machine's load alone could make B's steps {units.change(abs(factor - 1))[1:]} {longer}"
    without = _scaled(c, factor)
    if without.verdict(limit) == verdict:
        return "", (
            f"{waits}: {moved}; without it the change would read {units.change(without.ratio - 1)}, "
            f"the same verdict"
        )
    return (
        f"{waits}: {moved}, and without it the change would read {units.change(without.ratio - 1)} "
        f"({without.verdict(limit)}); rerun both on a quiet machine",
        "",
    )


def render_text(res: Result) -> str:
    lines = []
    for name, d in (("A (baseline)", res.a), ("B", res.b)):
        f = d.figures
        ranks = len(d.summaries)
        lines.append(
            f"{name}: {d.run_dir} ({ranks} rank{'' if ranks == 1 else 's'} read, "
            f"{f.get('steps') or 0:.0f} steps)"
        )
    if res.table:
        cells = [["", "A", "B", "change"]] + [
            [
                r.label + (" *" if r.key in [j.key for j in res.judged] else ""),
                fmt(r.a, r.unit),
                fmt(r.b, r.unit),
                fmt_change(r),
            ]
            for r in res.table
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(4)]
        lines += [""] + [
            "  ".join(c[i].ljust(widths[i]) if i == 0 else c[i].rjust(widths[i]) for i in range(4))
            for c in cells
        ]
    if res.table:
        lines += ["", *verdict_lines(res.a.figures, res.b.figures)]
    notes = [f"{n} {p}" for n, d in (("A:", res.a), ("B:", res.b)) for p in d.problems]
    if notes:
        lines += ["", "unreadable input (named, left out):", *(f"  {n}" for n in notes)]
    lines.append("")
    for which, d in (("A", res.a), ("B", res.b)):
        lines += [f"UNKNOWN: run {which} ({d.run_dir}): {why}" for why in d.blockers]
    lines += [sentence(j, res.limit) for j in res.judged]
    lines.append(f"exit {res.status}: {EXIT_CODES[res.status].split(' (')[0]}")
    return "\n".join(lines)


def html_table(baseline: Path, this_run: Path, limit: float = 0.05) -> str:
    """The side-by-side table for ``hpar-agent report RUN --compare BASELINE`` (cells escaped)."""
    import html

    res = compare(baseline, this_run, limit=limit)
    body = "".join(
        f"<tr><td>{html.escape(r.label)}</td><td>{html.escape(fmt(r.a, r.unit))}</td>"
        f"<td>{html.escape(fmt(r.b, r.unit))}</td><td>{html.escape(fmt_change(r))}</td></tr>"
        for r in res.table
    )
    head = (
        f"<th></th><th>baseline: {html.escape(baseline.name)}</th><th>this run: {html.escape(this_run.name)}</th>"
        "<th>change from the baseline</th>"
    )
    said = [sentence(j, limit) for j in res.judged]
    if res.table:
        said += verdict_lines(res.a.figures, res.b.figures, ("the baseline", "this run"))
    said += [f"unknown: {n}: {w}" for n, d in (("baseline", res.a), ("this run", res.b)) for w in d.blockers]
    said += [f"{n}: {p}" for n, d in (("baseline", res.a), ("this run", res.b)) for p in d.problems]
    notes = "".join(f"<li>{html.escape(s)}</li>" for s in said)
    return (
        f'<table class="compare"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><ul>{notes}</ul>'
    )


def parse_threshold(text: str) -> float:
    """``5%`` or ``0.05``: a relative change."""
    text = text.strip()
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= value < float("inf"):
        raise ValueError("the threshold must be a finite number >= 0")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.epilog = EPILOG
    p.add_argument("run_a", metavar="RUN_A", help="the baseline run directory")
    p.add_argument("run_b", metavar="RUN_B", help="the run directory checked against it")
    p.add_argument(
        "--max-regression",
        default="5%",
        help="the smallest slowdown that fails the gate when it is significant (default 5%%)",
    )
    p.add_argument(
        "--phase",
        action="append",
        choices=STEP_PHASES,
        default=[],
        help="also judge this phase, from the traces' sampled steps (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        limit = parse_threshold(args.max_regression)
    except ValueError as exc:
        print(
            f"hpar-agent compare: error: bad --max-regression {args.max_regression!r}: {exc}", file=sys.stderr
        )
        return 2
    for d in (args.run_a, args.run_b):
        if why := not_a_directory(d):
            print(f"hpar-agent compare: error: {d}: {why}", file=sys.stderr)
            return 2
    try:
        res = compare(Path(args.run_a), Path(args.run_b), ("step", *dict.fromkeys(args.phase)), limit)
        print(render_text(res))
    except Exception:  # a bug here must not read as "regressed" (1) or "bad input" (2)
        traceback.print_exc()
        print(
            "hpar-agent compare: internal error (exit 3); please report it with the traceback",
            file=sys.stderr,
        )
        return 3
    return res.status


__all__ = [
    "EXIT_CODES",
    "Digest",
    "Judged",
    "Result",
    "Row",
    "compare",
    "html_table",
    "load",
    "parse_threshold",
    "run",
]
