"""The cross-rank exchange over a real TCPStore: one key per rank, no wait for ranks that never published,
stale payloads dropped, namespaced by job."""

from __future__ import annotations

import time
from typing import Any

from hpar_agent.crossrank import Exchange


def test_exchange_over_tcpstore(store: Any) -> None:
    a, b = Exchange(store, "j1", 0), Exchange(store, "j1", 1)
    a.publish({"fp": 1})
    t0 = time.perf_counter()
    assert set(b.read(range(4))) == {0}  # ranks 1-3 never published: no wait
    assert time.perf_counter() - t0 < 1.0
    b.publish({"fp": 2})
    b.publish({"fp": 3})  # overwrites: one key per rank
    got = a.read(range(2))
    assert got[0]["fp"] == 1 and got[1]["fp"] == 3 and got[1]["rank"] == 1
    assert a.read(range(2), max_age_s=-1) == {}  # stale payloads are dropped
    assert Exchange(store, "other", 0).read(range(2)) == {}  # namespaced by job
