"""What a step anatomy concludes: one rank's bottleneck verdict from its phase shares (live), and the
job's one slow rank from every rank's anatomy digest (offline: the run directory's summaries)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from hpar_agent.thresholds import ANATOMY_DEFAULTS

DEFAULTS = {f"anatomy.{k}": v for k, v in ANATOMY_DEFAULTS.items()}  # overridable as thresholds


def bottleneck(
    shares: dict[str, float],
    *,
    straggler: bool = False,
    input_share: float = DEFAULTS["anatomy.input_share"],
    comm_share: float = DEFAULTS["anatomy.comm_share"],
) -> str:
    """The verdict from phase shares of step time. Input first: a rank whose loader is slow also
    arrives last at collectives (the Straggler signal), and the loader is the cause to name."""
    if shares.get("data_wait", 0.0) >= input_share:
        return "input-bound"
    if straggler:
        return "slow-rank"
    if shares.get("comm_exposed", 0.0) >= comm_share:
        return "communication-bound"
    return "compute-bound"


SLOW_EXCESS = 0.2  # a rank's compute past its stage peers' median by this share of its step is slow


def slow_rank_across(ranks: Iterable[tuple[Any, Any, dict[str, Any]]]) -> dict[str, Any] | None:
    """The job's one slow rank from per-rank anatomy digests ``(rank, pp_stage, digest)`` (offline:
    the run directory's summaries), with the numbers that name it, or None.

    Named by the ranks' own verdicts when they name one (the live cross-rank Straggler exchange, the
    rank most of them name); else by the phases: the rank whose compute (forward + backward +
    optimizer p50) exceeds its stage peers' median by more than ``SLOW_EXCESS`` of its step, while
    those peers wait for it (their exposed communication p50 at least half the excess, where measured).
    """
    ranks = list(ranks)
    named: dict[int, int] = {}
    for _r, _stage, d in ranks:
        ev = d.get("evidence") or {}
        if d.get("verdict") == "slow-rank" and isinstance(ev.get("slow_rank"), int):
            named[ev["slow_rank"]] = named.get(ev["slow_rank"], 0) + 1
    if named:
        rank = max(named, key=named.__getitem__)
        return {"rank": rank, "source": "straggler", "ranks_naming_it": named[rank], "ranks": len(ranks)}
    best: dict[str, Any] | None = None
    stages: dict[Any, list[tuple[Any, dict[str, Any]]]] = {}
    for r, stage, d in ranks:
        stages.setdefault(stage, []).append((r, d))
    for group in stages.values():
        busy = {}
        for r, d in group:
            p50 = d.get("phase_seconds_p50") or {}
            if "forward" in p50 and "backward" in p50:
                busy[r] = sum(p50.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
        for r, b in busy.items():
            others = [v for o, v in busy.items() if o != r]
            step = dict(group)[r].get("step_seconds_p50") or 0.0
            if not others or not step:
                continue
            excess = b - statistics.median(others)
            if excess <= SLOW_EXCESS * step:
                continue
            waits: list[float] = [
                float(w) for o, d in group
                if o != r and o in busy and (w := (d.get("phase_seconds_p50") or {}).get("comm_exposed")) is not None
            ]
            if waits and statistics.median(waits) < 0.5 * excess:
                continue
            if best is None or excess > best["compute_excess_s"]:
                best = {"rank": r, "source": "phases", "compute_excess_s": round(excess, 4),
                        "compute_share_excess": round(excess / step, 4),
                        "peers_comm_exposed_s": round(statistics.median(waits), 4) if waits else None}
    return best
