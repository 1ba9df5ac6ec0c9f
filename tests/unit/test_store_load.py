"""benchmarks/store_load.py: its payloads come from the agent's own builder, its ranks follow the
agent's own cadence, and a small run measures both schemes on a real store."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import store_load
from hpar_agent.config import AgentConfig
from hpar_agent.crossrank import PURPOSES, Grid, cadence
from hpar_agent.thresholds import COMPONENT_DEFAULTS


def test_payloads_are_the_agents_with_a_compact_summary() -> None:
    for layout in store_load.LAYOUTS:
        parts = store_load.template_parts(layout, 64)
        assert set(parts) == set(PURPOSES)
        size = {p: len(json.dumps(v, separators=(",", ":"))) for p, v in parts.items()}
        assert size["s"] <= 2048, size  # what every comparison peer reads
        assert (
            set(parts["s"]) == {"c", "step", "fp", "cd", "q", "id"} and parts["s"]["step"] == store_load.STEPS
        )
        assert len(parts["fr"]["fr"]["e"]) == 3 * 256 and set(parts["ck"]["cks"]) == {"10", "20", "30"}
        assert bool(parts["gs"]) == ("tp" in dict(store_load.LAYOUTS[layout](64)))
        if "tp" in dict(
            store_load.LAYOUTS[layout](64)
        ):  # a 4-rank dp2 x tp2 hpar-train run sets 19.6 KB at most
            assert 18_500 < sum(size.values()) < 21_000, size


def test_the_old_scheme_read_every_rank_of_the_stage() -> None:
    grid = Grid.row_major(store_load.LAYOUTS["pp_dp_tp"](64))  # dp2 x pp4 x tp8
    stage = store_load._stage_ranks(grid, 9)  # pp 1
    assert len(stage) == 16 and all((r // 8) % 4 == 1 for r in stage)
    assert store_load._stage_ranks(Grid.row_major([("dp", 8)]), 3) == list(range(8))


def test_the_agents_scheme_is_spread_by_the_agents_own_cadence() -> None:
    assert AgentConfig().interval == store_load.AGENT_INTERVAL_S
    for n in (16, 1024, 8192):
        cad = store_load.pace(n, None)
        assert cad == cadence(n, COMPONENT_DEFAULTS["exchange_s"], AgentConfig().interval)
        at = [store_load._Rank.offset(SimpleNamespace(rank=r), {"cadence": cad}) for r in range(n)]  # type: ignore[arg-type]
        for r in range(
            min(n, 50)
        ):  # its pass of the phase (a second apart), its offset into that pass's window
            k, off = cad.offset(r)
            assert at[r] == pytest.approx(k * AgentConfig().interval + off)
        assert max(at) < cad.polls - 1 + cad.window_s
    assert (
        store_load.pace(1024, 0.0).window_s == 0 and store_load.pace(1024, 0.5).window_s == 0.5
    )  # --spread S


def test_a_small_run_measures_both_schemes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")  # what main() would set, restored after
    out = tmp_path / "store.json"
    assert store_load.main(["--ranks", "16", "--layouts", "dp_tp", "--rounds", "1", "--json", str(out)]) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"peers", "all"} and all(r["errors"] == 0 for r in rows.values())
    assert rows["peers"]["kb_got_per_rank"] < rows["all"]["kb_got_per_rank"] / 4
    assert rows["peers"]["round_s"] > 0 and rows["peers"]["idle_ms"]["n"] > 0
    assert rows["peers"]["window_s"] == cadence(16, 3.0, 1.0).window_s and rows["peers"]["spread"].startswith(
        "agent"
    )
    assert rows["all"]["window_s"] == 0  # the old scheme went all at once
