"""The per-rank JSONL event log: full texts (graph-break stacks, guard failures, alerts) live here,
never in label values."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class EventLog:
    """Append-only JSONL file ``events.rank<R>.jsonl`` in the run directory (or nowhere)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._fh = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._fh = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.recent: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "rank": self.rank, "kind": kind, **fields}
        with self._lock:
            self.recent.append(record)
            del self.recent[:-1000]
            if self._fh is not None:
                self._fh.write(json.dumps(record, default=str) + "\n")
        return record

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
