"""What a step anatomy concludes: one rank's bottleneck verdict from its phase shares (live), and the
job's one slow rank from every rank's anatomy digest (offline: the run directory's summaries)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from hpar_agent.thresholds import ANATOMY_DEFAULTS

DEFAULTS = {f"anatomy.{k}": v for k, v in ANATOMY_DEFAULTS.items()}  # overridable as thresholds
COMPUTE = ("forward", "backward", "optimizer")
#: the verdicts that name the job's slow rank (``evidence.slow_rank``): its own, and its victims'
NAMING = ("slow-rank", "waits-for-slow-rank")


class Verdict(NamedTuple):
    name: str  # one of catalogue.VERDICTS
    reason: str  # the numbers that gave it, one line


def bottleneck(
    shares: Mapping[str, float],
    *,
    straggler: bool = False,
    thresholds: Mapping[str, float] | None = None,
    pipeline_wait: float = 0.0,
    slow_peer: int | None = None,
    straggler_known: bool = True,
) -> Verdict:
    """The verdict from phase shares of step time (``thresholds``: ``ANATOMY_DEFAULTS``' keys).

    A cause is named when its phase reaches its threshold: input first (a rank whose loader is slow
    also arrives last at collectives, the Straggler signal, and the loader is the cause to name), then
    host work between steps, a slow rank, exposed communication. ``straggler``: the job has one slow
    rank, this one, or ``slow_peer`` where another: a rank that waits for it (in a collective, its
    gradient all-reduce or a tp all-reduce) is its victim, waits-for-slow-rank, never slow-rank itself.
    ``straggler_known``: the Straggler detector has judged; until then exposed communication may be a
    wait for a slow rank as well as the step's own, and the verdict it would give is unknown.
    ``pipeline_wait``: the share of step time this rank's training thread waited in pipeline p2p ops
    (its neighbours' activations or gradients); from ``pipeline_share`` on the rank is pipeline-bound,
    named before host (a stage's wait for its first activations is in the host phase) and before a
    slow rank (it is the one waiting). compute-bound is what is left only when the measured phases
    explain at least ``min_explained`` of the step: else the time is somewhere the phases do not see,
    and the verdict is unknown."""
    th = {**ANATOMY_DEFAULTS, **(thresholds or {})}

    def over(phase: str, key: str) -> str | None:
        share = shares.get(phase, 0.0)
        return (
            f"{phase} is {share:.0%} of the step (anatomy.{key} {th[key]:.0%})" if share >= th[key] else None
        )

    if why := over("data_wait", "input_share"):
        return Verdict("input-bound", why)
    if pipeline_wait >= th["pipeline_share"]:
        return Verdict(
            "pipeline-bound",
            f"waits for its pipeline neighbours (p2p) are {pipeline_wait:.0%} of the step "
            f"(anatomy.pipeline_share {th['pipeline_share']:.0%})",
        )
    if why := over("host", "host_share"):
        return Verdict("host-bound", why)
    if straggler and slow_peer is not None:
        return Verdict(
            "waits-for-slow-rank", f"waits for rank {slow_peer}, which the Straggler detector names slow"
        )
    if straggler:
        return Verdict("slow-rank", "the Straggler detector names this rank slow")
    if why := over("comm_exposed", "comm_share"):
        if not straggler_known:
            return Verdict(
                "unknown",
                f"{why}: its own communication or a wait for a slow rank, not known before the "
                "Straggler detector has judged (detectors off, or too few steps yet)",
            )
        return Verdict("communication-bound", why)
    explained = sum(shares.values())
    if explained < th["min_explained"]:
        return Verdict(
            "unknown",
            f"the phases explain {explained:.0%} of the step (anatomy.min_explained "
            f"{th['min_explained']:.0%})",
        )
    compute = sum(shares.get(p, 0.0) for p in COMPUTE)
    return Verdict(
        "compute-bound",
        f"forward, backward and optimizer are {compute:.0%} of the step; no other "
        "phase reaches its threshold",
    )


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
        if d.get("verdict") in NAMING and isinstance(ev.get("slow_rank"), int):
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
                float(w)
                for o, d in group
                if o != r
                and o in busy
                and (w := (d.get("phase_seconds_p50") or {}).get("comm_exposed")) is not None
            ]
            if waits and statistics.median(waits) < 0.5 * excess:
                continue
            if best is None or excess > best["compute_excess_s"]:
                best = {
                    "rank": r,
                    "source": "phases",
                    "compute_excess_s": round(excess, 4),
                    "compute_share_excess": round(excess / step, 4),
                    "peers_comm_exposed_s": round(statistics.median(waits), 4) if waits else None,
                }
    return best
