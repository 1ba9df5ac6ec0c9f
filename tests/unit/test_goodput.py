"""The goodput ledger's arithmetic on synthetic steps, the checkpoint wrappers, and the closing line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpar_agent.collectors import goodput_attempts
from hpar_agent.collectors.checkpoint_wrap import CheckpointWrap
from hpar_agent.collectors.goodput import process_start_ns
from hpar_agent.collectors.goodput_ledger import UNDECIDED_STEPS, Ledger, Shares
from hpar_agent.tools import goodput_view

S = 10**9  # ns a second


def _total(led: Ledger) -> float:
    return led.productive + sum(led.lost.values())


def test_causes_add_up_to_the_wall_time_without_gaps() -> None:
    led = Ledger(start_ns=0)
    # startup to 5 s; steps of 1 s with 10 % data, 20 % host, 30 % exposed comm; a compile in step 1
    led.step(5 * S, 6 * S, Shares(0.1, 0.2, 0.3), compiles=[(int(5.5 * S), int(5.75 * S))])
    for i in range(6, 10):
        led.step(i * S, (i + 1) * S, Shares(0.1, 0.2, 0.3), culprit=2)
    led.span(12 * S, "other")
    assert led.wall == pytest.approx(12.0)
    assert _total(led) == pytest.approx(led.wall)
    assert led.lost["startup"] == pytest.approx(5 + 0.2)  # before the first step, and its host time
    assert led.lost["compile"] == pytest.approx(0.25)
    assert led.lost["data_wait"] == pytest.approx(0.5)
    assert led.lost["host"] == pytest.approx(0.8)
    # step 1's exposed communication waited undecided until the culprit was named: a wait for it too
    assert led.lost["wait"] == pytest.approx(1.5) and led.wait_by == {2: pytest.approx(1.5)}
    assert led.lost["other"] == pytest.approx(2.0)
    # step 1: 1 - 0.25 compile - 0.1 data - 0.2 startup - 0.3 comm; then 4 x 0.4
    assert led.productive == pytest.approx(0.15 + 1.6)
    assert led.ratio() == pytest.approx((0.15 + 1.6) / 12)


def test_communication_with_no_culprit_named_in_time_is_productive() -> None:
    led = Ledger(start_ns=0)
    n = UNDECIDED_STEPS + 8
    for i in range(n):
        led.step(i * S, (i + 1) * S, Shares(0.0, 0.0, 0.5))
    assert sum(led.undecided) == pytest.approx(UNDECIDED_STEPS * 0.5)
    assert _total(led) + sum(led.undecided) == pytest.approx(led.wall)
    led.decide(None)  # the end: nobody was named
    assert led.lost["wait"] == 0 and led.productive == pytest.approx(n) == pytest.approx(led.wall)


def test_communication_before_the_straggler_detector_judged_stays_undecided_until_it_does() -> None:
    """Before any Straggler verdict a wait for a slow rank cannot be told from the step's own
    communication: none of it is productive, however many steps; a first clear verdict makes the older
    steps' productive, a culprit named takes all of it; an earlier attempt's undecided seconds stay so."""
    n = UNDECIDED_STEPS + 8
    led = Ledger(start_ns=0)
    for i in range(n):
        led.step(i * S, (i + 1) * S, Shares(0.0, 0.0, 0.5), judged=False)
    assert led.productive == pytest.approx(n * 0.5) and led.pending() == pytest.approx(n * 0.5)
    assert led.to_dict()["undecided_seconds"] == pytest.approx(n * 0.5)
    assert Ledger.from_dict(led.to_dict()).pending() == pytest.approx(n * 0.5)  # an earlier attempt's
    named = Ledger(start_ns=0)
    for i in range(n):
        named.step(i * S, (i + 1) * S, Shares(0.0, 0.0, 0.5), judged=False)
    named.step(n * S, (n + 1) * S, Shares(0.0, 0.0, 0.5), culprit=1)
    assert named.wait_by == {1: pytest.approx((n + 1) * 0.5)} and named.pending() == 0
    led.step(n * S, (n + 1) * S, Shares(0.0, 0.0, 0.5))  # judged: nobody slow
    # the steps' compute, the comm of the 8 older steps and of the one the new step pushed out, its compute
    assert led.productive == pytest.approx(n * 0.5 + 8 * 0.5 + 0.5 + 0.5)
    assert led.pending() == pytest.approx(UNDECIDED_STEPS * 0.5)  # the recent ones wait as before


def test_a_checkpoint_comes_out_of_the_host_share_and_overlaps_count_once() -> None:
    led = Ledger(start_ns=0, covered_ns=0)
    led.step(0, S, Shares())  # the first step
    ckpt = [(int(1.1 * S), int(1.5 * S))]
    led.step(S, 2 * S, Shares(0.0, 0.6, 0.0), ckpt=ckpt, compiles=[(int(1.4 * S), int(1.6 * S))])
    assert led.lost["checkpoint"] == pytest.approx(0.4)
    assert led.lost["compile"] == pytest.approx(0.1)  # the part outside the checkpoint
    assert led.lost["host"] == pytest.approx(0.2)  # 0.6 of host, 0.4 of it the checkpoint
    assert _total(led) == pytest.approx(2.0)


def test_a_hang_then_a_late_step_counts_each_instant_once() -> None:
    led = Ledger(start_ns=0)
    led.step(0, S, Shares())
    led.span(5 * S, "hang")
    led.step(S, 6 * S, Shares(0.5, 0.0, 0.0))  # the step that was hung: only its last second is new
    assert led.lost["hang"] == pytest.approx(4.0)
    assert led.lost["data_wait"] == pytest.approx(0.5)
    assert _total(led) == pytest.approx(6.0) == pytest.approx(led.wall)


def test_culprits_are_bounded() -> None:
    led = Ledger(start_ns=0)
    for r in range(40):
        led.step(r * S, (r + 1) * S, Shares(0, 0, 0.5), culprit=r)
    assert len(led.wait_by) == 16
    assert led.lost["wait"] == pytest.approx(20.0)


def test_process_start_is_before_now() -> None:
    import time

    t = process_start_ns()
    assert t is not None and t <= time.time_ns()


def test_checkpoint_wrappers_time_outermost_state_dict_calls(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    w = CheckpointWrap()
    orig = torch.save
    w.install(64)
    try:
        assert torch.save is not orig and torch.save.__wrapped__ is orig  # type: ignore[attr-defined]
        torch.save({"w": torch.zeros(2)}, tmp_path / "a.pt")
        torch.save(torch.zeros(2), tmp_path / "b.pt")  # not a state dict: not counted
        torch.load(tmp_path / "a.pt")
        state = {"w": torch.zeros(2)}
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
        dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    finally:
        w.uninstall()
    assert torch.save is orig
    calls = w.buffer.drain()
    assert len(calls) == 4, calls  # save, load, dcp.save (its inner writes not again), dcp.load
    assert all(t0 <= t1 for t0, t1, _tid, _save, _done in calls)
    assert [c[3] for c in calls] == [True, False, True, False]  # saves and loads told apart


def _summary(rank: int, productive: float, **lost: float) -> dict[str, object]:
    wait_by = {"2": lost.pop("wait2")} if "wait2" in lost else {}
    lost_s = dict(lost)
    if wait_by:
        lost_s["wait"] = lost_s.get("wait", 0.0) + wait_by["2"]
    wall = productive + sum(lost_s.values())
    return {
        "rank": rank,
        "components": {
            "goodput": {
                "wall_seconds": wall,
                "productive_seconds": productive,
                "lost_seconds": lost_s,
                "wait_by_culprit": wait_by,
            }
        },
    }


def test_closing_line_names_the_biggest_losses_with_the_culprit() -> None:
    ranks = [
        _summary(0, 71, wait2=18, compile=6, data_wait=3, host=2),
        _summary(1, 71, wait2=18, compile=6, data_wait=3, host=2),
    ]
    assert goodput_view.closing_line(ranks) == (
        "goodput 71 %: lost waiting for rank 2 18 %, compile 6 %, data 3 %, host 2 %"
    )
    assert goodput_view.closing_line([{"components": {}}]) is None
    fig = goodput_view.figure({0: ranks[0], 1: ranks[1]})
    assert fig is not None and {t.name for t in fig.data} >= {"productive", "waiting for rank 2", "compile"}


def test_closing_line_gives_the_range_an_undecided_share_leaves() -> None:
    ranks = [_summary(0, 20, other=25), _summary(1, 75, other=25)]
    ranks[0]["components"]["goodput"].update(undecided_seconds=55.0, wall_seconds=100.0)  # type: ignore[union-attr]
    line = goodput_view.closing_line(ranks)
    assert line is not None and line.startswith("goodput 48-75 % (28 % exposed communication undecided")
    assert line.endswith(": lost other 25 %") and "undecided" not in line.split(": lost")[1]
    ranks[0]["components"]["goodput"].update(undecided_seconds=1.0, wall_seconds=46.94)  # type: ignore[union-attr]
    assert goodput_view.closing_line(ranks) == "goodput 65 %: lost other 34 %"  # 64.7-65.3: no "65-65 %"


def test_the_run_summary_gives_each_ranks_goodput_in_words(tmp_path: Path) -> None:
    from hpar_agent.tools.summary import render_summary

    ranks = [_summary(0, 71, wait2=18, compile=6, data_wait=3, host=2), _summary(1, 90, compile=10)]
    text = render_summary({}, ranks, tmp_path, 1.0, 0)
    assert "  rank 0: goodput 71 %: lost waiting for rank 2 18 %, compile 6 %" in text
    assert "  rank 1: goodput 90 %: lost compile 10 %" in text and '"wall_seconds"' not in text


def test_earlier_attempts_add_their_seconds_and_the_restart_between(tmp_path: Path) -> None:
    first = Ledger(start_ns=100 * S)
    first.step(102 * S, 110 * S, Shares())  # startup 2 s, then 8 s of steps
    first.steps = 10
    goodput_attempts.write(
        str(tmp_path), 3, [], {"pid": 1, "ledger": first.to_dict(), "base_step": 0, "last_save_step": 8}
    )
    att = goodput_attempts.Attempts(goodput_attempts.read(str(tmp_path), 3), pid=2, start_ns=115 * S)
    assert att.steps_seen() == 10 and att.last_save_step() == 8
    total = att.total()
    assert total is not None
    assert total.lost["restart"] == pytest.approx(5.0)  # from the first attempt's end to this one's start
    assert total.wall == pytest.approx(15.0) and total.productive == pytest.approx(8.0)
    # this attempt resumed at step 8: its steps 8 and 9 are done again
    now = Ledger(start_ns=115 * S)
    for i in range(4):
        now.step((116 + i) * S, (117 + i) * S, Shares(), recomputed=8 + i < att.steps_seen())
    assert now.lost["recomputed"] == pytest.approx(2.0) and now.productive == pytest.approx(2.0)
    now.add(total)
    assert now.wall == pytest.approx(20.0)
    assert now.productive + sum(now.lost.values()) == pytest.approx(now.wall)
    assert goodput_attempts.read(str(tmp_path), 4) == []  # another rank's file: none
