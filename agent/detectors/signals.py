"""Pure signal functions behind the detectors.

They take plain numbers and dicts (no torch, no agent) so each failure shape and each "clean run"
shape can be unit-tested with synthetic data, independently of when the collectors fill their state.
"""

from __future__ import annotations

import ast
import bisect
import functools
import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from itertools import pairwise
from statistics import median
from typing import Any

# ------------------------------------------------------------------------------------------ trends


def theil_sen_slope(points: Sequence[tuple[float, float]]) -> float:
    """Median of pairwise slopes: robust to a few outliers (a checkpoint spike, one GC) unlike a fit."""
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 != x1
    ]
    return median(slopes) if slopes else 0.0


def time_to_full(
    room: float, slope: float, steps_done: int, step_seconds: float | None
) -> tuple[int, float | None] | None:
    """(the step at which ``room`` bytes are used up at ``slope`` bytes a step, seconds until then at
    ``step_seconds`` a step or None); None when memory is not growing."""
    if not slope > 0 or not math.isfinite(slope):
        return None
    steps = max(0.0, room) / slope
    return steps_done + math.ceil(steps), (steps * step_seconds if step_seconds else None)


def increase_fraction(values: Sequence[float], min_increase: float) -> float:
    """Fraction of consecutive samples that rose by at least ``min_increase`` (the stair-step test)."""
    if len(values) < 2:
        return 0.0
    ups = sum(1 for a, b in pairwise(values) if b - a >= min_increase)
    return ups / (len(values) - 1)


def leak_signal(
    samples: Sequence[tuple[int, float]],
    *,
    warmup_steps: int,
    window: int,
    min_slope: float,
    min_increase_fraction: float,
    parts: int = 3,
) -> tuple[float, bool]:
    """(bytes/step slope, leaking?) over the last ``window`` (step, bytes) samples from ``warmup_steps`` on.

    Leaking needs all four: the Theil-Sen slope over the window >= ``min_slope``; the slope of the
    window's second half >= ``min_slope / 2`` (memory still rising: an allocator that grew to a plateau
    fails this); at least ``min_increase_fraction`` of steps rising by >= ``min_slope / 2`` (one
    checkpoint-like jump moves the median slope but is a single step); and growth across the whole
    window: the medians of its ``parts`` consecutive parts each exceed the previous one by a quarter
    of what ``min_slope`` adds over a part (warm-up growth that is flattening out fails in the last part;
    medians of parts keep a stair-step leak, +N MiB every few steps, rising).
    """
    pts = [(float(s), float(b)) for s, b in samples if s >= warmup_steps][-window:]
    if len(pts) < max(window, 4):
        return (theil_sen_slope(pts) if len(pts) >= 2 else 0.0), False
    slope = theil_sen_slope(pts)
    late = theil_sen_slope(pts[len(pts) // 2 :])
    frac = increase_fraction([b for _, b in pts], min_slope / 2)
    return slope, (
        slope >= min_slope
        and late >= min_slope / 2
        and frac >= min_increase_fraction
        and rising_parts([b for _, b in pts], parts, min_slope / 4)
    )


def rising_parts(values: Sequence[float], parts: int, min_step_rise: float) -> bool:
    """The medians of ``parts`` consecutive slices of ``values`` each rise by >= ``min_step_rise`` per
    sample of a slice over the previous slice's median."""
    n = len(values) // parts
    if n < 1:
        return False
    medians = [median(values[i * n : (i + 1) * n]) for i in range(parts)]
    return all(b - a >= min_step_rise * n for a, b in pairwise(medians))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank; nan when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def net_of_skew(seconds: float, created_ns: int, arrivals_ns: Sequence[int]) -> float:
    """An op's duration less the time it waited for the last member of its group to arrive (enqueue):
    what the transfer itself took, as the last-arriving rank would time it."""
    wait = max(0.0, (max(arrivals_ns, default=created_ns) - created_ns) / 1e9)
    return max(0.0, seconds - wait)


# ------------------------------------------------------------------------------------------ compile


def hit_ratio(hits: float, misses: float) -> float:
    lookups = hits + misses
    return hits / lookups if lookups > 0 else math.nan


def new_reasons(first_seen: Mapping[str, int], warmup_steps: int, since_step: int) -> list[str]:
    """Graph-break reasons first seen after warm-up and at or after ``since_step``."""
    return sorted(r for r, s in first_seen.items() if s >= warmup_steps and s >= since_step)


# ------------------------------------------------------------------------------------------ cross-rank


def odd_ranks(values: Mapping[int, Hashable]) -> set[int]:
    """Ranks whose value differs from the group's strict majority; all ranks when there is no strict
    majority (a 1-1 split cannot say who is wrong); none when all agree."""
    if len(set(values.values())) <= 1:
        return set()
    counts = Counter(values.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return set(values)
    majority = counts[0][0]
    return {r for r, v in values.items() if v != majority}


def outvoted(values: Mapping[int, Hashable]) -> set[int]:
    """Ranks off a clear majority: the most common value held by at least twice as many ranks as every
    other value together (4-1 of five, 6-2 of eight); all ranks when the values differ without one (a
    3-2 split of five); none when all agree. Why not the strict majority: a rank compares with a few
    peers only, and where a fault is dense (half the job) its sample's majority is as often the faulty
    side (3 of 5); among ranks spread as ``crossrank.select`` spreads them, half the job wrong on one
    side never gives a 4-1 the wrong way, so a 3-2 is said to be a split with no culprit."""
    if len(set(values.values())) <= 1:
        return set()
    (top, count), *_ = Counter(values.values()).most_common(1)
    if count >= 2 * (len(values) - count):
        return {r for r, v in values.items() if v != top}
    return set(values)


def sides(values: Mapping[int, Hashable]) -> list[list[int]]:
    """The ranks by value, the largest side first: what a split with no clear majority is made of."""
    by_value: dict[Hashable, list[int]] = {}
    for r in sorted(values):
        by_value.setdefault(values[r], []).append(r)
    return sorted(by_value.values(), key=lambda side: (-len(side), side))


def culprits_of(values: Mapping[int, Hashable]) -> dict[str, Any]:
    """``{"culprits": [...]}``: the ranks off a clear majority's value ([] when all agree,
    ``outvoted``); with no clear majority no culprit, ``culprit_unknown`` says why and ``split`` holds
    the sides."""
    odd = outvoted(values)
    if odd and len(odd) == len(values):
        split = sides(values)
        return {
            "culprits": [],
            "culprit_unknown": f"no majority among ranks {sorted(values)}, split "
            f"{'-'.join(str(len(side)) for side in split)}: who is wrong is unknown",
            "split": split,
        }
    return {"culprits": sorted(odd)}


DP_KEYS = ("tp", "pp")  # ranks of one dp group share tp and pp coordinates
TP_KEYS = ("dp", "pp")


def groups_by(coords: Mapping[int, Mapping[str, int]], keys: Sequence[str]) -> list[list[int]]:
    """Partition ranks by equal coordinates on ``keys`` (dp group: same tp/pp; tp group: same dp/pp)."""
    out: dict[tuple[Any, ...], list[int]] = {}
    for rank, c in coords.items():
        out.setdefault(tuple(c.get(k) for k in keys), []).append(rank)
    return [sorted(g) for g in out.values()]


def group_of(
    payloads: Mapping[int, Mapping[str, Any]], rank: int, keys: Sequence[str], need: str
) -> list[int]:
    """The ranks of ``rank``'s group (equal coordinates ``c`` on ``keys``) whose payload has ``need``."""
    coords = {r: p["c"] for r, p in payloads.items() if need in p and "c" in p}
    for group in groups_by(coords, keys):
        if rank in group:
            return group
    return []


def _checksum_key(v: Sequence[float]) -> tuple[str, ...]:
    return tuple(f"{x:.9g}" for x in v)  # strings: NaN sums compare equal to NaN sums


def replica_offenders(
    sums: Mapping[int, Mapping[str, Sequence[float]]], names: Sequence[str] | None = None
) -> dict[int, list[str]]:
    """For one replica group at one step: rank -> parameter names whose checksum is off a clear
    majority's (``outvoted``: every member's, where there is none).

    Replicas that are in sync hold bitwise-identical tensors, so their checksums agree to the printed
    precision; ``names`` restricts the comparison (tp groups compare only replicated parameters).
    """
    common = set.intersection(*(set(s) for s in sums.values())) if sums else set()
    if names is not None:
        common &= set(names)
    out: dict[int, list[str]] = {}
    for name in sorted(common):
        for r in outvoted({r: _checksum_key(s[name]) for r, s in sums.items()}):
            out.setdefault(r, []).append(name)
    return out


def _pieces(
    sums: Mapping[int, Mapping[str, Sequence[float]]], keys: Mapping[int, Mapping[str, str]], rank: int
) -> dict[tuple[int, ...], list[str]]:
    """The ranks holding the same piece as ``rank`` (equal shard key; missing key: a whole, replicated
    parameter) -> the names of ``rank``'s parameters they hold, where at least two hold them."""
    mkeys = keys.get(rank, {})
    by_members: dict[tuple[int, ...], list[str]] = {}
    for name in sums.get(rank, {}):
        key = mkeys.get(name, "")
        members = tuple(r for r, s in sums.items() if name in s and keys.get(r, {}).get(name, "") == key)
        if len(members) >= 2:
            by_members.setdefault(members, []).append(name)
    return by_members


def same_shard_offenders(
    sums: Mapping[int, Mapping[str, Sequence[float]]], keys: Mapping[int, Mapping[str, str]], rank: int
) -> list[str]:
    """``rank``'s parameters whose checksum is not the majority's among the ranks holding the same
    piece of that parameter. Shards of one FSDP parameter on different ranks are different values and
    are never compared."""
    out: list[str] = []
    for members, names in _pieces(sums, keys, rank).items():
        out += replica_offenders({r: sums[r] for r in members}, names).get(rank, [])
    return sorted(out)


def unsplittable(
    sums: Mapping[int, Mapping[str, Sequence[float]]], keys: Mapping[int, Mapping[str, str]], rank: int
) -> list[int]:
    """The holders of a piece ``rank`` holds that differ with no clear majority among them (a 1-1
    split of two HSDP replicas of one shard, a 3-2 split of five peers where half the job diverged):
    who of them is wrong is unknown."""
    out: set[int] = set()
    for members, names in _pieces(sums, keys, rank).items():
        odd = replica_offenders({r: sums[r] for r in members}, names)
        if rank in odd and set(odd) == set(members):
            out.update(members)
    return sorted(out)


def checksum_digests(sums: Mapping[str, Sequence[float]], keys: Mapping[str, str]) -> dict[str, str]:
    """shard key -> a 16-hex digest of one step's checksums of the parameters holding that key ("" for
    whole ones), as ``replica_offenders`` compares them: equal digests on two ranks holding the same
    key mean no parameter of it differs; unequal ones mean some does (or the two hold different
    parameter names), which only the checksums themselves can say."""
    by_key: dict[str, list[str]] = {}
    for name in sorted(sums):
        by_key.setdefault(keys.get(name, ""), []).append(f"{name}={','.join(_checksum_key(sums[name]))}")
    return {k: hashlib.blake2b(";".join(v).encode(), digest_size=8).hexdigest() for k, v in by_key.items()}


def digests_agree(digests: Mapping[int, Mapping[str, str]]) -> bool:
    """Whether the ranks holding each shard key report one digest for it (``checksum_digests``)."""
    seen: dict[str, str] = {}
    for d in digests.values():
        for key, h in d.items():
            if seen.setdefault(key, h) != h:
                return False
    return True


FrEntry = tuple[str, int, str, str, str, int]  # (pg uid, seq, op, sizes, dtypes, time_created_ns)
_SIZE_FREE_OPS = ("all_to_all", "alltoall", "gather", "scatter", "barrier")


def pack_fr(entries: Sequence[FrEntry]) -> dict[str, Any]:
    """Entries for the cross-rank exchange: each distinct (pg, op, sizes, dtypes) once, then three small
    ints per entry: its kind's index, its seq less its group's seq before it in the window (1 in a steady
    run; a group's first entry: its seq), and the µs since the previous entry (``u0``: the first's).
    A job repeats a few kinds over thousands of collectives and every rank reads every peer's window at
    each exchange: as 6-field lists ~120 KB of JSON a poll on 4 CPU ranks; with seqs and ns ~18 bytes an
    entry (18.8 KB at the window's 1,024); ~10 now. Times keep µs (floored): lags are judged in ms."""
    kinds: dict[tuple[str, str, str, str], int] = {}
    flat: list[int] = []
    last: dict[str, int] = {}
    prev = u0 = entries[0][5] // 1000 if entries else 0
    for pg, seq, op, sizes, dtypes, t in entries:
        k = kinds.setdefault((pg, op, sizes, dtypes), len(kinds))
        u = t // 1000
        flat += (k, seq - last.get(pg, 0), u - prev)
        last[pg] = seq
        prev = u
    return {"k": list(kinds), "e": flat, "u0": u0}


def unpack_fr(packed: Any) -> list[FrEntry]:
    """``pack_fr``'s inverse, times in ns (a list of 6-field lists, the older form, is read as well, and a
    list of tuples, already unpacked, is returned as it is); [] for anything malformed: a peer's payload
    must never break this rank's detectors."""
    if isinstance(packed, list):
        if not packed or isinstance(packed[0], tuple):
            return packed
        return [tuple(e) for e in packed if isinstance(e, (list, tuple)) and len(e) == 6]
    try:
        kinds = [tuple(k) for k in packed["k"]]
        flat = packed["e"]
        if len(flat) % 3 or min(flat[0::3], default=0) < 0 or any(len(k) != 4 for k in kinds):
            return []
        times = itertools.accumulate(flat[2::3], initial=int(packed["u0"]))
        next(times)
        last: dict[str, int] = {}
        out: list[FrEntry] = []
        for kd, d, u in zip(map(kinds.__getitem__, flat[0::3]), flat[1::3], times, strict=True):
            seq = last[kd[0]] = last.get(kd[0], 0) + d
            out.append((kd[0], seq, kd[1], kd[2], kd[3], u * 1000))
        return out
    except (KeyError, IndexError, TypeError, ValueError):
        return []


def pack_totals(values: Sequence[int]) -> dict[str, list[int]]:
    """Running totals, one per flight-recorder entry (``pipeline_p2p.waited_by``: ns waited in p2p so
    far), for the exchange: the first and then each one's increase, mostly 0 (no p2p wait between two
    collectives), where a long run's totals are 12-13 digits each."""
    return {"d": [b - a for a, b in pairwise([0, *values])]}


def unpack_totals(packed: Any) -> list[int] | None:
    """``pack_totals``' inverse; None for anything malformed."""
    d = packed.get("d") if isinstance(packed, dict) else None
    if not isinstance(d, list) or not all(type(x) is int for x in d):
        return None
    return list(itertools.accumulate(d))


def common_collectives(
    entries_by_rank: Mapping[int, Sequence[FrEntry]], sizes: Mapping[str, int] | None = None
) -> dict[tuple[str, int], dict[int, FrEntry]]:
    """(pg, seq) -> rank -> entry, keeping only keys every member of the pg reported: windows of
    different ranks overlap only partly, and a member that has not published yet must not turn a
    3-rank majority into a 1-1 tie. ``sizes`` gives a pg's member count where known; otherwise the
    members are the ranks that reported any entry of that pg."""
    members: dict[str, set[int]] = {}
    keyed: dict[tuple[str, int], dict[int, FrEntry]] = {}
    for rank, entries in entries_by_rank.items():
        for e in entries:
            members.setdefault(e[0], set()).add(rank)
            keyed.setdefault((e[0], e[1]), {})[rank] = e
    need = sizes or {}
    return {
        k: v
        for k, v in keyed.items()
        if len(v) >= 2 and set(v) == members[k[0]] and len(v) >= need.get(k[0], 0)
    }


def _signature(e: FrEntry) -> tuple[Any, ...]:
    op = e[2].split(":")[-1]
    return (op, e[4]) if any(s in op for s in _SIZE_FREE_OPS) else (op, e[3], e[4])


#: ``collective_mismatches``' memo: the odd ranks of each distinct set of entry kinds judged
OddMemo = dict[tuple[Any, ...], tuple[int, ...]]


def collective_mismatches(
    entries_by_rank: Mapping[int, Sequence[FrEntry]],
    sizes: Mapping[str, int] | None = None,
    param_bits: int | None = None,
    common: Mapping[tuple[str, int], Mapping[int, FrEntry]] | None = None,
    memo: OddMemo | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """rank -> collectives (same pg and seq) where its op, sizes or dtypes differ from the majority's.

    With no majority (a 1-1 split of a 2-rank group), ``param_bits`` breaks the tie: when only some
    ranks reduce in a dtype narrower than the parameters, they are the odd ones. ``common``:
    ``common_collectives(entries_by_rank, sizes)`` when the caller has it already; ``memo``: a dict the
    caller keeps from call to call, so each distinct set of entry kinds is judged once (windows slide by a
    few entries between exchanges while every call judges the whole window again, and a job's
    collectives repeat a few kinds)."""
    if common is None:
        common = common_collectives(entries_by_rank, sizes)
    memo = {} if memo is None else memo
    found = [
        (key, by_rank, odd)
        for key, by_rank in common.items()
        if (odd := _odd_entries(by_rank, param_bits, memo))
    ]
    out: dict[int, list[dict[str, Any]]] = {}
    for (pg, seq), by_rank, odd in sorted(found, key=lambda f: f[0]):  # the few odd ones, not the window
        for r in odd:
            e = by_rank[r]
            out.setdefault(r, []).append({"pg": pg, "seq": seq, "op": e[2], "sizes": e[3], "dtypes": e[4]})
    return out


def _odd_entries(by_rank: Mapping[int, FrEntry], param_bits: int | None, memo: OddMemo) -> tuple[int, ...]:
    """The ranks whose entry of one (pg, seq) differs from the majority's, sorted (once per distinct set
    of entry kinds in ``memo``, which holds up to 4,096)."""
    key = (param_bits, *sorted((r, e[2], e[3], e[4]) for r, e in by_rank.items()))
    hit = memo.get(key)
    if hit is None:
        odd = odd_ranks({r: _signature(e) for r, e in by_rank.items()})
        if param_bits and len(odd) == len(by_rank) > 1:
            narrow = {r for r, e in by_rank.items() if "reduce" in e[2] and _min_bits(e[4]) < param_bits}
            odd = narrow or odd
        if len(memo) >= 4096:
            memo.clear()
        hit = memo[key] = tuple(sorted(odd))
    return hit


_FLOAT_BITS = {
    "float64": 64,
    "double": 64,
    "float32": 32,
    "float": 32,
    "float16": 16,
    "half": 16,
    "bfloat16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
}


def dtype_bits(name: str) -> int | None:
    """Bits of a floating dtype name as FR/torch print it (``torch.float32``, ``Float``, ``BFloat16``)."""
    key = name.lower().removeprefix("torch.")
    return _FLOAT_BITS.get(key)


@functools.lru_cache(maxsize=1024)
def _min_bits(dtypes: str) -> float:
    """Fewest bits among the floating dtypes of an entry's comma-separated dtype list (inf: none).
    Cached: a job repeats a few dtype lists over thousands of entries per detector pass."""
    bits = [b for b in (dtype_bits(d) for d in dtypes.split(",") if d) if b is not None]
    return min(bits, default=math.inf)


def entry_bits(e: FrEntry) -> float:
    """Fewest floating bits among an entry's dtypes (inf: none)."""
    return _min_bits(e[4])


def entry_bytes(e: FrEntry) -> int:
    """Message bytes of an entry: its input elements (from the sizes text) x the entry's narrowest
    dtype; -1 when the sizes or dtypes do not parse."""
    return _message_bytes(e[3], e[4])


@functools.lru_cache(maxsize=4096)
def _message_bytes(sizes: str, dtypes: str) -> int:
    """Cached: ``literal_eval`` takes tens of µs, and the dtype detectors ask it for every peer entry of
    every pass, over a handful of distinct shapes."""
    bits = _min_bits(dtypes)
    try:
        shapes = ast.literal_eval(sizes) if sizes else []
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return -1
    if math.isinf(bits) or not isinstance(shapes, (list, tuple)):
        return -1
    try:
        numel = sum(math.prod(int(d) for d in shape) for shape in shapes if isinstance(shape, (list, tuple)))
    except (TypeError, ValueError):
        return -1
    return int(numel * bits) // 8


ReductionKey = tuple[str, str, int]  # (pg uid, op, message bytes)


def peer_reduction_bits(
    entries_by_rank: Mapping[int, Sequence[FrEntry]], rank: int
) -> dict[ReductionKey, float]:
    """What the other ranks reduce: (pg, op, bytes) -> the widest dtype bits seen for it."""
    out: dict[ReductionKey, float] = {}
    kinds = {(e[0], e[2], e[3], e[4]) for r, entries in entries_by_rank.items() if r != rank for e in entries}
    for pg, op, sizes, dtypes in kinds:  # a window repeats a few kinds: judge each once
        if "reduce" in op and not math.isinf(bits := _min_bits(dtypes)):
            k = (pg, op, _message_bytes(sizes, dtypes))
            out[k] = max(out.get(k, 0.0), bits)
    return out


def narrower_than_peers(low: Sequence[FrEntry], peers: Mapping[ReductionKey, float]) -> list[FrEntry]:
    """Low-precision reductions of this rank that its peers run wider: the same pg, op and message
    bytes (a bucket sent as bf16 padded to the fp32 size counts) in a dtype with more bits."""
    return [e for e in low if peers.get((e[0], e[2], entry_bytes(e)), 0.0) > _min_bits(e[4])]


def low_precision_reductions(
    entries: Sequence[FrEntry], param_bits: int, pgs: Sequence[str]
) -> list[FrEntry]:
    """Reductions on the gradient groups ``pgs`` whose dtype has fewer bits than the parameters."""
    return [e for e in entries if e[0] in pgs and "reduce" in e[2] and _min_bits(e[4]) < param_bits]


def waited_between(cum: Mapping[int, int], t0: int, t1: int) -> int:
    """ns waited in p2p between two of a rank's times whose ``pipeline_p2p.waited_by`` values ``cum`` holds (0 when
    either is unknown)."""
    a, b = cum.get(t0, -1), cum.get(t1, -1)
    return b - a if a >= 0 and b >= a else 0


def step_delays(
    entries_by_rank: Mapping[int, Sequence[FrEntry]],
    step_ends: Sequence[int],
    stage_of: Mapping[int, int] | None = None,
    after: int = 0,
    waited: Mapping[int, Mapping[int, int]] | None = None,
) -> dict[int, dict[int, float]]:
    """Per rank and step: the time the others waited for it in that step, as a share of the reference
    rank's time to the same collective, its last of the step (rank -> {the step's end, ns: share}).

    Steps are the judging rank's own (``step_ends``: its step boundaries, ns since the epoch like the
    flight recorder's enqueue times); a step is judged when every rank's window covers it, and only
    steps ending after ``after`` (those measured at an earlier exchange are not measured again). A
    rank's delay in a step counts once, whatever the number of collectives (DDP's gradient buckets):
    it is the lesser of two bounds on it.

    - Its own work, summed over the step: at each collective, its time since it was free to go on (the
      last arrival, among the ranks read, at its own previous collective: a tp peer that waited for a
      slow rank is free when that rank arrives) over the reference rank's time to the same collective.
      Async bursts, where a rank does not wait for its previous op, make this an overestimate.
    - Its lateness at the step's collectives: its arrival over the reference rank's arrival at the same
      collective, the most of the step. A rank that waited for a slow peer inherits that peer's lateness,
      so this is an overestimate for victims, never for the rank that caused it.

    The reference at a collective (same group kind, pipeline stage and seq) is the median over the
    groups holding it of each group's lower-median member: replicas are compared with replicas (a tp
    group slow across all its compute is late against the other replicas), ranks of one group with
    each other. A rank 1.5x slower than the reference scores 0.5 a step; ``delay_score`` makes that the
    share of its own step time the others waited (0.33).

    A rank ahead of its reference (its work under it, its arrivals before it, by the same two bounds)
    gets a negative share: how much of the reference's time it waited for it (a rank among 1.5x slower
    ones: -0.33). Where that is seen, the reference is a slow rank (``pace_sides``).
    """
    if len(entries_by_rank) < 2 or len(step_ends) < 2:
        return {}
    stage_of = stage_of or {}
    waited = waited or {}
    ordered = {r: sorted(es, key=lambda e: e[5]) for r, es in entries_by_rank.items() if es}
    if len(ordered) < 2:
        return {}
    t_lo = max(es[0][5] for es in ordered.values())
    t_hi = min(es[-1][5] for es in ordered.values())
    ends = [b for b in sorted(step_ends) if max(t_lo, after) <= b <= t_hi]
    if len(ends) < 2:
        return {}
    first, final = ends[0], ends[-1]
    last: dict[tuple[str, int], int] = {}  # (pg uid, seq) -> the last arrival among the ranks read
    spans: dict[int, list[tuple[FrEntry, FrEntry]]] = {}  # rank -> (previous, entry) of the judged steps
    for r, es in ordered.items():
        times = [e[5] for e in es]
        lo = max(1, bisect.bisect_right(times, first))
        hi = bisect.bisect_right(times, final)
        spans[r] = list(zip(es[lo - 1 : hi - 1], es[lo:hi], strict=True))
        for e in es[lo - 1 : hi]:
            k = (e[0], e[1])
            if e[5] > last.get(k, 0):
                last[k] = e[5]
    # (kind, stage, seq) -> pg uid -> [(rank, step, arrival, ns since its previous op's last arrival,
    # ns since its own previous arrival, ns it waited in p2p since then)]
    at: dict[tuple[str, int, int], dict[str, list[tuple[int, int, int, int, int, int]]]] = {}
    piped: dict[tuple[int, int], int] = {}  # (rank, step) -> ns it waited in p2p in the step
    for r, pairs in spans.items():
        stage = stage_of.get(r, 0)
        cum = waited.get(r, {})
        for prev, e in pairs:
            t = e[5]
            i = bisect.bisect_left(ends, t)
            op_key = (e[0].split("@", 1)[0], stage, e[1])
            p2p = waited_between(cum, prev[5], t)
            if p2p:
                piped[(r, i)] = piped.get((r, i), 0) + p2p
            at.setdefault(op_key, {}).setdefault(e[0], []).append(
                (r, i, t, t - last[(prev[0], prev[1])], t - prev[5], p2p)
            )
    excess: dict[tuple[int, int], float] = {}  # (rank, step) -> work over the reference's, summed
    late: dict[tuple[int, int], float] = {}  # (rank, step) -> the most it arrived after the reference
    short: dict[tuple[int, int], float] = {}  # (rank, step) -> work under the reference's, summed
    early: dict[tuple[int, int], float] = {}  # (rank, step) -> the most it arrived before the reference
    reach: dict[tuple[int, int], tuple[int, float]] = {}  # (rank, step) -> its last arrival, the reference's
    mates: dict[tuple[int, int], list[int]] = {}  # (rank, step) -> the ranks its reference is of
    for (label, *_), holders in at.items():
        # most ranks that were not the last at their previous op entered this one before that op could
        # complete: enqueued without waiting (an async burst, DDP's buckets), so each rank's work is its
        # time since its own previous arrival
        went_on = sum(1 for g in holders.values() for x in g if x[3] < 0)
        burst = 2 * went_on > sum(1 for g in holders.values() for x in g if x[3] != x[4])
        groups = {
            uid: [(r, i, t, max(0, (own if burst else blocked) - p2p)) for r, i, t, blocked, own, p2p in g]
            for uid, g in holders.items()
        }
        arrivals = {uid: sorted(x[2] for x in g) for uid, g in groups.items()}
        works = {uid: sorted(x[3] for x in g) for uid, g in groups.items()}
        across = model_parallel_dim(label) is not None and len(groups) > 1
        for uid, g in groups.items():
            if across:  # the groups are replicas of each other: compared with the other groups
                ref_t = _replica_median([v for u, v in arrivals.items() if u != uid])
                ref_w = _replica_median([v for u, v in works.items() if u != uid])
            for r, i, t, w in g:
                if not across:  # the members of a gradient group are the replicas: compared within it
                    ref_t, ref_w = _median_of_others(arrivals[uid], t), _median_of_others(works[uid], w)
                key = (r, i)
                if piped and key not in mates:  # whose p2p waits make its reference's
                    mates[key] = [
                        x[0] for u, gg in groups.items() if (u != uid if across else u == uid) for x in gg
                    ]
                if w > ref_w:
                    excess[key] = excess.get(key, 0) + w - ref_w
                elif w < ref_w:
                    short[key] = short.get(key, 0) + ref_w - w
                late[key] = max(late.get(key, 0), t - ref_t)
                early[key] = max(early.get(key, 0), ref_t - t)
                if t > reach.get(key, (0, 0.0))[0]:
                    reach[key] = (t, ref_t)
    out: dict[int, dict[int, float]] = {}
    for (r, i), lt in late.items():
        # the reference rank's time to this rank's last collective; for a pipeline stage whose delay
        # holds the step back by PIPELINE_MIN_SHARE or more, less the median p2p wait of the ranks it
        # is compared with (the stage's replicas), so that a stage 1.5x slower scores 0.5 a step as a
        # rank of a data-parallel job does, not a pp-th of it; a smaller delay is not magnified
        span = reach[(r, i)][1] - ends[i - 1]
        if span <= 0:
            continue
        delay = min(excess.get((r, i), 0), max(0, lt))
        lead = min(short.get((r, i), 0), early[(r, i)])  # the same bounds on how much it is ahead
        others = sorted(piped.get((q, i), 0) for q in mates.get((r, i), ()) if q != r)
        base = (
            span - min(median(others), 0.9 * span)
            if others and max(delay, lead) >= PIPELINE_MIN_SHARE * span
            else span
        )
        out.setdefault(r, {})[ends[i]] = (delay - lead) / base
    return out


#: a pipeline stage's delay is a share of its replicas' own work (their step less their p2p waits)
#: only from this share of the step on: a stage of a tiny model waits most of its step, and a few %
#: of the step late against its replica is no bottleneck
PIPELINE_MIN_SHARE = 0.1

_MODEL_PARALLEL = ("tp", "cp")  # groups whose members hold different parts of one replica


def model_parallel_dim(label: str) -> str | None:
    """ "tp" or "cp" for a tp or cp group's label (a user's "tp_group" too); None for gradient groups
    (dp, dp_shard_cp, the default group) and others."""
    low = label.lower()
    if "dp" in low:
        return None
    return next((d for d in _MODEL_PARALLEL if d in low), None)


def _median_of_others(ordered: Sequence[int], own: int) -> float:
    """The median of ``ordered`` without one ``own`` value (``own`` when it is alone): a rank is not its
    own reference, or a slow rank among five raises the median it is compared with; and not a lower
    median, which noise puts under the typical rank (every rank then looks late)."""
    n = len(ordered)
    if n < 2:
        return float(own)
    at = bisect.bisect_left(ordered, own)

    def other(k: int) -> int:  # the k-th smallest of the others
        return ordered[k if k < at else k + 1]

    m = n - 1
    return float(other(m // 2)) if m % 2 else (other(m // 2 - 1) + other(m // 2)) / 2


def _replica_median(groups: Sequence[Sequence[int]]) -> float:
    """The median over groups (each sorted) of each group's lower-median member."""
    lows = sorted(g[(len(g) - 1) // 2] for g in groups)
    return float(lows[(len(lows) - 1) // 2])


def delay_score(shares: Sequence[float]) -> float:
    """A rank's score from its per-step shares (``step_delays``): of the median share m, ``m / (1 + m)``,
    the part of its own step time the others waited for it (1.5x slower: 0.33; 1.1x: 0.09), 0 for a
    rank ahead. The median over steps: one spike, a checkpoint pause or a descheduled process, fills a
    step, not half of them."""
    return max(0.0, pace(shares))


def pace(shares: Sequence[float]) -> float:
    """``delay_score`` with a sign: for a rank ahead of its reference, minus the part of the
    reference's time it waited for it (a rank among 1.5x slower ones: -0.33, what they score against
    it), so that paces of one view are on one scale."""
    if not shares:
        return 0.0
    m = median(shares)
    return m / (1.0 + m) if m > 0 else m


def pace_sides(
    paces: Mapping[int, float], units: Sequence[Sequence[int]], limit: float
) -> tuple[list[list[int]], list[list[int]]] | None:
    """The compared ranks split by pace (``pace``), (slower units, faster units), where the fastest is
    ahead of its reference by more than ``limit`` (it waits for the median of the others more than
    that share of their step: they are slow); None where none is. ``units``: ranks that wait for each
    other (a tp group read whole: one replica's piece) count as one, as slow as its slowest member, so
    that a replica is weighed as one against the other replicas. The split is at the middle of the
    paces' range: healthy ranks and 1.5x slower ones are 0.33-0.53 apart, whichever side the
    references are on. Why not a gap alone: GPUs that differ by a fixed few % spread a view's paces
    over 0.3 with no two sides; a rank that far ahead is as rare there as one that far behind."""
    by_unit = [
        (max(paces[r] for r in u if r in paces), sorted(u)) for u in units if any(r in paces for r in u)
    ]
    lo = min((p for p, _ in by_unit), default=0.0)
    if lo >= -limit:
        return None
    mid = (lo + max(p for p, _ in by_unit)) / 2
    return [u for p, u in by_unit if p > mid], [u for p, u in by_unit if p <= mid]


def slow_culprits(
    paces: Mapping[int, float], units: Sequence[Sequence[int]], nameable: Collection[int], limit: float
) -> dict[str, Any]:
    """``{"culprits": [...]}``: the ``nameable`` ranks whose pace is over ``limit``, where the faster
    side holds at least as many units as the slower (``pace_sides``): each slower one is then compared
    with a faster one, the median of the others (4-4 of eight, 3-2 of five). Where the slower side
    holds more (3-2 of five the other way, half the job slow), its ranks are compared with slow ones
    and score low or nothing: no culprit is named, ``culprit_unknown`` says so ("no majority") and
    ``split`` holds the sides (``slower``, ``faster``: ranks)."""
    over = sorted(r for r in nameable if paces.get(r, 0.0) > limit)
    sides = pace_sides(paces, units, limit)
    if sides is None:
        return {"culprits": over}
    slower, faster = sides
    slow = sorted(r for u in slower for r in u)
    if len(faster) >= len(slower):
        return {"culprits": [r for r in over if r in set(slow)]}
    fast = sorted(r for u in faster for r in u)
    return {
        "culprits": [],
        "culprit_unknown": f"no majority: the slower side, ranks {slow}, outnumbers the faster, ranks "
        f"{fast} (split {len(slower)}-{len(faster)}), so it is measured against slow ranks: which of "
        "it are stragglers is unknown",
        "split": {"slower": slow, "faster": fast},
    }


def own_work(ends: Sequence[int], cum: Sequence[int]) -> list[tuple[int, float]]:
    """(step end ns, seconds of the rank's own work in the step): the step's time less what it waited in
    p2p (``cum``: ``pipeline_p2p.waited_by`` at each end); steps where that is unknown are left out."""
    return [
        (t1, (t1 - t0 - (c1 - c0)) / 1e9)
        for (t0, c0), (t1, c1) in pairwise(zip(ends, cum, strict=True))
        if c0 >= 0 and c1 >= c0
    ]


def stage_lags(works: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """rank -> its pipeline lag from (baseline, now, step time now) of its own work a step (step time
    less p2p waits; the baseline: its first warm steps): how much its work grew past its baseline
    beyond the median growth of the other ranks (a machine-wide slowdown changes every rank alike), as
    a share of the step: what the pipeline waits for it each step. A stage slower by design from the
    start scores 0; a stage of a few ms whose time doubles under load scores a few %."""
    change = {r: w[1] / w[0] for r, w in works.items() if w[0] > 0 and w[1] > 0 and w[2] > 0}
    out: dict[int, float] = {}
    for r in change:
        others = sorted(v for o, v in change.items() if o != r)
        if others:
            base, now, step = works[r]
            out[r] = max(0.0, now - base * median(others)) / step
    return out


# ------------------------------------------------------------------------------------------ latency


def quantile_from_counts(bounds: Sequence[float], counts: Sequence[int], q: float) -> float:
    """Upper bound of the bucket holding the q-quantile of per-bucket (non-cumulative) counts; the
    last count is the +Inf bucket. Matches what ``histogram_quantile`` reports at a bucket edge."""
    total = sum(counts)
    if total <= 0:
        return math.nan
    target = q * total
    acc = 0
    for i, c in enumerate(counts):
        acc += c
        if acc >= target:
            return bounds[i] if i < len(bounds) else math.inf
    return math.inf


def bucket_of(bounds: Sequence[float], value: float) -> int:
    return bisect.bisect_left(bounds, value)


# ------------------------------------------------------------------------------------------ hang


#: Steps a rank's count may fall behind a peer's before it reads as idle (it stopped stepping while the
#: others go on: out of data under DDP's ``Join``): synchronous ranks are within a step of each other.
IDLE_STEPS = 3


def steps_behind(peers: Mapping[int, Mapping[str, Any]], rank: int, steps_done: int) -> int:
    """How many steps the furthest peer (its published count) is ahead of this rank, 0 if none is: a
    peer's count is older than this rank's, never newer, so this is never more than the truth."""
    counts = [p["step"] for r, p in peers.items() if r != rank and isinstance(p.get("step"), int)]
    return max(0, max(counts, default=steps_done) - steps_done)


def stalled_seconds(now: float, last_step_ts: float, steps_done: int, warmup_steps: int) -> float:
    """Seconds since the last step completed; 0 until warm-up (the first steps compile for minutes)."""
    if steps_done < warmup_steps or last_step_ts <= 0:
        return 0.0
    return max(0.0, now - last_step_ts)


def hang_timeout(default_s: float, pg_timeout_s: float | None, median_step_s: float | None) -> float:
    """The silence that counts as a hang: the default, raised to 10 median steps for slow jobs, and
    kept below the process-group timeout (80%) so evidence is taken before the watchdog aborts."""
    t = default_s
    if median_step_s:
        t = max(t, 10 * median_step_s)
    if pg_timeout_s:
        t = min(t, 0.8 * pg_timeout_s)
    return t
