"""Where the job's time went, from the ranks' summaries (their ``goodput`` ledgers): the closing line of
``hpar-agent run`` and the report's stacked bar per rank. Shares are of the wall time of all ranks
together, so a rank that lost half its time to waiting weighs as much as its wall time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hpar_agent.catalogue import GOODPUT_CAUSES

#: How a cause reads in a sentence.
WORDS = {
    "startup": "startup",
    "compile": "compile",
    "data_wait": "data",
    "host": "host",
    "checkpoint": "checkpoint",
    "wait": "waiting for other ranks",
    "hang": "hang",
    "restart": "restarts",
    "recomputed": "recomputed steps",
    "other": "other",
}
#: Exposed communication no Straggler verdict told apart: the rank's own, or a wait for a slow rank.
UNDECIDED = "undecided"
LINE_PARTS = 4  # lost shares the closing line names
MIN_SHARE = 0.005  # smaller ones are left out of the line


def ledger(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    led = summary.get("components", {}).get("goodput")
    return led if isinstance(led, dict) and float(led.get("wall_seconds") or 0) > 0 else None


def parts(led: Mapping[str, Any]) -> dict[str, float]:
    """One rank's seconds by part: ``productive``, each cause, the waits split by culprit
    (``wait:<rank>``; ``wait`` what no culprit was named for), and ``undecided``."""
    out = {"productive": float(led.get("productive_seconds") or 0)}
    if (undecided := float(led.get("undecided_seconds") or 0)) > 1e-9:
        out[UNDECIDED] = undecided
    lost = led.get("lost_seconds") or {}
    by = {str(k): float(v) for k, v in (led.get("wait_by_culprit") or {}).items()}
    for cause in GOODPUT_CAUSES:
        secs = float(lost.get(cause) or 0)
        if cause == "wait":
            for culprit, s in by.items():
                out[f"wait:{culprit}"] = s
            secs -= sum(by.values())
        if secs > 1e-9:
            out[cause] = secs
    return out


def label(part: str) -> str:
    if part.startswith("wait:"):
        return f"waiting for rank {part[5:]}"
    if part == UNDECIDED:
        return "undecided (own communication or waiting: no Straggler verdict)"
    return WORDS.get(part, part)


def job_parts(summaries: Iterable[Mapping[str, Any]]) -> tuple[float, dict[str, float]]:
    """The wall seconds of every rank with a ledger, and their parts summed."""
    wall, total = 0.0, dict[str, float]()
    for s in summaries:
        led = ledger(s)
        if led is None:
            continue
        wall += float(led["wall_seconds"])
        for k, v in parts(led).items():
            total[k] = total.get(k, 0.0) + v
    return wall, total


def closing_line(summaries: Iterable[Mapping[str, Any]]) -> str | None:
    """``goodput 71 %: lost waiting for rank 2 18 %, compile 6 %, data 3 %`` over the job's ranks, or
    None when no rank kept a ledger. Where the ranks ended with exposed communication undecided (no
    Straggler verdict), the goodput is the range it leaves: ``goodput 20-75 % (55 % undecided: ...)``."""
    wall, total = job_parts(summaries)
    if wall <= 0:
        return None
    lost = sorted(
        ((v / wall, k) for k, v in total.items() if k not in ("productive", UNDECIDED)), reverse=True
    )
    named = [
        f"{label(k)} {share:.0%}".replace("%", " %") for share, k in lost[:LINE_PARTS] if share >= MIN_SHARE
    ]
    low, open_ = total.get("productive", 0.0) / wall, total.get(UNDECIDED, 0.0) / wall
    lo, hi = f"{100 * low:.0f}", f"{100 * (low + open_):.0f}"
    head = f"goodput {lo} %"
    if hi != lo:  # a range only where the undecided share moves the rounded figure
        head = (
            f"goodput {lo}-{hi} % ({100 * open_:.0f} % exposed communication undecided: its own or a "
            "wait for a slow rank, the Straggler detector had not judged)"
        )
    return f"{head}: lost {', '.join(named)}" if named else head


def figure(summaries: Mapping[int, Mapping[str, Any]]) -> Any:
    """A stacked bar per rank of its seconds by part, or None without ledgers."""
    rows = {r: parts(led) for r, s in sorted(summaries.items()) if (led := ledger(s)) is not None}
    if not rows:
        return None
    import plotly.graph_objects as go

    keys = ["productive", *sorted({k for p in rows.values() for k in p} - {"productive"})]
    fig = go.Figure()
    ranks = [str(r) for r in rows]
    for k in keys:
        fig.add_trace(go.Bar(name=label(k), x=ranks, y=[rows[r].get(k, 0.0) for r in rows]))
    fig.update_layout(
        barmode="stack",
        title="Where the time went (wall seconds since each rank's process started)",
        xaxis={"title": "rank", "type": "category"},
        yaxis={"title": "seconds"},
        height=360,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
    )
    return fig
