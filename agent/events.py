"""The per-rank JSONL event log: full texts (graph-break stacks, guard failures, alerts) live here,
never in label values.

The file is private (0600, never through a symlink), rotates at ``max_bytes`` and a record is bounded:
each string value is cut to ``MAX_FIELD_CHARS`` (16 KiB), and a record still over ``MAX_RECORD_BYTES``
(64 KiB) is cut harder until it fits, else keeps only its small fields. A failed write (full or read-only disk) is handed to ``on_error`` and never raised:
``emit`` runs in hooks and in ``attach``/``detach``.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from hpar_agent.safefiles import RotatingFile

#: Characters kept of one string value (a graph-break stack, a guard failure text).
MAX_FIELD_CHARS = 16 * 1024
#: Bytes of one JSONL line beyond which only the record's small fields are kept.
MAX_RECORD_BYTES = 64 * 1024


def _cut(value: Any, chars: int = MAX_FIELD_CHARS, items: int = 256, depth: int = 0) -> Any:
    if isinstance(value, str):
        if len(value) > chars:
            return value[:chars] + f"...[truncated {len(value) - chars} chars]"
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON: the offline tools refuse NaN and infinities
    if depth > 8:
        return _cut(str(value), chars, items, depth)
    if isinstance(value, dict):
        return {str(k)[:256]: _cut(v, chars, items, depth + 1) for k, v in list(value.items())[:items]}
    if isinstance(value, (list, tuple)):
        return [_cut(v, chars, items, depth + 1) for v in list(value)[:items]]
    return value


def _cut_str(value: object, chars: int) -> str:
    return str(_cut(str(value), chars))


def bound_record(record: dict[str, Any]) -> str:
    """The record as one JSON line of at most ``MAX_RECORD_BYTES``: string values cut to
    ``MAX_FIELD_CHARS``, then shorter and lists shorter until it fits, else only its small fields."""
    size = 0
    for chars, items in ((MAX_FIELD_CHARS, 256), (4096, 64), (1024, 16), (256, 8)):
        cut = _cut(record, chars, items)
        if size:
            cut["truncated_bytes"] = size  # the size before cutting harder (ts, rank, kind come first)
        line = json.dumps(cut, default=functools.partial(_cut_str, chars=chars))
        if len(line.encode()) <= MAX_RECORD_BYTES:
            return line
        size = size or len(line.encode())
    small = {
        k: v
        for k, v in record.items()
        if isinstance(v, (int, float, bool)) or v is None or (isinstance(v, str) and len(v) <= 256)
    }
    small["truncated_bytes"] = size
    return json.dumps(_cut(small), default=str)


class EventLog:
    """Append-only JSONL file ``events.rank<R>.jsonl`` in the run directory (or nowhere)."""

    def __init__(
        self,
        path: str | None,
        rank: int,
        *,
        max_bytes: int = 0,
        backups: int = 2,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.path = path
        self.rank = rank
        self.on_error = on_error
        self._lock = threading.RLock()  # RLock: a signal handler may emit while the main thread does
        self._file = RotatingFile(path, max_bytes, backups) if path else None
        if self._file is not None:
            self._file._open()  # fail here (counted by the caller) rather than at the first event
        self.recent: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "rank": self.rank, "kind": kind, **fields}
        with self._lock:
            self.recent.append(record)
            del self.recent[:-1000]
            if self._file is not None:
                try:
                    self._file.write(bound_record(record) + "\n")
                except Exception as exc:  # a full disk must not reach the caller
                    if self.on_error is not None:
                        self.on_error(exc)
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except Exception as exc:
                    if self.on_error is not None:
                        self.on_error(exc)
                self._file = None

    def drop_in_child(self) -> None:
        """After fork: release the inherited descriptor; the child writes no events."""
        if self._file is not None:
            self._file.drop_in_child()
            self._file = None
