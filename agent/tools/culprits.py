"""Who caused what went wrong in a run: the lines ``hpar-agent run`` ends with and the report shows.

Two sources, both in the run directory:
- every rank's event log: the firing (and ``updated``) events of cross-rank alerts carry
  ``details.culprits``, the ranks judged to be the cause (``details.culprit_gpu``: their GPU health
  against their peers'); the culprit's own Hang event carries its stack;
- every rank's state file (``rankstate``) and the exits ``hpar-agent run`` saw (``exits.ExitWatcher``):
  how each rank ended and when, so the first to fail is named, not the first to notice.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpar_agent import endings as endings_of
from hpar_agent import rankstate
from hpar_agent.detectors.waits import p2p_text
from hpar_agent.tools.exits import Exit, describe_status


@dataclass
class Culprits:
    """One alert's culprits over the whole job, as the ranks that raised it named them."""

    alert: str
    first_ts: float = 0.0
    culprits: set[int] = field(default_factory=set)
    raised_on: set[int] = field(default_factory=set)
    details: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its latest details
    unknown: list[str] = field(default_factory=list)


def alert_culprits(events: Iterable[Mapping[str, Any]]) -> dict[str, Culprits]:
    """alert -> its culprits, from ``alert`` events in time order (a rank's latest firing's details win)."""
    out: dict[str, Culprits] = {}
    for e in events:
        if e.get("kind") != "alert" or e.get("state") not in ("firing", "updated"):
            continue
        details = e.get("details")
        rank = e.get("rank")
        if not isinstance(details, dict) or not isinstance(rank, int) or "culprits" not in details:
            continue
        c = out.setdefault(str(e.get("alert")), Culprits(str(e.get("alert")), float(e.get("ts") or 0.0)))
        c.raised_on.add(rank)
        # a new firing replaces what the rank said at an earlier one (its stack then is not its stack
        # now); an update adds to the firing it updates
        c.details[rank] = {**(c.details.get(rank, {}) if e.get("state") == "updated" else {}), **details}
        named = [r for r in details.get("culprits") or () if isinstance(r, int)]
        c.culprits.update(named)
        why = details.get("culprit_unknown") or (details.get("note") if not named else None)
        if why and not named:
            c.unknown.append(str(why if isinstance(why, str) else "; ".join(map(str, why))))
    return out


def short(text: str, limit: int = 100) -> str:
    """An exception's message without the source location C++ puts in front of it, cut at ``limit``."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ", "", str(text))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def ranks_text(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    word = "rank" if len(rs) == 1 else "ranks"
    shown = ", ".join(map(str, rs[:16])) + (f" and {len(rs) - 16} more" if len(rs) > 16 else "")
    return f"{word} {shown}"


def _why(c: Culprits) -> str:
    """What the alert says of its culprits, from the most telling details a rank gave."""
    if c.alert == "Hang":
        own = next((d for r, d in c.details.items() if r in c.culprits and d.get("stack")), None)
        any_d = next((d for d in c.details.values() if d.get("culprits")), {})
        waits = any_d.get("waits") or []
        parts = []
        if any_d.get("kind") == "desync":
            sides = "; ".join(
                f"{ranks_text(rs)} in {side}" for side, rs in (any_d.get("sides") or {}).items()
            )
            parts.append(f"desync: {sides}")
        elif waits:
            mine = [w for w in waits if set(w.get("missing") or ()) & c.culprits] or waits
            w = next((w for w in mine if not w.get("p2p")), None)
            if w is not None:
                pg = str(w.get("pg", "")).split("@", 1)[0]
                waiting = w.get("waiting") or []
                parts.append(
                    f"not in {pg} {w.get('op') or 'collective'} #{w.get('seq')}, which "
                    f"{ranks_text(waiting)} {_wait(waiting)} in"
                )
            p2p = [w for w in mine if w.get("p2p")]
            if p2p:
                on = sorted({r for w in p2p for r in w.get("waiting") or ()})
                ops = "; ".join(f"{ranks_text(w.get('waiting') or [])}: {p2p_text(w)}" for w in p2p[:4])
                parts.append(f"{ranks_text(on)} {_wait(on)} for it point to point ({ops})")
        if own:
            parts.append(f"at {own['stack'][0]}")
        return "; ".join(parts)
    if c.alert == "RankGone":
        bits = []
        for d in c.details.values():
            for r, g in (d.get("ranks") or {}).items():
                how = (
                    short(g.get("ended") or "") or f"silent {g.get('silent_s')} s, process {g.get('process')}"
                )
                bits.append(f"rank {r} at step {g.get('last_step')}: {how}")
        return "; ".join(sorted(set(bits))[:4])
    if c.alert == "Straggler":
        lags = [
            v for d in c.details.values() for r, v in (d.get("lags") or {}).items() if int(r) in c.culprits
        ]
        staged = {r for d in c.details.values() for r in d.get("stage_changed") or ()}
        where = (
            "their pipeline neighbours wait for them: their own work a step (p2p waits out) grew past "
            "their baseline"
            if set(c.culprits) <= staged
            else "the others wait for them at every collective"
        )
        return f"{where} ({min(lags):.2f}-{max(lags):.2f} of wall time)" if lags else ""
    return {
        "ReplicaDivergence": "their parameters differ from the majority of their replicas",
        "CompileDivergence": "they compiled graphs their stage's majority did not",
        "CollectiveMismatch": "their collectives differ (op, size or dtype) from their peers'",
    }.get(c.alert, "")


def _gpu_lines(c: Culprits) -> list[str]:
    """Each culprit's GPU health against its peers' (``details.culprit_gpu``), as the rank that read the
    most peers' health saw it; none where no rank knew it (CPU hosts)."""
    out = []
    for r in sorted(c.culprits)[:8]:
        seen = [
            g[str(r)]
            for d in c.details.values()
            if isinstance(g := d.get("culprit_gpu"), dict) and isinstance(g.get(str(r)), dict)
        ]
        if seen:
            best = max(seen, key=lambda e: int((e.get("peers_median") or {}).get("ranks") or 0))
            out.append(str(best.get("line", "")))
    return [line for line in out if line]


def _could_not_tell(c: Culprits) -> str:
    """The raising ranks whose last word named nobody, and why: where a culprit is named by some ranks
    only (the others' view of the job did not reach it), the line says so rather than hide them."""
    silent = sorted(r for r, d in c.details.items() if not d.get("culprits"))
    if not silent:
        return ""
    why = next(
        (
            str(w if isinstance(w, str) else "; ".join(map(str, w)))
            for r in reversed(silent)
            if (w := c.details[r].get("culprit_unknown") or c.details[r].get("note"))
        ),
        "",
    )
    return f"; {ranks_text(silent)} could not tell{': ' + short(why) if why else ''}"


def _wait(ranks: list[int]) -> str:
    return "waits" if len(set(ranks)) == 1 else "wait"


def culprit_lines(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per cross-rank alert of the run: ``culprit: <ranks> (<alert>: why)``, or why unknown. A
    rank a hang's verdict calls a victim (it only waited) is no other alert's culprit: its ending (a
    timeout, a closed connection) was the hang's consequence."""
    lines = []
    found = alert_culprits(events)
    hang = found.get("Hang")
    waited = (
        {r for d in hang.details.values() for r in d.get("victims") or () if isinstance(r, int)}
        - hang.culprits
        if hang is not None and hang.culprits
        else set()
    )
    for name, c in sorted(found.items(), key=lambda kv: (kv[1].first_ts, kv[0])):  # causes first
        if name != "Hang" and waited & c.culprits:
            c.culprits -= waited
            if not c.culprits:
                continue  # it named only the hang's victims: the hang's line says the incident
        if c.culprits:
            why = _why(c)
            lines.append(
                f"  culprit: {ranks_text(c.culprits)} ({name}{': ' + why if why else ''}; "
                f"raised on {ranks_text(c.raised_on)}{_could_not_tell(c)})"
            )
            lines += [f"    {text}" for text in _gpu_lines(c)]
        else:
            why = c.unknown[-1] if c.unknown else "no rank named one"
            lines.append(f"  {name} on {ranks_text(c.raised_on)}: culprit unknown ({why})")
    return lines


@dataclass
class Ending:
    """How one rank ended: ``failed`` unless it exited cleanly (or is still running)."""

    rank: int
    world: int
    how: str
    step: int
    t: float | None
    failed: bool
    #: what its ending says of the incident (``endings``): "communication" (a timeout, a closed or reset
    #: connection, an abort), "signal" (one a launcher sends the ranks still running), "" (its own)
    cause: str = ""
    #: the exception it raised where that was its own (not a communication failure), else ""
    error: str = ""


def endings(run_dir: Path, exits: Mapping[int, Exit] | None = None) -> list[Ending]:
    """Every rank with a state file under ``run_dir``, how it ended, in time order (unknown times last)."""
    exits = exits or {}
    out = []
    for path in sorted(glob.glob(os.path.join(str(run_dir), "state.rank*"))):
        rec = rankstate.read(path)
        if rec is None:
            continue
        ex = exits.get(rec.rank)
        seen = describe_status(ex.status) if ex is not None else ""
        proc = rankstate.proc_state(rec.pid, rec.ticks or None, rec.host)
        if rec.end == "running" and proc in ("running", "stopped") and ex is None:
            continue  # still there (stopped, or outliving the launcher)
        clean = rec.end == "exited" and (ex is None or ex.status is None or seen == "exit code 0")
        if rec.end in ("exception", "signal"):
            how = short(rec.text) + (f" ({seen})" if seen and rec.end == "exception" else "")
        elif rec.end == "exited":
            how = seen or "exited"
        elif seen:
            how = seen
        elif proc == "":
            how = "no end recorded (on another host: killed, or still running)"
        else:
            how = "died without exiting (SIGKILL, the kernel's OOM killer or a crash in native code)"
        t = ex.t if ex is not None else (rec.end_ns / 1e9 if rec.end_ns else None)
        said = f"{rec.text if rec.end in ('exception', 'signal') else ''} {seen}"
        cause = (
            "communication"
            if rec.end == "exception" and endings_of.communication_failure(rec.text)
            else "signal"
            if endings_of.launcher_signal(said)
            else ""
        )
        own = rec.end == "exception" and not endings_of.communication_failure(rec.text)
        out.append(
            Ending(rec.rank, rec.world, how, rec.steps, t, not clean, cause, short(rec.text) if own else "")
        )
    return sorted(out, key=lambda e: (e.t is None, e.t or 0.0, e.rank))


def failure_lines(ended: Iterable[Ending], blamed: bool = False, forwarded: bool = False) -> list[str]:
    """The first rank to end abnormally, and then the others that failed, when any rank did. It is the
    culprit (``culprit: rank R, the first to end ...``) unless an alert named one already (``blamed``: in a
    hang the waiting ranks time out first, and the rank they waited for is the cause), or its ending is
    a consequence of a fault elsewhere (a communication timeout or abort, a closed connection; a
    launcher's signal when ``hpar-agent run`` forwarded one to every rank, ``forwarded``): then the
    culprit is unknown, and the line says why."""
    failed = [e for e in ended if e.failed]
    if not failed:
        return []
    first, rest = failed[0], failed[1:]
    when = "" if first.t is None else f" ({_clock(first.t)})"
    what = f"{first.how}, at step {first.step}{when}"
    if blamed:
        lines = [f"  first to end abnormally: rank {first.rank}, {what}"]
    elif first.cause == "communication" or (first.cause == "signal" and forwarded):
        why = (
            "a communication failure, the consequence of a fault on a rank it waited for"
            if first.cause == "communication"
            else "the signal hpar-agent run forwarded to every rank"
        )
        lines = [
            f"  culprit unknown: the first to end abnormally, rank {first.rank}, ended of {why}, and no "
            f"alert named the rank the waits pointed to: {what}"
        ]
    elif _same_error_everywhere(failed):
        lines = [
            f"  culprit unknown: every rank ended of the same error of its own, so it is not one rank's "
            f"(the program, its inputs or its setup): {what}, first on rank {first.rank}"
        ]
    else:
        lines = [f"  culprit: rank {first.rank}, the first to end abnormally: {what}"]
    if rest:
        hows = sorted({e.how for e in rest})
        later = [e.t - first.t for e in rest if e.t is not None and first.t is not None]
        span = f" within {max(later):.1f} s" if later else ""
        lines.append(
            f"  then {ranks_text(e.rank for e in rest)}{span}: {'; '.join(hows[:2])}"
            + (f"; and {len(hows) - 2} other endings" if len(hows) > 2 else "")
        )
    return lines


def _same_error_everywhere(failed: list[Ending]) -> bool:
    """Whether every rank of a job of several raised one and the same exception of its own (a bad
    argument, a missing file, a feature the backend lacks; the launcher may have terminated the later
    ones after they raised): naming the rank that happened to end first would send its user to one
    machine for a fault they all share."""
    first = failed[0]
    return (
        first.world > 1
        and len({e.rank for e in failed}) == first.world
        and len({e.error for e in failed}) == 1
        and first.error != ""
    )


def ending_lines(
    ended: list[Ending], events: Iterable[Mapping[str, Any]], forwarded: bool = False
) -> list[str]:
    """What ``hpar-agent run`` ends with after the ranks: the culprits the alerts named, then the
    first rank to end abnormally (``forwarded``: ``hpar-agent run`` forwarded a signal to the ranks)."""
    named = culprit_lines(events)
    blamed = any(line.startswith("  culprit:") for line in named)
    return named + failure_lines(ended, blamed=blamed, forwarded=forwarded)


def _clock(t: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
