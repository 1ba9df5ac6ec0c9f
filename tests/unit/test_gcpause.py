"""The GC pause around the agent's short-lived bursts: no collection inside, the counters left where
they were, and a collector the user disabled stays disabled."""

from __future__ import annotations

import gc

from hpar_agent import gcpause


def test_a_burst_inside_paused_triggers_no_collection() -> None:
    runs: list[int] = []

    def cb(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    gc.collect()
    gc.callbacks.append(cb)
    try:
        with gcpause.paused():
            burst = [{"record_id": i, "sizes": [[i]]} for i in range(50_000)]  # ~100k tracked objects
            del burst
        assert gc.isenabled()
        assert runs == []
        # the counters are back where they were: the next small allocations owe no collection
        keep = [[i] for i in range(100)]
        assert runs == [] and len(keep) == 100
        with_gc = [{"record_id": i} for i in range(50_000)]  # the same burst unpaused does collect
        assert runs, "gc callbacks saw no collection: the test would not show a pause"
        del with_gc
    finally:
        gc.callbacks.remove(cb)


def test_paused_leaves_a_user_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
