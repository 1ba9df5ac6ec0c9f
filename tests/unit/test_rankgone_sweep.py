"""benchmarks/rankgone_sweep.py: its figures come from the detection simulation, and a sweep that named a
live rank or named a dead one early would fail."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import rankgone_sweep


def test_a_small_sweep_prints_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    assert rankgone_sweep.main(["--ranks", "1024", "--subjects", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["ranks"], row["exchange_s"], row["bound_s"], row["readers"]) == (1024, 3.0, 7.0, 8)
    assert 7.0 < row["min_s"] <= row["max_s"] <= 9.0 and row["early"] == row["false"] == 0
