"""The goodput ledgers of a rank's earlier attempts in the same run directory (``goodput.rank<R>.json``).

A job relaunched into its run directory (torchrun ``--max-restarts``, or a new launch) keeps what its
earlier attempts' time went to: each attempt writes its own ledger there (every few seconds and at the
end, replaced whole), and a new attempt reads the others' at its first pass. Their seconds are added to
its own, with ``restart`` the time between one attempt's last accounted instant and the next one's start
(the restart itself, and what a crashed attempt did after its last write).

Steps are numbered across attempts: an attempt that loads a checkpoint before its first step resumes at
the step count of the last checkpoint an earlier attempt saved; one that loads none starts at 0. Its
steps numbered below the most any earlier attempt reached are done again: ``recomputed``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hpar_agent.collectors.goodput_ledger import Ledger
from hpar_agent.safefiles import write_atomic

MAX_ATTEMPTS = 64  # earlier attempts kept in the file
MAX_BYTES = 1 << 20


def path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"goodput.rank{rank}.json")


def read(run_dir: str, rank: int) -> list[dict[str, Any]]:
    """The attempts the file holds (none when it is missing or unreadable)."""
    try:
        with open(path(run_dir, rank), "rb") as f:
            data = json.loads(f.read(MAX_BYTES))
        attempts = data["attempts"]
        return [a for a in attempts if isinstance(a, dict) and isinstance(a.get("ledger"), dict)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


class Attempts:
    """The earlier attempts of this rank, and what follows from them for this one."""

    def __init__(self, earlier: list[dict[str, Any]], pid: int, start_ns: int) -> None:
        self.earlier = sorted(
            (a for a in earlier if a.get("pid") != pid or a["ledger"].get("start") != start_ns / 1e9),
            key=lambda a: float(a["ledger"].get("start") or 0),
        )[-MAX_ATTEMPTS:]
        self.ledgers = []
        for a in self.earlier:
            try:
                self.ledgers.append(Ledger.from_dict(a["ledger"]))
            except (KeyError, TypeError, ValueError):
                continue
        self.start_ns = start_ns

    def total(self) -> Ledger | None:
        """The earlier attempts' seconds, with ``restart`` the gaps between them and before this one."""
        if not self.ledgers:
            return None
        out = Ledger(start_ns=0)
        prev_end: int | None = None
        for led in self.ledgers:
            self._gap(out, led.start_ns - (prev_end if prev_end is not None else led.start_ns))
            out.add(led)
            prev_end = led.covered_ns
        self._gap(out, self.start_ns - (prev_end if prev_end is not None else self.start_ns))
        return out

    @staticmethod
    def _gap(out: Ledger, ns: int) -> None:
        out.lost["restart"] += max(0, ns) / 1e9
        out.covered_ns += max(0, ns)

    def steps_seen(self) -> int:
        """The most steps any earlier attempt reached, numbered across attempts."""
        return max(
            (int(a.get("base_step") or 0) + int(a["ledger"].get("steps") or 0) for a in self.earlier),
            default=0,
        )

    def last_save_step(self) -> int:
        """The step count at the last checkpoint an earlier attempt saved (0: none saved)."""
        for a in reversed(self.earlier):
            if a.get("last_save_step") is not None:
                return int(a["last_save_step"])
        return 0


def write(run_dir: str, rank: int, earlier: list[dict[str, Any]], current: dict[str, Any]) -> None:
    data = json.dumps({"attempts": [*earlier, current]}, separators=(",", ":")).encode()
    write_atomic(path(run_dir, rank), data)
