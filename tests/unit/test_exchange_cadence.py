"""The cross-rank exchange's packed FR entries, memoized mismatch judgements, and publish-then-read cadence."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import pytest

from hpar_agent.agent import Agent
from hpar_agent.crossrank import Exchange
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors.component import DetectorsComponent
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from tests.unit.test_detectors import Fake, make_agent, steps


def _fr(pg: str, seq: int, op: str = "all_reduce", sizes: str = "[[4]]", dt: str = "Float", t: int = 0) -> tuple:
    return (pg, seq, op, sizes, dt, t)


@pytest.fixture
def store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.fixture(autouse=True)
def _fresh_memo() -> Any:
    """Each test judges from an empty ``_odd_memo``: what an earlier test left must not decide a verdict."""
    sig._odd_memo.clear()
    yield
    sig._odd_memo.clear()


# ------------------------------------------------------------------------------------------ pack_fr
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


def test_pack_fr_round_trips_through_json_storing_each_kind_once() -> None:
    entries = _window(40)
    packed = json.loads(json.dumps(sig.pack_fr(entries)))
    back = sig.unpack_fr(packed)
    assert back == entries and all(type(e) is tuple for e in back)
    assert len(packed["k"]) == len({(e[0], e[2], e[3], e[4]) for e in entries}) == 4
    assert len(packed["e"]) == 3 * len(entries)


def test_pack_fr_is_much_smaller_than_lists_for_a_repetitive_window() -> None:
    entries = _window(256)
    packed = json.dumps(sig.pack_fr(entries), separators=(",", ":"))
    lists = json.dumps([list(e) for e in entries], separators=(",", ":"))
    assert len(packed) < len(lists) / 3
    assert sig.unpack_fr(json.loads(packed)) == entries


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
        {"k": [kind], "e": [5, 0, 0], "t0": 0},  # kind index out of range
        {"k": [kind], "e": [0, 0, 0]},  # no t0
        {"e": [0, 0, 0], "t0": 0},  # no kinds
        {"k": [kind], "t0": 0},  # no entries
        {"k": [["dp@0,0"]], "e": [0, 0, 0], "t0": 0},  # a kind short of fields
        {"k": 3, "e": [0, 0, 0], "t0": 0},
        {"k": [kind], "e": [0, 0, 0], "t0": "soon"},
    ):
        assert sig.unpack_fr(bad) == [], bad


def test_unpack_fr_reads_the_older_list_form() -> None:
    old = [["dp@0,0", 0, "all_reduce", "[[4]]", "Float", 5], ["dp@0,0", 1], "x",
           ("tp@0,0", 1, "all_gather", "[[2]]", "Half", 6), ["dp@0,0", 2, "all_reduce", "[[4]]", "Float", 9, 0]]  # fmt: skip
    back = sig.unpack_fr(json.loads(json.dumps(old)))
    assert back == [("dp@0,0", 0, "all_reduce", "[[4]]", "Float", 5), ("tp@0,0", 1, "all_gather", "[[2]]", "Half", 6)]
    assert all(type(e) is tuple for e in back)
    assert sig.unpack_fr(back) is back  # unpacked already (the detectors read the peers' entries again)


# ------------------------------------------------------------------------------------------ mismatches
def test_collective_mismatches_answer_the_same_with_the_memo_warm() -> None:
    good = [_fr("dp@0,0", s) for s in range(6)]
    bad = [*good[:3], _fr("dp@0,0", 3, dt="BFloat16"), *good[4:]]
    cold = sig.collective_mismatches({0: list(good), 1: list(good), 2: list(bad)})
    assert set(cold) == {2} and [m["seq"] for m in cold[2]] == [3]
    cold[2].clear()  # a caller's copy: changing it changes no later answer
    for _ in range(3):
        assert sig.collective_mismatches({0: list(good), 1: list(good), 2: list(bad)}) == {
            2: [{"pg": "dp@0,0", "seq": 3, "op": "all_reduce", "sizes": "[[4]]", "dtypes": "BFloat16"}]}
    assert sig.collective_mismatches({r: list(good) for r in range(3)}) == {}


def test_collective_mismatches_memo_tells_apart_which_rank_holds_which_kind() -> None:
    good = [_fr("dp@0,0", s) for s in range(4)]
    assert sig.collective_mismatches({r: list(good) for r in range(3)}) == {}  # every kind judged "all agree"
    bf16 = [*good[:2], _fr("dp@0,0", 2, dt="BFloat16"), good[3]]
    gather = [*good[:2], _fr("dp@0,0", 2, op="all_gather"), good[3]]
    assert {r: [m["seq"] for m in v] for r, v in sig.collective_mismatches({0: good, 1: good, 2: bf16}).items()} == {2: [2]}
    # the same kinds as the window before, held by other ranks: the odd one is rank 1 now
    assert set(sig.collective_mismatches({0: list(good), 1: list(bf16), 2: list(good)})) == {1}
    out = sig.collective_mismatches({0: list(gather), 1: list(good), 2: list(good)})
    assert set(out) == {0} and out[0][0]["op"] == "all_gather"


def test_collective_mismatches_tie_break_by_param_bits_survives_the_memo() -> None:
    good = [_fr("dp@0,0", s) for s in range(3)]
    bf16 = [*good[:2], _fr("dp@0,0", 2, sizes="[[8]]", dt="BFloat16")]
    for _ in range(2):  # either order, cold or warm
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)}, param_bits=32)) == {1}
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)})) == {0, 1}
        assert set(sig.collective_mismatches({0: list(good), 1: list(bf16)}, param_bits=16)) == {0, 1}
    # the narrow rank is the odd one whichever rank it is
    assert set(sig.collective_mismatches({0: list(bf16), 1: list(good)}, param_bits=32)) == {0}


def test_odd_entries_memo_is_bounded() -> None:
    for i in range(5000):
        sig._odd_entries({0: _fr("dp@0,0", 0, sizes=f"[[{i}]]"), 1: _fr("dp@0,0", 0, sizes=f"[[{i}]]")}, None)
        assert len(sig._odd_memo) <= 4096
    assert sig._odd_entries({0: _fr("dp@0,0", 0), 1: _fr("dp@0,0", 0, dt="Half"), 2: _fr("dp@0,0", 0)}, None) == (1,)


def test_peer_reduction_bits_widest_per_message_over_peers_only() -> None:
    own = [_fr("dp@0,0", s, sizes="[[8]]", dt="Float64") for s in range(3)]  # 64 bytes: only this rank
    own.append(_fr("dp@0,0", 3, sizes="[[4]]", dt="Float64"))  # 32 bytes, 64 bits: must not widen a peer's key
    narrow = [_fr("dp@0,0", s, sizes="[[8]]", dt="BFloat16") for s in range(20)]  # 16 bytes, 16 bits
    wide = [_fr("dp@0,0", s, sizes="[[4]]", dt="Float") for s in range(20)]  # 16 bytes, 32 bits
    other = [_fr("dp@0,0", 0, sizes="[[8]]", dt="Float"),  # 32 bytes, 32 bits
             _fr("tp@0,0", 1, op="reduce_scatter", sizes="[[2]]", dt="Half"),  # 4 bytes, 16 bits
             _fr("dp@0,0", 2, op="all_gather", sizes="[[4]]", dt="Float64"),  # not a reduction
             _fr("dp@0,0", 3, sizes="[[4]]", dt="Long")]  # no floating dtype  # fmt: skip
    want = {("dp@0,0", "all_reduce", 16): 32, ("dp@0,0", "all_reduce", 32): 32, ("tp@0,0", "reduce_scatter", 4): 16}
    assert sig.peer_reduction_bits({0: own, 1: narrow, 2: wide, 3: other}, 0) == want
    assert sig.peer_reduction_bits({3: other, 2: wide, 1: narrow, 0: own}, 0) == want  # any order of peers
    assert sig.peer_reduction_bits({0: own, 1: narrow}, 0) == {("dp@0,0", "all_reduce", 16): 16}
    assert sig.peer_reduction_bits({0: own}, 0) == {}
    assert sig.peer_reduction_bits({0: own, 1: narrow}, 1)[("dp@0,0", "all_reduce", 64)] == 64  # rank 1 asks


# ------------------------------------------------------------------------------------------ cadence
def _entry(seq: int, t: float) -> dict[str, Any]:
    return {"pg": "dp", "seq": seq, "op": "all_reduce", "is_p2p": False, "record_id": seq,
            "input_sizes": [[4]], "input_dtypes": ["Float"], "time": t}  # fmt: skip


def _pair(store: Any, tmp_path: Any) -> list[tuple[DetectorsComponent, deque, Any, Agent]]:
    """Two dp ranks on one store at the default exchange thresholds: (detectors, FR window, steps, agent)."""
    out = []
    t = time.time()
    for r in range(2):
        window, st = deque((_entry(i, t + 0.01 * i) for i in range(8)), maxlen=2048), steps(10)
        agent, det = make_agent(tmp_path, rank=r, world=2, comps=(st, Fake("collectives", recent_entries=window)),
                                exchange=Exchange(store, "job", r), coords={"dp": r, "dpn": 2})  # fmt: skip
        agent.config.evidence = False
        assert det.exchange_s == COMPONENT_DEFAULTS["exchange_s"] == 3.0 and det.exchange_min_s == 1.0
        out.append((det, window, st, agent))
    return out


def _poll(pair: list, now: float) -> list[bool]:
    """One pass of every rank at the same wall-clock tick: each rank's ``peers_fresh`` after it."""
    for det, *_ in pair:
        det.poll(now)
    assert [dict(agent.errors) for *_, agent in pair] == [{}, {}]
    return [det.peers_fresh for det, *_ in pair]


def _published(pair: list) -> list[int]:
    return [det.exchange.published for det, *_ in pair]


def _seqs(det: DetectorsComponent, peer: int) -> list[int]:
    return [e[1] for e in det.peers[peer]["fr"]]


def _slot_start() -> float:
    """A tick at the start of an exchange slot (a multiple of ``exchange_s``): polls run at ticks."""
    return 3.0 * (time.time() // 3.0)


def test_ranks_publish_at_one_pass_and_read_each_other_at_the_next(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    assert _poll(pair, t0) == [False, False]  # published, nothing read in the same pass
    assert _published(pair) == [1, 1]
    assert _poll(pair, t0 + 1) == [True, True]  # read: both peers' payloads of the pass before
    assert _published(pair) == [1, 1]
    for det, *_ in pair:
        assert set(det.peers) == {0, 1} and _seqs(det, 1 - det.rank) == list(range(8))
        assert all(type(e) is tuple for e in det.peers[1 - det.rank]["fr"])  # unpacked on read
    assert _poll(pair, t0 + 2) == [False, False]  # read once per publish


def test_new_fr_entries_wait_for_the_regular_exchange(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    _poll(pair, t0)
    _poll(pair, t0 + 1)
    for _det, window, *_ in pair:  # the job runs on: new entries at every read
        window.extend(_entry(i, t0 + 0.01 * i) for i in range(8, 16))
    assert _poll(pair, t0 + 2) == [False, False]  # past exchange_min_s, yet nothing that is due early
    assert not any(st.streak for det, *_ in pair for st in det.states.values())  # no alert awaiting confirmation
    assert _published(pair) == [1, 1]
    for _det, window, *_ in pair:
        window.extend(_entry(i, t0 + 0.01 * i) for i in range(16, 20))
    assert _poll(pair, t0 + 3.0004) == [False, False]  # the next slot (a poll starts a little after its tick)
    assert _published(pair) == [2, 2]
    assert _poll(pair, t0 + 4) == [True, True]
    for det, *_ in pair:
        assert _seqs(det, 1 - det.rank) == list(range(20))


def test_warmup_token_change_publishes_after_exchange_min_s(store: Any, tmp_path: Any) -> None:
    pair = _pair(store, tmp_path)
    for _det, _window, st, _agent in pair:
        st.total = 1  # before the detectors' warm-up step
    t0 = _slot_start()
    _poll(pair, t0)
    for _det, _window, st, _agent in pair:
        st.total = 3  # warm-up step reached: peers act on it at once
    assert _poll(pair, t0 + 1) == [True, True] and _published(pair) == [2, 2]  # exchange_min_s on, same slot
    assert _poll(pair, t0 + 2) == [True, True]
    for det, *_ in pair:
        assert det.peers[1 - det.rank]["step"] == 3
    for _det, _window, st, _agent in pair:
        st.total = 10  # past warm-up: the token (capped at 3) is unchanged
    assert _published(pair) == [2, 2]
    assert _poll(pair, t0 + 2.9996) == [False, False] and _published(pair) == [3, 3]  # next slot: a poll a bit early


def test_a_rank_that_started_a_poll_late_publishes_in_the_same_slots(store: Any, tmp_path: Any) -> None:
    """Ranks attach and settle at different polls: the regular publishes still fall in the same
    polls on every rank, so what each reads was made at one instant (windows that overlap)."""
    pair = _pair(store, tmp_path)
    t0 = _slot_start()
    pair[0][0].poll(t0)  # rank 1's agent is not up yet
    assert _published(pair) == [1, 0]
    assert _poll(pair, t0 + 1) == [True, False] and _published(pair) == [1, 1]  # its first publish
    assert _poll(pair, t0 + 2) == [False, True] and _published(pair) == [1, 1]
    assert _poll(pair, t0 + 3) == [False, False] and _published(pair) == [2, 2]  # the same slot on both
    assert _poll(pair, t0 + 4) == [True, True]
