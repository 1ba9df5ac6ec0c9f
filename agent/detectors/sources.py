"""Defensive readers of the collectors' state: the one place that knows their attribute names.

Collectors evolve independently; a missing collector or attribute reads as "no data" (None/empty),
never as an exception, so a detector simply stays silent until its source exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpar_agent.detectors.signals import FrEntry
from hpar_agent.topology import ATOMIC_DIMS, FLATTENED_DIMS

if TYPE_CHECKING:
    from hpar_agent.agent import Agent


def _get(obj: Any, *names: str) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return None


def _total(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, Mapping):
        return float(sum(x for x in v.values() if isinstance(x, (int, float))))
    if isinstance(v, (int, float)):
        return float(v)
    return None


def recompiles_total(agent: Agent) -> float | None:
    """Recompiles plus recompile-limit hits so far (a limit hit is a recompile that was refused)."""
    c = agent.component("compile")
    if c is None:
        return None
    rec = _total(_get(c, "recompiles", "recompiles_total", "recompile_count"))
    return None if rec is None else rec + recompile_limit_hits(agent)


def recompile_limit_hits(agent: Agent) -> float:
    """Frames that hit Dynamo's recompile limit so far (0 without a compile collector)."""
    c = agent.component("compile")
    return (_total(_get(c, "limit_hits", "recompile_limit_hits")) or 0.0) if c is not None else 0.0


def cache_lookups(agent: Agent) -> tuple[float, float] | None:
    """(hits, misses) summed over the compile caches so far."""
    c = agent.component("compile")
    ev = _get(c, "cache_events", "cache", "caches") if c is not None else None
    if not isinstance(ev, Mapping):
        return None
    hits = misses = 0.0
    for key, n in ev.items():
        result = key[-1] if isinstance(key, tuple) else str(key).rsplit("_", 1)[-1]
        if result == "hit":
            hits += n
        elif result == "miss":
            misses += n
    return hits, misses


def graph_break_reasons(agent: Agent) -> dict[str, Any]:
    """reason key -> count (or any value) of graph breaks seen so far."""
    c = agent.component("compile")
    v = _get(c, "graph_breaks", "breaks") if c is not None else None
    return dict(v) if isinstance(v, Mapping) else {}


def graph_break_detail(agent: Agent, reason: str) -> str:
    """The user stack / message the compile collector logged for ``reason`` (for the alert details)."""
    c = agent.component("compile")
    info = _get(c, "break_info") if c is not None else None
    if isinstance(info, Mapping) and isinstance(info.get(reason), Mapping):
        entry = info[reason]
        frames = sorted(str(f) for f in entry.get("user_frames") or ())[:4]
        c10d = str(entry.get("c10d") or "")
        head = [f"c10d call `{c10d}` inside compiled code; use torch.distributed._functional_collectives"] if c10d else []
        return "; ".join([*head, str(entry.get("reason", ""))[:500], *frames])
    return ""


def graph_break_c10d(agent: Agent, reason: str) -> str:
    """The c10d function (e.g. broadcast) that caused graph breaks of ``reason``; '' for other breaks."""
    c = agent.component("compile")
    info = _get(c, "break_info") if c is not None else None
    entry = info.get(reason) if isinstance(info, Mapping) else None
    return str(entry.get("c10d") or "") if isinstance(entry, Mapping) else ""


def graph_compiles(agent: Agent) -> list[tuple[int, str]] | None:
    """(step, code location) of every graph compiled (bounded log); None without a compile collector."""
    c = agent.component("compile")
    log = _get(c, "graph_log") if c is not None else None
    return None if log is None else list(log)


def graph_fingerprint(agent: Agent) -> int | None:
    c = agent.component("compile")
    v = _get(c, "fingerprint", "graph_fingerprint") if c is not None else None
    return int(v) if isinstance(v, (int, float)) else None


def compile_activity(agent: Agent) -> tuple[float, ...] | None:
    """A token that changes whenever the compile collector saw compile work (a compile started,
    ended, added a graph or compile time), and whether a compile is in progress (last element);
    None without a compile collector."""
    c = agent.component("compile")
    if c is None:
        return None
    compiles = _total(_get(c, "compiles")) or 0.0
    seconds = float(getattr(c, "compile_seconds", 0.0) or 0.0)
    graphs = float(len(getattr(c, "graphs", ()) or ()))
    opened = float(len(getattr(c, "_open", ()) or ()))
    return compiles, seconds, graphs, opened


def memory_series(agent: Agent) -> dict[str, list[tuple[int, float]]]:
    """source -> [(step, bytes)] sampled right after each step."""
    c = agent.component("memory")
    v = _get(c, "post_step") if c is not None else None
    if not isinstance(v, Mapping):
        return {}
    return {str(k): [(int(s), float(b)) for s, b in list(d)] for k, d in v.items()}


def latency_histograms(agent: Agent) -> dict[tuple[str, str], tuple[tuple[float, ...], list[int]]]:
    """(pg, op) -> (bucket bounds, per-bucket counts) of collective latency, summed over streams."""
    c = agent.component("collectives")
    v = _get(c, "hists", "histograms", "latency") if c is not None else None
    if not isinstance(v, Mapping):
        return {}
    out: dict[tuple[str, str], tuple[tuple[float, ...], list[int]]] = {}
    for k, h in list(v.items()):
        if not (isinstance(k, tuple) and len(k) >= 2 and hasattr(h, "counts")):
            continue
        key = (str(k[0]), str(k[1]))
        if key in out:
            out[key] = (out[key][0], [a + b for a, b in zip(out[key][1], h.counts, strict=True)])
        else:
            out[key] = (tuple(h.bounds), list(h.counts))
    return out


def timed_ops(agent: Agent) -> tuple[int, list[tuple[str, str, int, int, float]]]:
    """(ops timed so far, the most recent timed ops as (pg label, op, seq, enqueue ns, seconds))."""
    c = agent.component("collectives")
    if c is None:
        return 0, []
    v = _get(c, "timed_ops")
    return int(getattr(c, "timed", 0) or 0), (list(v) if v is not None else [])


def group_key(agent: Agent, label: str) -> str:
    """The pg id ``fr_entries`` gives this rank's group of ``label`` (to match timed ops with entries)."""
    topo = agent.topology
    coords = topo.coords() if hasattr(topo, "coords") else {"tp": topo.tp_rank, "pp": topo.pp_rank}
    return _group_key(label, coords)  # the same coordinates as fr_entries, or no op ever matches


def fr_mark(agent: Agent) -> Any:
    """Changes when new flight-recorder entries were read (the record id of the newest one)."""
    c = agent.component("collectives")
    v = _get(c, "recent_entries") if c is not None else None
    return v[-1].get("record_id") if v else None


def oldest_inflight(agent: Agent) -> dict[str, float]:
    """pg -> age in seconds of its oldest op not yet completed."""
    c = agent.component("collectives")
    v = _get(c, "oldest_age", "oldest_inflight_age", "oldest_inflight") if c is not None else None
    return {str(k): float(a) for k, a in v.items() if a is not None} if isinstance(v, Mapping) else {}


def pg_timeout_s(agent: Agent) -> float | None:
    c = agent.component("collectives")
    v = _get(c, "pg_timeout_s", "timeout_s") if c is not None else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def _group_key(label: str, coords: Mapping[str, Any]) -> str:
    """A pg id equal on every member of one group and different between groups: the label (``dp``
    is the label of every dp group) plus the coordinates the group's members share. ``coords`` holds
    the atomic dims (dp_replicate, dp_shard, cp, tp, pp); a label that is a mesh dim, flattened or not
    (``dp_shard``, ``dp`` = dp_replicate x dp_shard, ``dp_shard_cp``), spans its atomic dims."""
    low = label.lower()
    spans = FLATTENED_DIMS.get(low) or ((low,) if low in ATOMIC_DIMS else None)
    if spans is None:  # a label that only contains a dim name (e.g. a user's "dp_grads")
        for dim in ("dp", "tp", "pp"):
            if dim in low:
                spans = FLATTENED_DIMS.get(dim, (dim,))
                break
    if spans is None:
        return label
    return f"{label}@" + ",".join(str(coords.get(k)) for k in ATOMIC_DIMS if k not in spans)


def fr_entries(agent: Agent, limit: int = 256) -> list[FrEntry]:
    """Recent collectives (p2p excluded: its sequence numbers are per peer pair) as compact tuples
    (pg id, seq, op, sizes, dtypes, time_created_ns); the pg id is made unique per group."""
    c = agent.component("collectives")
    v = _get(c, "recent_entries") if c is not None else None
    if v is None:
        return []
    topo = agent.topology
    coords = topo.coords() if hasattr(topo, "coords") else {"tp": topo.tp_rank, "pp": topo.pp_rank}
    out: list[FrEntry] = []
    for e in list(v)[-limit:]:
        if not isinstance(e, Mapping) or e.get("is_p2p"):
            continue
        pg, seq = e.get("pg"), e.get("seq")
        if pg is None or seq is None:
            continue
        sizes = e.get("input_sizes", e.get("sizes", ""))
        dtypes = e.get("input_dtypes", e.get("dtypes", ""))
        t = e.get("time_created_ns", e.get("time", 0))
        t_ns = int(t * 1e9) if isinstance(t, float) and t < 1e12 else int(t or 0)
        out.append((_group_key(str(pg), coords), int(seq), str(e.get("op", "")), sizes if isinstance(sizes, str) else str(sizes), _flat(dtypes), t_ns))
    return out


def pg_label(uid: str) -> str:
    """The pg label back from an id made by ``_group_key``."""
    return uid.split("@", 1)[0]


def _flat(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)):
        return ",".join(_flat(x) if isinstance(x, (list, tuple)) else str(x) for x in v)
    return str(v)


def step_state(agent: Agent) -> tuple[int, float, list[float]]:
    """(steps completed, unix time of the last step, recent step durations)."""
    c = agent.component("steps")
    if c is None:
        return 0, 0.0, []
    return int(getattr(c, "total", 0)), float(getattr(c, "last_step_ts", 0.0)), list(getattr(c, "durations", []))
