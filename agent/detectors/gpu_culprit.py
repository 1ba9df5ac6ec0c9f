"""The GPU health of the ranks a verdict names, against their peers': ``details.culprit_gpu``.

Why: a verdict that names a slow or failed rank raises the next question at once, whether its GPU is
throttling or failing. Every rank publishes its GPU's health in its ``s`` (``sources.GpuHealth.packed``),
so the rank that judges already holds its comparison peers' health: the alert book adds, for each
culprit whose health it read, that health, the median of the other ranks read (culprits left out) and
one line (``rank 5: hw_slowdown since 14:02:11, SM clock 1,410 MHz against 1,980 (peers' median)``).
A detector opts in with ``Detector.gpu_culprits`` (its culprits may be a GPU's doing); a rank without
a GPU publishes none, and a culprit whose health is not known gets no entry (no key at all on CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

from hpar_agent.detectors.snapshot import PeerView

#: packed key -> (name in the details, unit in the line)
FIELDS = {"sm": "sm_mhz", "smx": "sm_max_mhz", "tc": "temp_c", "w": "power_w", "wl": "power_limit_w"}
#: Culprits given an entry (a verdict naming more names a block: the first ones say what it is).
MAX_CULPRITS = 8
#: Degrees above the peers' median temperature, and the share below their median power, worth a mention.
HOTTER_C = 10.0
POWER_SHARE = 0.8


def _health(view: PeerView, rank: int) -> Mapping[str, Any] | None:
    """The rank's last published health: from the last read, else its last ``s`` however old (a rank
    that stopped publishing: its last word)."""
    for source in (view.peers, view.seen):
        got = (source.get(rank) or {}).get("gh")
        if isinstance(got, Mapping):
            return got
    return None


def _unpack(h: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": str(h.get("g", ""))}
    for key, name in FIELDS.items():
        if isinstance(h.get(key), (int, float)):
            out[name] = float(h[key])
    th = h.get("th")
    out["throttles"] = {str(r): float(t) for r, t in th.items()} if isinstance(th, Mapping) else {}
    out["ecc_uncorrected"] = int(h.get("ecc") or 0)
    xid = h.get("xid")
    if isinstance(xid, list) and len(xid) == 2:
        out["xid_events"], out["last_xid"] = int(xid[0] or 0), xid[1]
    return out


def _median(peers: list[dict[str, Any]]) -> dict[str, Any]:
    med: dict[str, Any] = {"ranks": len(peers)}
    for name in FIELDS.values():
        vals = [p[name] for p in peers if name in p]
        if vals:
            med[name] = float(statistics.median(vals))
    med["throttled"] = sum(1 for p in peers if p["throttles"])  # how many of them throttle too
    return med


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def line(rank: int, own: Mapping[str, Any], med: Mapping[str, Any]) -> str:
    """``rank 5: hw_slowdown since 14:02:11, SM clock 1,410 MHz against 1,980 (peers' median)``."""
    parts = [f"{r} since {_clock(t)}" for r, t in sorted(own["throttles"].items())] or ["no slowing throttle"]
    sm, ref = own.get("sm_mhz"), med.get("sm_mhz")
    if sm is not None and ref is not None:
        parts.append(f"SM clock {sm:,.0f} MHz against {ref:,.0f} (peers' median)")
    elif sm is not None and own.get("sm_max_mhz"):
        parts.append(
            f"SM clock {sm:,.0f} MHz of its {own['sm_max_mhz']:,.0f} maximum (no peer's health read)"
        )
    temp, ref_t = own.get("temp_c"), med.get("temp_c")
    if temp is not None and ref_t is not None and temp >= ref_t + HOTTER_C:
        parts.append(f"{temp:.0f} C against {ref_t:.0f}")
    watts, ref_w = own.get("power_w"), med.get("power_w")
    if watts is not None and ref_w and watts < POWER_SHARE * ref_w:
        limit = own.get("power_limit_w")
        parts.append(f"{watts:,.0f} W against {ref_w:,.0f}" + (f" (limit {limit:,.0f})" if limit else ""))
    if own.get("ecc_uncorrected"):
        parts.append(f"{own['ecc_uncorrected']} uncorrected ECC errors")
    if own.get("xid_events"):
        parts.append(f"{own['xid_events']} Xid errors (last Xid {own.get('last_xid')})")
    return f"rank {rank}: " + ", ".join(parts)


def culprit_gpu(culprits: Iterable[int], view: PeerView) -> dict[str, dict[str, Any]]:
    """str(rank) -> {"health", "peers_median", "line"} for each culprit whose GPU health this rank read
    ({} when none: CPU hosts, or no payload read yet). The median is over the other ranks read, this
    one included, culprits left out."""
    named = list(dict.fromkeys(int(r) for r in culprits))[:MAX_CULPRITS]
    if not named:
        return {}
    peers = [_unpack(h) for r in view.peers if r not in named and (h := _health(view, r)) is not None]
    med = _median(peers)
    out: dict[str, dict[str, Any]] = {}
    for r in named:
        h = _health(view, r)
        if h is None:
            continue
        own = _unpack(h)
        out[str(r)] = {"health": own, "peers_median": med, "line": line(r, own, med)}
    return out


def culprit_gpu_text(details: Mapping[str, Any]) -> str:
    """The culprits' GPU lines of an alert's details, for its log line ('' without)."""
    got = details.get("culprit_gpu")
    if not isinstance(got, Mapping):
        return ""
    return "".join(f"; {v['line']}" for v in got.values() if isinstance(v, Mapping) and v.get("line"))
