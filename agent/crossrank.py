"""Cross-rank exchange of small detector payloads through the job's c10d store.

Why the store: an extra collective on the training process groups would queue behind (or block) the
very collectives a stuck rank is missing; the store is a side channel that keeps working when a rank
is stuck in C++. Each rank overwrites one key ``hpar/<job>/x/<rank>`` (bounded: never one key per
step), and readers ``check()`` keys before reading, so a rank that never published costs nothing and
never blocks the agent thread. Payloads carry their publish time: a stuck rank's stale payload is seen
as stale rather than waited for.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from hpar_agent import gil

log = logging.getLogger("hpar_agent")


def open_store(timeout_s: float = 5.0) -> Any:
    """A store client for the agent thread: our own TCPStore connection to MASTER_ADDR:MASTER_PORT
    (its own socket and timeout, so it neither contends with nor re-times the training thread's
    client), else the default process group's store, else None."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            return dist.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as exc:
            log.debug("hpar_agent: own TCPStore client failed (%s); using the default store", exc)
    if dist.is_available() and dist.is_initialized():
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
        except Exception:
            return None
    return None


class Exchange:
    """One rank's view of the exchange: ``publish`` its payload, ``read`` the peers'."""

    def __init__(self, store: Any, job: str, rank: int) -> None:
        self.store = store
        self.prefix = f"hpar/{job}/x/"
        self.rank = rank
        self.published = 0
        self.max_bytes = 1 << 20

    def key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def publish(self, payload: dict[str, Any]) -> None:
        data = json.dumps({**payload, "rank": self.rank, "t": time.time()}, separators=(",", ":"))
        if len(data) > self.max_bytes:
            raise ValueError(f"exchange payload of {len(data)} bytes exceeds {self.max_bytes}")
        self.store.set(self.key(self.rank), data)
        self.published += 1

    def read(self, ranks: Iterable[int], max_age_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Payloads of ``ranks`` that exist (and are younger than ``max_age_s``); never waits for a key."""
        ranks = list(ranks)
        if self.store.check([self.key(r) for r in ranks]):  # every rank published: one round trip
            present = ranks
        else:
            present = [r for r in ranks if self.store.check([self.key(r)])]
        if not present:
            return {}
        keys = [self.key(r) for r in present]
        if hasattr(self.store, "multi_get"):
            raw = self.store.multi_get(keys)
        else:  # pragma: no cover - stores without multi_get
            raw = [self.store.get(k) for k in keys]
        now = time.time()
        out: dict[int, dict[str, Any]] = {}
        for r, blob in zip(present, raw, strict=True):
            gil.pause_point()  # each peer's payload is a few hundred µs of decoding
            try:
                payload = json.loads(bytes(blob).decode())
            except ValueError:
                continue
            if max_age_s is None or now - float(payload.get("t", 0)) <= max_age_s:
                out[r] = payload
        return out
