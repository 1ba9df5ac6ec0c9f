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
from hpar_agent.detectors.sources import WIDEST
from hpar_agent.thresholds import COMPONENT_DEFAULTS


def test_payloads_are_the_agents_at_their_largest_with_a_compact_summary() -> None:
    """Every purpose, from the agent's own builder: the flight-recorder window at its cap (1,024 entries
    with tp or FSDP, 256 for DDP alone), a pipeline stage's p2p waits at each entry, the largest GPU
    health; what every peer reads of ``s`` stays small."""
    for layout in store_load.LAYOUTS:
        dims = dict(store_load.LAYOUTS[layout](64))
        parts = store_load.template_parts(layout, 64)
        assert set(parts) == set(PURPOSES)
        size = {p: len(json.dumps(v, separators=(",", ":"))) for p, v in parts.items()}
        assert size["s"] <= 2048, size  # what every comparison peer reads
        assert set(parts["s"]) == {"c", "step", "fp", "cd", "q", "id", "gh"}
        assert parts["s"]["step"] == store_load.STEPS and {"th", "ecc", "xid"} <= set(parts["s"]["gh"])
        entries = len(parts["fr"]["fr"]["e"]) // 3
        assert entries == (256 if layout == "dp" else WIDEST * 256), layout
        assert ("pw" in parts["fr"]) == ("pp" in dims)
        if "pw" in parts["fr"]:  # its p2p wait totals at each entry, as their increases (mostly 0)
            assert len(parts["fr"]["pw"]["d"]) == entries and size["fr"] < 12 * entries
        else:  # ~10 bytes an entry
            assert size["fr"] < 10.5 * entries
        assert set(parts["ck"]["cks"]) == {"10", "20", "30"} and bool(parts["gs"]) == ("tp" in dims)


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
    argv = ["--ranks", "16", "--layouts", "dp_tp", "--rounds", "1", "--plain", "--json", str(out)]
    assert store_load.main(argv) == 0
    every = json.loads(out.read_text())
    rows = {r["scheme"]: r for r in every if r["blobs"] == "zlib"}
    assert set(rows) == {"peers", "all"} and all(r["errors"] == 0 for r in every)
    plain = {r["scheme"]: r for r in every if r["blobs"] == "plain"}
    # the agent's blobs travel compressed: a third of the bytes of the same case set plain, side by side
    assert rows["peers"]["kb_got_per_rank"] < plain["peers"]["kb_got_per_rank"] / 2.5
    assert rows["peers"]["kb_set_per_rank"] < plain["peers"]["kb_set_per_rank"] / 2.5
    # 8 of its 15 stage-mates, s and fr (gs of its 7 tp peers), where the old scheme read every purpose
    assert plain["peers"]["kb_got_per_rank"] < plain["all"]["kb_got_per_rank"] / 3
    assert rows["peers"]["round_s"] > 0 and rows["peers"]["idle_ms"]["n"] > 0
    assert rows["peers"]["window_s"] == cadence(16, 3.0, 1.0).window_s and rows["peers"]["spread"].startswith(
        "agent"
    )
    assert rows["all"]["window_s"] == 0  # the old scheme went all at once
