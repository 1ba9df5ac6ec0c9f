"""benchmarks.instant_steps: a cost paid at the instants of a wall-clock grid is found at those instants
and nowhere else, in either design's JSON layout."""

from __future__ import annotations

import json

from benchmarks.instant_steps import blocks_of, excess_by_instant, main

S = 1_000_000_000


def _block(arm: str, pair: int, stall_ms: float, t0_ns: int = 1_000 * S + S // 3) -> dict:
    """60 steps of 100 ms from ``t0_ns``; each step that contains a whole second is ``stall_ms`` longer."""
    times, ends, end = [], [], t0_ns
    for _ in range(60):
        start = end
        t = 0.1
        if (start + int(t * 1e9)) // S * S >= start:  # it would contain a second's instant
            t += stall_ms / 1e3
        end = start + int(t * 1e9)
        times.append(t)
        ends.append(end)
    return {"arm": arm, "pair": pair, "times": times, "ends": ends}


def test_a_cost_at_the_instants_shows_there_and_nowhere_else(tmp_path, capsys) -> None:
    blocks = [_block("on", 0, 12.0), _block("off", 0, 0.0), _block("on", -1, 99.0)]  # pair -1: warm-up
    by = excess_by_instant(blocks, 1.0, skip=3)
    at, elsewhere = by["on"][True], by["on"][False]
    assert len(at) in (5, 6) and all(abs(x - 12.0) < 0.5 for x in at)  # ~one step a second, warm-up left out
    assert all(abs(x) < 0.5 for x in elsewhere)
    assert all(abs(x) < 0.5 for x in by["off"][True] + by["off"][False])
    assert excess_by_instant(blocks, 1.0, skip=3, exclude_pairs=frozenset({0})) == {}
    twin = {"block_skip": 3, "blocks": [[blocks[0]], [blocks[1]]]}  # twin's layout: a list per half
    assert [b["arm"] for b in blocks_of(twin)] == ["on", "off"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(twin))
    assert main([str(path), "--period", "1"]) == 0
    out = capsys.readouterr().out
    assert "on       at an instant" in out and "mean  12.00" in out
