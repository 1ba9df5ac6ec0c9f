"""Detector signals, pure functions on synthetic shapes (failing and clean): leaks, replicas, collective
mismatches and their memo, arrival lag, hangs, latency quantiles, sharded parameters, packed FR entries."""

from __future__ import annotations

import json

import pytest

from hpar_agent import catalogue as cat
from hpar_agent.collectors.pipeline_p2p import waited_by
from hpar_agent.detectors import signals as sig

MiB = 1 << 20


LEAK = {"warmup_steps": 5, "window": 20, "min_slope": float(MiB), "min_increase_fraction": 0.2}


def _fr(
    pg: str, seq: int, op: str = "all_reduce", sizes: str = "[[4]]", dt: str = "Float", t: int = 0
) -> tuple:
    return (pg, seq, op, sizes, dt, t)


def test_leak_fires_on_steady_and_stair_step_growth() -> None:
    steady = [(s, 1e9 + 4 * MiB * s) for s in range(40)]
    stairs = [(s, 1e9 + 8 * MiB * (s // 4)) for s in range(40)]  # +8 MiB every 4th step
    for samples in (steady, stairs):
        slope, leaking = sig.leak_signal(samples, **LEAK)
        assert leaking and slope >= MiB


def test_leak_quiet_on_plateau_checkpoint_and_noise() -> None:
    plateau = [(s, 1e9 + 50 * MiB * min(s, 12)) for s in range(40)]  # allocator grows, then plateaus
    checkpoint = [(s, 1e9 + (300 * MiB if s >= 25 else 0)) for s in range(40)]  # one jump, stays
    pause = [(s, 1e9 + (300 * MiB if s == 25 else 0)) for s in range(40)]  # one spike
    noise = [(s, 1e9 + ((s * 7919) % 13) * 300_000) for s in range(40)]
    for samples in (plateau, checkpoint, pause, noise):
        assert not sig.leak_signal(samples, **LEAK)[1]
    assert not sig.leak_signal([(s, 4 * MiB * s) for s in range(12)], **LEAK)[1]  # too few post-warm-up


def test_time_to_full_at_a_slope() -> None:
    assert sig.time_to_full(100 * MiB, 8 * MiB, 40, 0.5) == (53, 6.25)  # 12.5 steps left: full in the 13th
    assert sig.time_to_full(100 * MiB, 8 * MiB, 40, None) == (53, None)
    assert sig.time_to_full(-MiB, 8 * MiB, 40, 0.5) == (40, 0.0)  # already past it
    assert sig.time_to_full(100 * MiB, 0.0, 40, 0.5) is None and sig.time_to_full(MiB, -1.0, 0, 1.0) is None


def test_theil_sen_ignores_an_outlier() -> None:
    pts = [(float(x), 2.0 * x) for x in range(10)]
    pts[4] = (4.0, 1000.0)
    assert sig.theil_sen_slope(pts) == pytest.approx(2.0)


def test_odd_ranks_majority_and_tie() -> None:
    assert sig.odd_ranks({0: 1, 1: 1, 2: 7, 3: 1}) == {2}
    assert sig.odd_ranks({0: 1, 1: 2}) == {0, 1}
    assert sig.odd_ranks({0: 5, 1: 5}) == set()


def test_outvoted_needs_a_clear_majority_else_names_everyone_of_the_split() -> None:
    assert sig.outvoted({0: 1, 1: 1, 2: 1, 3: 1, 4: 2}) == {4}  # 4-1
    assert sig.outvoted({0: 1, 1: 1, 2: 1, 3: 2, 4: 2}) == {0, 1, 2, 3, 4}  # 3-2: who is wrong is unknown
    assert sig.outvoted({0: 1, 1: 1, 2: 2}) == {2} and sig.outvoted({0: 1, 1: 2}) == {0, 1}
    assert sig.outvoted({r: 1 if r < 6 else 2 for r in range(8)}) == {6, 7}  # 6-2
    got = sig.culprits_of({0: 1, 1: 2, 2: 1, 3: 2, 4: 1})
    assert got["culprits"] == [] and got["split"] == [[0, 2, 4], [1, 3]]
    assert "no majority" in got["culprit_unknown"] and "split 3-2" in got["culprit_unknown"]
    assert sig.culprits_of({0: 1, 1: 1, 2: 1, 3: 1, 4: 2}) == {"culprits": [4]}


def test_replica_offenders_dp_and_tp_subset() -> None:
    same = {"w": [1.5, 3.0], "b": [0.25, 0.25]}
    sums = {0: same, 1: same, 2: {"w": [1.5000001, 3.0], "b": [0.25, 0.25]}}
    assert sig.replica_offenders(sums) == {2: ["w"]}
    assert sig.replica_offenders(sums, names=["b"]) == {}
    nan = {0: {"w": [float("nan"), 1.0]}, 1: {"w": [float("nan"), 1.0]}}
    assert sig.replica_offenders(nan) == {}


def test_collective_mismatch_by_majority_and_partial_windows() -> None:
    good = [_fr("dp@0,0", s) for s in range(5)]
    bad = [*good[:3], _fr("dp@0,0", 3, dt="BFloat16"), _fr("dp@0,0", 4, sizes="[[8]]")]
    out = sig.collective_mismatches({0: good, 1: good, 2: bad})
    assert set(out) == {2} and [m["seq"] for m in out[2]] == [3, 4]
    # rank 1's window moved on: seq 0-1 are not compared, nothing is flagged
    assert sig.collective_mismatches({0: good, 1: good[2:]}) == {}
    # a member that has not published yet must not turn a majority into a tie
    assert sig.collective_mismatches({0: good, 2: bad}, sizes={"dp@0,0": 3}) == {}


def test_collective_mismatch_tie_goes_to_the_narrow_dtype() -> None:
    good = [_fr("dp@0,0", s) for s in range(3)]
    bf16 = [*good[:2], _fr("dp@0,0", 2, sizes="[[8]]", dt="BFloat16")]
    assert set(sig.collective_mismatches({0: good, 1: bf16})) == {0, 1}  # no majority, no dtype rule
    assert set(sig.collective_mismatches({0: good, 1: bf16}, param_bits=32)) == {1}
    assert set(sig.collective_mismatches({0: good, 1: bf16}, param_bits=16)) == {0, 1}  # bf16 model: no rule


def test_low_precision_reduction_only_on_gradient_groups() -> None:
    entries = [_fr("dp@0,0", 1, dt="BFloat16"), _fr("tp@0,0", 1, dt="BFloat16"), _fr("dp@0,0", 2)]
    low = sig.low_precision_reductions(entries, 32, ["dp@0,0"])
    assert [e[1] for e in low] == [1] and low[0][0] == "dp@0,0"
    assert sig.low_precision_reductions(entries, 16, ["dp@0,0"]) == []


STEP = 300_000_000


def _steps(
    work: dict[int, float], n_ranks: int = 3, steps: int = 20, buckets: int = 4, tp: bool = False
) -> tuple[dict[int, list[tuple]], list[int]]:
    """``steps`` steps of 0.2 s of compute on every rank (``work[rank]`` x as long on that rank), its
    gradients reduced in ``buckets`` all-reduces enqueued as they are ready, without waiting; with ``tp``
    every rank first waits for all in a blocking tp all-reduce 10 ms in. Each step ends once every rank
    entered its last bucket, +5 ms. Returns every rank's entries and the step ends."""
    out: dict[int, list[tuple]] = {r: [] for r in range(n_ranks)}
    ends, start = [0], 0
    for s in range(steps):
        free = start
        if tp:
            at = {r: start + int(10_000_000 * work.get(r, 1.0)) for r in range(n_ranks)}
            for r in range(n_ranks):
                out[r].append(_fr("tp@0,0", s, t=at[r]))
            free = max(at.values())
        last = 0
        for r in range(n_ranks):
            t = free
            for k in range(buckets):
                t += int(0.2 * STEP / 0.3 / buckets * work.get(r, 1.0))
                out[r].append(_fr("dp@0,0", s * buckets + k, t=t))
            last = max(last, t)
        start = last + 5_000_000
        ends.append(start)
    return out, ends


def test_step_delays_count_a_late_rank_once_a_step_whatever_the_buckets() -> None:
    for buckets in (1, 2, 4, 8):  # rank 2 computes 1.5x as long: 0.5 a step, 1/3 of its own time
        entries, ends = _steps({2: 1.5}, buckets=buckets)
        shares = sig.step_delays(entries, ends)
        assert sig.delay_score(list(shares[2].values())) == pytest.approx(1 / 3, abs=0.02), buckets
        assert max(max(shares[r].values()) for r in (0, 1)) < 0.01
        entries, ends = _steps({2: 1.1}, buckets=buckets)  # 10 % slower: 0.09, under the 0.25 threshold
        assert sig.delay_score(list(sig.step_delays(entries, ends)[2].values())) < 0.12


def test_step_delays_charge_the_slow_rank_not_those_that_waited_for_it() -> None:
    # rank 1 is slow before the tp all-reduce (3x its 10 ms); ranks 0 and 2 wait there, and so reach
    # their buckets late too: victims, not culprits
    entries, ends = _steps({1: 3.0}, tp=True, buckets=4)
    shares = sig.step_delays(entries, ends)
    assert min(shares[1].values()) > 0.05
    assert max(max(shares[r].values()) for r in (0, 2)) < 0.01


def test_step_delays_judge_only_steps_every_window_covers_and_not_again() -> None:
    entries, ends = _steps({2: 1.5}, steps=10)
    entries[0] = entries[0][8:]  # rank 0's window starts two steps later
    shares = sig.step_delays(entries, ends)
    # judged: steps 3-8 (ends[4..9]): rank 0 has nothing before step 2, nobody anything after step 9
    assert sorted(shares[2]) == ends[4:10] and shares[2][ends[4]] == pytest.approx(0.5, abs=0.01)
    assert sig.step_delays(entries, ends, after=ends[8]) == {r: {ends[9]: shares[r][ends[9]]} for r in shares}
    assert sig.step_delays(entries, ends[:2]) == {}


def test_delay_score_is_the_median_share_of_the_ranks_own_time() -> None:
    assert sig.delay_score([0.5] * 9 + [40.0]) == pytest.approx(1 / 3)  # one 5x spike is one step
    assert sig.delay_score([]) == 0.0
    assert sig.delay_score([-0.3] * 5) == 0.0 and sig.pace([-0.3] * 5) == pytest.approx(-0.3)


def test_a_rank_among_slower_ones_is_ahead_by_what_they_would_score_against_it() -> None:
    """Ranks 1-3 of four are 1.5x slower: rank 0's reference, the median of the others, is a slow
    rank; it is ahead by a third of that rank's step (-0.33), what a 1.5x rank scores against healthy
    ones. The slow ranks, compared with two slow and one healthy, score nothing."""
    entries, ends = _steps({1: 1.5, 2: 1.5, 3: 1.5}, n_ranks=4)
    paces = {r: sig.pace(list(v.values())) for r, v in sig.step_delays(entries, ends).items()}
    assert paces[0] == pytest.approx(-1 / 3, abs=0.02) and all(abs(paces[r]) < 0.01 for r in (1, 2, 3))


def _culprits(paces: dict[int, float], units: list[list[int]] | None = None) -> dict:
    return sig.slow_culprits(paces, units or [[r] for r in paces], set(paces), 0.25)


def test_slow_ranks_are_named_only_where_the_faster_side_is_at_least_as_large() -> None:
    """Paces of 1.5x slower ranks among healthy ones, as a view of five (or eight) sees them: named
    where each slower rank's reference (the median of the others) is a faster rank; where the slower
    side is larger, no culprit: "no majority" and the split, slower side first."""
    assert _culprits({0: 0.0, 1: 0.0, 2: 0.01, 3: 0.0, 4: 0.33}) == {"culprits": [4]}  # 4-1
    assert _culprits({0: -0.2, 1: -0.19, 2: -0.2, 3: 0.33, 4: 0.34}) == {"culprits": [3, 4]}  # 3-2
    eight = {r: -0.33 if r < 4 else 0.33 for r in range(8)}  # 4-4: each slow rank's others are 4-3
    assert _culprits(eight) == {"culprits": [4, 5, 6, 7]}
    for paces, slower in [
        ({0: -0.33, 1: -0.34, 2: 0.17, 3: 0.16, 4: 0.17}, [2, 3, 4]),  # 2-3: slow references
        ({0: -0.33, 1: 0.0, 2: 0.01, 3: 0.0, 4: -0.01}, [1, 2, 3, 4]),  # 1-4: slow all but one
        ({r: 0.3 if r > 2 else -0.33 for r in range(8)}, [3, 4, 5, 6, 7]),  # 3-5 of eight
    ]:
        got = _culprits(paces)
        assert got["culprits"] == [] and got["culprit_unknown"].startswith("no majority"), got
        assert got["split"] == {"slower": slower, "faster": sorted(set(paces) - set(slower))}
    # a tp group slow across its compute is one replica against four: named whole
    group = {r: 0.33 for r in range(8)} | {r: 0.0 for r in (8, 9, 10, 11)}
    units = [list(range(8)), [8], [9], [10], [11]]
    assert _culprits(group, units) == {"culprits": list(range(8))}
    ahead = {r: 0.0 for r in range(8)} | {8: -0.33, 9: -0.34, 10: 0.01, 11: 0.0}  # 2 replicas of 5
    assert _culprits(ahead, units)["split"] == {"slower": [*range(8), 10, 11], "faster": [8, 9]}


def test_gpus_a_few_percent_apart_make_no_split() -> None:
    """Paces spread over 0.3 with no two sides (fixed per-GPU speeds), none ahead past the limit."""
    paces = {0: -0.22, 1: -0.05, 2: 0.0, 3: 0.06, 4: 0.1}
    assert sig.pace_sides(paces, [[r] for r in paces], 0.25) is None and _culprits(paces) == {"culprits": []}


def test_hang_timeout_and_warmup() -> None:
    assert sig.stalled_seconds(1000.0, 900.0, steps_done=1, warmup_steps=2) == 0.0
    assert sig.stalled_seconds(1000.0, 900.0, steps_done=5, warmup_steps=2) == 100.0
    assert sig.hang_timeout(60, None, 0.3) == 60
    assert sig.hang_timeout(60, None, 20.0) == 200  # slow steps: 10 steps of silence
    assert sig.hang_timeout(60, 30.0, None) == 24  # below the pg timeout


def test_quantile_from_counts_uses_bucket_upper_bound() -> None:
    bounds = cat.LATENCY_BUCKETS
    counts = [0] * (len(bounds) + 1)
    counts[sig.bucket_of(bounds, 0.05)] = 99
    counts[sig.bucket_of(bounds, 0.3)] = 1
    assert sig.quantile_from_counts(bounds, counts, 0.99) == 0.085
    counts[sig.bucket_of(bounds, 0.3)] = 5
    assert sig.quantile_from_counts(bounds, counts, 0.99) == 0.46


def _window(n: int) -> list[tuple]:
    """n entries of a job repeating a few kinds: dp all-reduces, tp all-gathers in two shapes, increasing times."""
    t0, out = 1_700_000_000_123_456_789, []
    for i in range(n):
        if i % 4 == 3:
            e = _fr("tp@0,0", i // 4, "all_gather", "[[8, 16]]" if i % 8 == 3 else "[[2]]", "BFloat16")
        else:
            e = _fr("dp@0,0", i - i // 4, dt="Float" if i % 2 else "Float,Float")
        out.append((*e[:5], t0 + 1_000_000 * i + (i * 7919) % 1000))
    return out


def _us(entries: list[tuple]) -> list[tuple]:
    """The entries as the exchange carries them: times floored to the µs."""
    return [(*e[:5], e[5] // 1000 * 1000) for e in entries]


def test_pack_fr_round_trips_through_json_storing_each_kind_once() -> None:
    entries = _window(40)
    packed = json.loads(json.dumps(sig.pack_fr(entries)))
    back = sig.unpack_fr(packed)
    assert back == _us(entries) and all(type(e) is tuple for e in back)
    assert len(packed["k"]) == len({(e[0], e[2], e[3], e[4]) for e in entries}) == 4
    assert len(packed["e"]) == 3 * len(entries)


def test_pack_fr_is_much_smaller_than_lists_for_a_repetitive_window() -> None:
    """A run 10 million collectives in (7-digit seqs), entries ms apart: each entry's seq is its group's
    last plus 1 and its time a few µs digits, ~10 bytes where seq and ns took ~18."""
    entries = [(e[0], e[1] + 10_000_000, *e[2:]) for e in _window(1024)]
    packed = json.dumps(sig.pack_fr(entries), separators=(",", ":"))
    lists = json.dumps([list(e) for e in entries], separators=(",", ":"))
    assert len(packed) < len(lists) / 6 and len(packed) < 10.5 * 1024
    seqs = json.loads(packed)["e"][1::3]  # each group's first (dp: entry 0, tp: 3) whole, then +1
    assert seqs[0] == seqs[3] == 10_000_000 and set(seqs[1:3] + seqs[4:]) == {1}
    assert sig.unpack_fr(json.loads(packed)) == _us(entries)


def test_running_totals_travel_as_their_increases() -> None:
    totals = [-1, -1, 5_000_000, 5_000_000, 412_000_000_000, 412_000_000_000, 412_005_000_000]
    packed = json.loads(json.dumps(sig.pack_totals(totals)))
    assert sig.unpack_totals(packed) == totals and packed["d"][3] == 0
    for bad in (None, [1, 2], {"d": "x"}, {"d": [1, "2"]}, {"d": [1.5]}):
        assert sig.unpack_totals(bad) is None, bad


def test_pack_fr_of_nothing_is_nothing() -> None:
    assert sig.unpack_fr(json.loads(json.dumps(sig.pack_fr([])))) == []
    assert sig.unpack_fr([]) == []


def test_unpack_fr_of_malformed_payloads_is_empty_and_never_raises() -> None:
    kind = ["dp@0,0", "all_reduce", "[[4]]", "Float"]
    for bad in (
        "garbage",
        None,
        17,
        {},
        {"k": [kind], "e": [5, 0, 0], "u0": 0},  # kind index out of range
        {"k": [kind], "e": [0, 0, 0]},  # no u0
        {"k": [kind], "e": [0, 0, 0], "t0": 0},  # the older form (seqs and ns): read as nothing
        {"e": [0, 0, 0], "u0": 0},  # no kinds
        {"k": [kind], "u0": 0},  # no entries
        {"k": [["dp@0,0"]], "e": [0, 0, 0], "u0": 0},  # a kind short of fields
        {"k": 3, "e": [0, 0, 0], "u0": 0},
        {"k": [kind], "e": [0, 0, 0], "u0": "soon"},
        {"k": [kind], "e": [0, "1", 0], "u0": 0},  # a seq that is no number
    ):
        assert sig.unpack_fr(bad) == [], bad


def test_unpack_fr_reads_the_older_list_form() -> None:
    old = [
        ["dp@0,0", 0, "all_reduce", "[[4]]", "Float", 5],
        ["dp@0,0", 1],
        "x",
        ("tp@0,0", 1, "all_gather", "[[2]]", "Half", 6),
        ["dp@0,0", 2, "all_reduce", "[[4]]", "Float", 9, 0],
    ]
    back = sig.unpack_fr(json.loads(json.dumps(old)))
    assert back == [
        ("dp@0,0", 0, "all_reduce", "[[4]]", "Float", 5),
        ("tp@0,0", 1, "all_gather", "[[2]]", "Half", 6),
    ]
    assert all(type(e) is tuple for e in back)
    assert sig.unpack_fr(back) is back  # unpacked already (the detectors read the peers' entries again)


def test_collective_mismatches_answer_the_same_with_the_memo_warm() -> None:
    memo: sig.OddMemo = {}  # kept from call to call, as CollectiveMismatch keeps it
    good = [_fr("dp@0,0", s) for s in range(6)]
    bad = [*good[:3], _fr("dp@0,0", 3, dt="BFloat16"), *good[4:]]
    cold = sig.collective_mismatches({0: list(good), 1: list(good), 2: list(bad)}, memo=memo)
    assert set(cold) == {2} and [m["seq"] for m in cold[2]] == [3] and memo  # the kinds judged are kept
    cold[2].clear()  # a caller's copy: changing it changes no later answer
    for _ in range(3):
        assert sig.collective_mismatches({0: list(good), 1: list(good), 2: list(bad)}, memo=memo) == {
            2: [{"pg": "dp@0,0", "seq": 3, "op": "all_reduce", "sizes": "[[4]]", "dtypes": "BFloat16"}]
        }
    assert sig.collective_mismatches({r: list(good) for r in range(3)}, memo=memo) == {}


def test_collective_mismatches_memo_tells_apart_which_rank_holds_which_kind() -> None:
    memo: sig.OddMemo = {}  # kept from call to call, as CollectiveMismatch keeps it
    good = [_fr("dp@0,0", s) for s in range(4)]
    assert (
        sig.collective_mismatches({r: list(good) for r in range(3)}, memo=memo) == {}
    )  # every kind judged "all agree"
    bf16 = [*good[:2], _fr("dp@0,0", 2, dt="BFloat16"), good[3]]
    gather = [*good[:2], _fr("dp@0,0", 2, op="all_gather"), good[3]]
    assert {
        r: [m["seq"] for m in v]
        for r, v in sig.collective_mismatches({0: good, 1: good, 2: bf16}, memo=memo).items()
    } == {2: [2]}
    # the same kinds as the window before, held by other ranks: the odd one is rank 1 now
    assert set(sig.collective_mismatches({0: list(good), 1: list(bf16), 2: list(good)}, memo=memo)) == {1}
    out = sig.collective_mismatches({0: list(gather), 1: list(good), 2: list(good)}, memo=memo)
    assert set(out) == {0} and out[0][0]["op"] == "all_gather"


def test_collective_mismatches_tie_break_by_param_bits_survives_the_memo() -> None:
    memo: sig.OddMemo = {}  # kept from call to call, as CollectiveMismatch keeps it
    good = [_fr("dp@0,0", s) for s in range(3)]
    bf16 = [*good[:2], _fr("dp@0,0", 2, sizes="[[8]]", dt="BFloat16")]
    for _ in range(2):  # either order, cold or warm
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)}, param_bits=32, memo=memo)) == {1}
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)}, memo=memo)) == {0, 1}
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)}, param_bits=16, memo=memo)) == {
            0,
            1,
        }
    # the narrow rank is the odd one whichever rank it is
    assert set(sig.collective_mismatches({0: list(bf16), 1: list(good)}, param_bits=32, memo=memo)) == {0}


def test_odd_entries_memo_is_bounded() -> None:
    memo: sig.OddMemo = {}
    for i in range(5000):
        sig._odd_entries(
            {0: _fr("dp@0,0", 0, sizes=f"[[{i}]]"), 1: _fr("dp@0,0", 0, sizes=f"[[{i}]]")}, None, memo
        )
        assert len(memo) <= 4096
    assert sig._odd_entries(
        {0: _fr("dp@0,0", 0), 1: _fr("dp@0,0", 0, dt="Half"), 2: _fr("dp@0,0", 0)}, None, memo
    ) == (1,)


def test_peer_reduction_bits_widest_per_message_over_peers_only() -> None:
    own = [_fr("dp@0,0", s, sizes="[[8]]", dt="Float64") for s in range(3)]  # 64 bytes: only this rank
    own.append(
        _fr("dp@0,0", 3, sizes="[[4]]", dt="Float64")
    )  # 32 bytes, 64 bits: must not widen a peer's key
    narrow = [_fr("dp@0,0", s, sizes="[[8]]", dt="BFloat16") for s in range(20)]  # 16 bytes, 16 bits
    wide = [_fr("dp@0,0", s, sizes="[[4]]", dt="Float") for s in range(20)]  # 16 bytes, 32 bits
    other = [
        _fr("dp@0,0", 0, sizes="[[8]]", dt="Float"),  # 32 bytes, 32 bits
        _fr("tp@0,0", 1, op="reduce_scatter", sizes="[[2]]", dt="Half"),  # 4 bytes, 16 bits
        _fr("dp@0,0", 2, op="all_gather", sizes="[[4]]", dt="Float64"),  # not a reduction
        _fr("dp@0,0", 3, sizes="[[4]]", dt="Long"),
    ]  # no floating dtype
    want = {
        ("dp@0,0", "all_reduce", 16): 32,
        ("dp@0,0", "all_reduce", 32): 32,
        ("tp@0,0", "reduce_scatter", 4): 16,
    }
    assert sig.peer_reduction_bits({0: own, 1: narrow, 2: wide, 3: other}, 0) == want
    assert sig.peer_reduction_bits({3: other, 2: wide, 1: narrow, 0: own}, 0) == want  # any order of peers
    assert sig.peer_reduction_bits({0: own, 1: narrow}, 0) == {("dp@0,0", "all_reduce", 16): 16}
    assert sig.peer_reduction_bits({0: own}, 0) == {}
    assert sig.peer_reduction_bits({0: own, 1: narrow}, 1)[("dp@0,0", "all_reduce", 64)] == 64  # rank 1 asks


def test_same_shard_offenders_compare_shards_only_across_replicas() -> None:
    # HSDP 2x2: ranks 0,1 hold shards 0,1 of replica 0; ranks 2,3 the same shards of replica 1.
    keys = {r: {"w": f"dp_shard={r % 2}"} for r in range(4)}
    sums = {
        0: {"w": [1.0, 1.0], "b": [5.0, 5.0]},
        1: {"w": [2.0, 2.0], "b": [5.0, 5.0]},
        2: {"w": [1.0, 1.0], "b": [5.0, 5.0]},
        3: {"w": [2.0, 2.0], "b": [5.0, 5.0]},
    }
    for r in range(4):  # different shards differ: that is correct
        assert sig.same_shard_offenders(sums, keys, r) == []
    sums[3] = {"w": [2.5, 2.5], "b": [5.0, 5.0]}  # replica 1's shard 1 missed the replicate all-reduce
    assert [sig.same_shard_offenders(sums, keys, r) for r in range(4)] == [
        [],
        ["w"],
        [],
        ["w"],
    ]  # a 1-1 split: who of the shard's two holders is wrong is unknown, the other shard's are not in it
    assert [sig.unsplittable(sums, keys, r) for r in range(4)] == [[], [1, 3], [], [1, 3]]
    sums[2]["b"] = [6.0, 6.0]  # a whole (replicated) parameter compares across all four: 3-1 majority
    assert sig.same_shard_offenders(sums, keys, 2) == ["b"] and sig.same_shard_offenders(sums, keys, 0) == []
    assert sig.unsplittable(sums, keys, 2) == []  # rank 2 is the culprit of "b"
    fsdp = {r: {"w": f"dp_shard={r}"} for r in range(2)}  # plain FSDP: nothing to compare
    assert sig.same_shard_offenders({0: {"w": [1.0, 1.0]}, 1: {"w": [9.0, 9.0]}}, fsdp, 0) == []


def test_entry_bytes_and_narrower_than_peers() -> None:
    fp32 = ("dp@0", 1, "all_reduce", "[[8]]", "Float", 0)
    padded_bf16 = ("dp@0", 1, "all_reduce", "[[16]]", "BFloat16", 0)  # the same 32 bytes, in bf16
    assert sig.entry_bytes(fp32) == sig.entry_bytes(padded_bf16) == 32
    assert sig.entry_bytes(("dp@0", 1, "all_reduce", "[[2, 3], [4]]", "Float,Float", 0)) == 40
    peers = sig.peer_reduction_bits({0: [fp32], 1: [padded_bf16]}, rank=1)
    assert sig.narrower_than_peers([padded_bf16], peers) == [padded_bf16]
    agreed = sig.peer_reduction_bits({0: [padded_bf16], 1: [padded_bf16]}, rank=1)
    assert sig.narrower_than_peers([padded_bf16], agreed) == []
    loss = ("dp@0", 2, "all_reduce", "[[]]", "Float", 0)  # an fp32 scalar on the same group: other bytes
    assert sig.narrower_than_peers([padded_bf16], sig.peer_reduction_bits({0: [loss]}, rank=1)) == []


@pytest.mark.parametrize(
    ("sizes", "dtypes", "expect"),
    [
        ("[[1024, 4]]", "Float", 16384),
        ("[[8], [8]]", "BFloat16", 32),
        ("", "Float", 0),
        ("[[2", "Float", -1),
        ("[[4]]", "Long", -1),
    ],
)
def test_entry_bytes_cached_gives_the_same_answers(sizes: str, dtypes: str, expect: int) -> None:
    e = ("dp@0", 1, "allreduce", sizes, dtypes, 0)
    assert sig.entry_bytes(e) == expect
    assert sig.entry_bytes(e) == expect  # a cache hit
    assert sig._message_bytes.cache_info().hits >= 1


def _dp_pp(slow: float, steps: int = 12) -> tuple[dict, list[int], dict[int, dict[int, int]]]:
    """dp2 x pp2 (rank = replica * 2 + stage), one microbatch a step: stage 0 works 10 ms, waits for
    stage 1's 20 ms (rank 3's ``slow`` times that), works 10 ms more, then each stage all-reduces with
    its replica. Returns (entries, step ends, rank -> entry time -> ns waited in p2p by then)."""
    ms = 1_000_000
    entries: dict[int, list[tuple]] = {r: [] for r in range(4)}
    cum = dict.fromkeys(range(4), 0)
    waited: dict[int, dict[int, int]] = {r: {} for r in range(4)}
    start, ends = 1_700_000_000_000_000_000, []
    for seq in range(steps):
        arrive = {}
        for replica in (0, 1):
            s0, s1 = replica * 2, replica * 2 + 1
            work1 = int(20 * ms * (slow if s1 == 3 else 1.0))
            cum[s1] += 10 * ms  # stage 1 waits for stage 0's activations
            arrive[s1] = start + 10 * ms + work1
            cum[s0] += work1  # stage 0 waits for stage 1's gradients
            arrive[s0] = arrive[s1] + 10 * ms
        for r, t in arrive.items():
            entries[r].append((f"dp@{r % 2}", seq, "allreduce", "[[8]]", "Float", t))
            waited[r][t] = cum[r]
        start = max(arrive.values()) + ms
        ends.append(start)
    return entries, ends, waited


def test_step_delays_count_a_stages_p2p_waits_as_waits_not_its_work() -> None:
    """Rank 3 (stage 1 of replica 1) works 2x: its stage-0 neighbour, rank 2, waits for it and reaches
    its all-reduce 20 ms after rank 0 does. Counted as work, rank 2 is named with it; net of its p2p
    waits, rank 3 alone."""
    entries, ends, waited = _dp_pp(2.0)
    stages = {r: r % 2 for r in range(4)}
    naive = sig.step_delays(entries, ends, stages)
    assert sig.delay_score(list(naive[2].values())) > 0.25  # the old view: the waiting stage is late
    shares = sig.step_delays(entries, ends, stages, waited=waited)
    scores = {r: sig.delay_score(list(v.values())) for r, v in shares.items()}
    assert scores[3] > 0.25 and max(scores[r] for r in (0, 1, 2)) < 0.05, scores


def test_waited_by_reads_the_cumulative_p2p_wait_at_each_time() -> None:
    log = [(100, 5), (200, 15), (300, 40)]
    assert waited_by(log, [50, 100, 250, 400]) == [-1, 5, 15, 40]
    assert sig.waited_between({100: 5, 300: 40}, 100, 300) == 35
    assert sig.waited_between({100: -1, 300: 40}, 100, 300) == 0


def test_own_work_is_the_step_less_its_p2p_waits() -> None:
    ends, cum = [0, 100_000_000, 200_000_000, 300_000_000], [-1, 10_000_000, 70_000_000, 80_000_000]
    assert sig.own_work(ends, cum) == [(200_000_000, 0.04), (300_000_000, 0.09)]


def test_stage_lags_name_a_change_against_its_baseline_not_a_stage_slow_by_design() -> None:
    # stage 3 does 30 % more work from the start; stage 2 became 2x slower; the machine 10 % slower
    works = {0: (0.01, 0.011, 0.05), 1: (0.01, 0.011, 0.05), 2: (0.01, 0.022, 0.05), 3: (0.013, 0.0143, 0.05)}
    lags = sig.stage_lags(works)
    assert lags[2] == pytest.approx(0.011 / 0.05) and max(lags[r] for r in (0, 1, 3)) < 0.01
    # a 2 ms stage that doubled in a 50 ms step: 4 % of the step, far under the threshold
    small = {0: (0.01, 0.01, 0.05), 1: (0.002, 0.004, 0.05), 2: (0.01, 0.01, 0.05)}
    assert sig.stage_lags(small)[1] == pytest.approx(0.04)
