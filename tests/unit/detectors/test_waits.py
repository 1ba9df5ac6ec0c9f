"""waits.analyse: who a hang waits for, from each rank's per-group sequence numbers."""

from __future__ import annotations

from hpar_agent.detectors.waits import GroupState, P2PWait, analyse, chain_reads, p2p_text, p2p_waits


def _gs(enq: int, done: int | None = None, op: str = "all_reduce", age: float = 30.0) -> GroupState:
    return GroupState(enq, enq if done is None else done, op, age if done is not None and enq > done else 0.0)


def test_the_rank_that_never_entered_the_collective_is_the_culprit() -> None:
    # ranks 0, 1, 3 wait in all_reduce #46 of the world; rank 2 sleeps before it (its last: #45, done)
    states = {r: {"default_pg": _gs(46, 45)} for r in (0, 1, 3)} | {2: {"default_pg": _gs(45)}}
    v = analyse(states, {"default_pg": [0, 1, 2, 3]})
    assert (v.kind, v.culprits, v.victims) == ("missing", [2], [0, 1, 3])
    assert v.waits == [
        {"pg": "default_pg", "seq": 46, "op": "all_reduce", "waiting": [0, 1, 3], "missing": [2]}
    ]


def test_a_culprit_whose_last_word_shows_an_op_in_flight_is_still_the_culprit() -> None:
    # rank 2 published while its previous all-reduce (#45) looked in flight: it waits for nobody behind it
    states = {r: {"default_pg": _gs(46, 45)} for r in (0, 1, 3)} | {2: {"default_pg": _gs(45, 44)}}
    v = analyse(states, {"default_pg": [0, 1, 2, 3]})
    assert (v.kind, v.culprits, v.victims) == ("missing", [2], [0, 1, 3])
    assert [w["seq"] for w in v.waits] == [46]  # its own #45, which every member entered, explains nothing


def test_a_rank_never_heard_of_is_missing_from_its_groups() -> None:
    states = {r: {"default_pg": _gs(46, 45)} for r in (0, 1, 3)}
    assert analyse(states, {"default_pg": [0, 1, 2, 3]}).culprits == [2]


def test_a_chain_of_waits_names_its_root_only() -> None:
    # dp2 x tp2: rank 3 stuck outside; rank 2 waits in tp for 3; ranks 0 and 1 wait in dp for 2 and 3
    states = {
        0: {"dp@a": _gs(10, 9), "tp@x": _gs(20)},
        1: {"dp@b": _gs(10, 9), "tp@x": _gs(20)},
        2: {"dp@a": _gs(9), "tp@y": _gs(21, 20)},
        3: {"dp@b": _gs(9), "tp@y": _gs(20)},
    }
    members = {"dp@a": [0, 2], "dp@b": [1, 3], "tp@x": [0, 1], "tp@y": [2, 3]}
    v = analyse(states, members)
    assert (v.kind, v.culprits, v.victims) == ("missing", [3], [0, 1, 2])


def test_ranks_in_different_collectives_are_a_desync_named_by_the_minority() -> None:
    # rank 3 entered a world barrier the others never reach; they wait for it in their dp/tp all-reduces
    states = {
        0: {"default_pg": _gs(5), "tp@x": _gs(20, 19)},
        1: {"default_pg": _gs(5), "tp@x": _gs(20, 19)},
        2: {"default_pg": _gs(5), "dp@a": _gs(11, 10)},
        3: {"default_pg": _gs(6, 5, op="barrier"), "dp@a": _gs(10), "tp@y": _gs(19)},
    }
    members = {"default_pg": [0, 1, 2, 3], "tp@x": [0, 1, 3], "dp@a": [2, 3], "tp@y": [3]}
    v = analyse(states, members)
    assert (v.kind, v.culprits) == ("desync", [3])
    assert v.sides["default_pg: barrier"] == [3] and 2 in v.sides["dp: all_reduce"]


def test_a_desync_at_one_seq_with_no_majority_names_both_sides_and_no_culprit() -> None:
    # tp rank 0 of each pair runs a reduce the others do not (the wrong scope): a 1-1 split per group
    states = {0: {"tp@x": _gs(8, 7, op="all_reduce")}, 1: {"tp@x": _gs(8, 7, op="broadcast")}}
    v = analyse(states, {"tp@x": [0, 1]})
    assert (v.kind, v.culprits) == ("desync", [])
    assert v.sides == {"tp: all_reduce": [0], "tp: broadcast": [1]} and "unknown" in v.note


def test_a_wrong_scope_reduce_is_named_where_the_group_has_a_majority() -> None:
    # tp4: only tp rank 0 enters tp reduce #8; ranks 1-3 went on to a dp all-reduce that waits for rank 0
    states = {0: {"tp@x": _gs(8, 7), "dp@0": _gs(3)}} | {
        r: {"tp@x": _gs(7), "dp@" + str(r): _gs(4, 3)} for r in (1, 2, 3)
    }
    members = {"tp@x": [0, 1, 2, 3], "dp@0": [0], "dp@1": [1], "dp@2": [2], "dp@3": [3]}
    for r in (1, 2, 3):  # each waits for its dp peer, rank 0's replica... here rank 0 itself
        members["dp@" + str(r)] = [r, 0]
        states[0]["dp@" + str(r)] = _gs(3)
    v = analyse(states, members)
    assert (v.kind, v.culprits) == ("desync", [0])


def test_every_member_inside_the_same_collective_is_stuck_with_no_culprit() -> None:
    states = {r: {"default_pg": _gs(46, 45)} for r in range(4)}
    v = analyse(states, {"default_pg": [0, 1, 2, 3]})
    assert (v.kind, v.culprits, v.victims) == ("stuck", [], [0, 1, 2, 3]) and "does not complete" in v.note


def test_members_beyond_the_view_leave_the_culprit_unknown() -> None:
    states = {r: {"dp@0": _gs(46, 45)} for r in range(4)}
    v = analyse(states, {"dp@0": [0, 1, 2, 3]}, complete={"dp@0": False})
    assert (v.kind, v.culprits) == ("unknown", []) and "HparHangCulprit" in v.note


def test_short_waits_are_not_waits() -> None:
    states = {0: {"default_pg": GroupState(46, 45, "all_reduce", 0.01)}, 1: {"default_pg": _gs(45)}}
    assert analyse(states, {"default_pg": [0, 1]}).kind == "none"


def test_a_peers_malformed_state_is_ignored() -> None:
    assert GroupState.unpack(["x", 1, "op", 0]) is None and GroupState.unpack(None) is None
    st = GroupState(5, 4, "all_reduce", 12.5)
    assert GroupState.unpack(st.pack()) == st


def _pw(op: str, peer: int, age: float = 30.0) -> P2PWait:
    return P2PWait(op, peer, "pp", age)


def test_a_pipelines_chain_of_p2p_waits_names_the_stage_it_ends_at() -> None:
    # 4 stages, one rank each, no collective at all: stage 2 sleeps; stage 3 waits for its activations,
    # stage 1 for its gradients, stage 0 for stage 1's gradients
    p2p = {0: [_pw("recv", 1)], 1: [_pw("recv", 2)], 3: [_pw("recv", 2)], 2: []}
    v = analyse({r: {} for r in range(4)}, {}, p2p=p2p, seen=range(4))
    assert (v.kind, v.culprits, v.victims) == ("missing", [2], [0, 1, 3])
    assert v.waits[0] == {"pg": "pp", "op": "recv", "peer": 2, "p2p": True, "waiting": [1, 3], "missing": [2]}
    assert p2p_text(v.waits[0]) == "recv from rank 2"


def test_p2p_and_collective_waits_meet_in_one_graph() -> None:
    # dp2 x pp2 (stage 0: ranks 0, 2; stage 1: ranks 1, 3): rank 3 sleeps; rank 2 waits for its
    # gradients, ranks 0 and 1 wait in their dp all-reduces for ranks 2 and 3
    states = {0: {"dp@a": _gs(7, 6)}, 1: {"dp@b": _gs(7, 6)}, 2: {"dp@a": _gs(6)}, 3: {"dp@b": _gs(6)}}
    members = {"dp@a": [0, 2], "dp@b": [1, 3]}
    v = analyse(states, members, p2p={2: [_pw("recv", 3)]}, seen=range(4))
    assert (v.kind, v.culprits, v.victims) == ("missing", [3], [0, 1, 2])


def test_a_barrier_on_one_rank_of_a_pipeline_is_a_desync_named_by_the_minority() -> None:
    # tp2 x pp2 (the demo): rank 3 waits in a world barrier; rank 2 waits for it in tp; ranks 0 and 1
    # wait in p2p for their stage-1 peers: every rank waits, the odd one out is the barrier's
    states = {
        0: {"tp@x": _gs(30)},
        1: {"tp@x": _gs(30)},
        2: {"tp@y": _gs(31, 30)},
        3: {"default_pg": _gs(1, 0, op="barrier"), "tp@y": _gs(30)},
    }
    members = {"default_pg": [0, 1, 2, 3], "tp@x": [0, 1], "tp@y": [2, 3]}
    p2p = {0: [_pw("recv", 2)], 1: [_pw("recv", 3)]}
    v = analyse(states, members, p2p=p2p, seen=range(4))
    assert (v.kind, v.culprits, v.victims) == ("desync", [3], [0, 1, 2])
    assert v.sides["pp: recv from rank 2"] == [0] and v.sides["default_pg: barrier"] == [3]


def test_a_chain_that_leaves_the_view_names_no_culprit() -> None:
    v = analyse({3: {}}, {}, p2p={3: [_pw("recv", 2)]}, seen=[3])
    assert (v.kind, v.culprits) == ("unknown", []) and "[2]" in v.note


def test_short_p2p_waits_and_a_batch_with_one_peer() -> None:
    assert analyse({0: {}}, {}, p2p={0: [_pw("recv", 1, age=0.2)]}).kind == "none"
    (w,) = p2p_waits([("send", 1, "pp"), ("recv", 1, "pp"), ("recv", -1, "pp")], 3.0)
    assert w == P2PWait("recv+send", 1, "pp", 3.0) and P2PWait.unpack(w.pack()) == w
    assert P2PWait.unpack(["recv"]) is None


def test_the_ranks_read_next_follow_each_chain_on_at_its_step() -> None:
    # ranks 0 and 8 known; rank 0 waits for rank 4 (a pipeline of stride 4), rank 8 for rank 9, rank 20
    # for rank 16 (the chain goes down); a short wait and a wait for a known rank lead nowhere
    p2p = {
        0: [_pw("recv", 4)],
        8: [_pw("recv", 9), _pw("send", 12, age=0.5)],
        20: [_pw("recv", 16)],
        3: [_pw("recv", 8)],
    }
    got = chain_reads(p2p, known={0, 3, 8, 20}, min_wait_s=1.0, world=24, width=3, limit=64)
    assert got == [4, 9, 16, 10, 11, 12]  # the peers first; rank 0's chain stops at known rank 8
    assert chain_reads(p2p, {0, 3, 8, 20}, 1.0, 24, 3, limit=2) == [4, 9]
    assert chain_reads({23: [_pw("recv", 22)], 22: []}, {22, 23}, 1.0, 24, 8, 64) == []


def test_a_rank_waited_for_that_waits_in_a_collective_beyond_view_is_no_culprit() -> None:
    # rank 0 waits point to point for rank 1, which waits in dp all-reduce #41 with members out of view
    # (its group incomplete, none in view behind it): it may wait for one of them
    states = {0: {}, 1: {"dp@a": _gs(41, 40)}}
    v = analyse(states, {"dp@a": [1]}, {"dp@a": False}, p2p={0: [_pw("recv", 1)]}, seen=[0, 1])
    assert (v.kind, v.culprits) == (
        "unknown",
        [],
    ) and v.note == "rank 1 waits in dp for members beyond the ranks read"
    # a member in view past its seq: its last word is older than its op's completion, it waits for nobody
    states = {0: {}, 1: {"dp@a": _gs(41, 40)}, 2: {"dp@a": _gs(42, 41)}}
    v = analyse(states, {"dp@a": [1, 2]}, {"dp@a": False}, p2p={0: [_pw("recv", 1)]}, seen=[0, 1, 2])
    assert (v.kind, v.culprits) == ("missing", [1])
