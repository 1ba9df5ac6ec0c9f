"""How the offline tools read a run directory's files: they never hang, never read without bound and
never take a number JSON cannot hold.

- Regular files only (``safefiles.open_regular``, which the agent uses too): a FIFO, socket or device
  named like a run file is skipped with a message (open a FIFO and the tool waits for a writer
  forever).
- Bounded: a whole-file read refuses a file over its limit; a JSONL read stops at its limit and says
  so; a ``Budget`` bounds what one command reads across all the files of a run.
- Strict JSON (RFC 8259): ``NaN``, ``Infinity`` and numbers that overflow to infinity are refused, so
  a non-finite number never reaches a comparison or a table.

Every failure is an ``Unreadable`` whose text says why; the caller prefixes the file's name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpar_agent import safefiles

MiB = 1 << 20
#: One summary or trainer file (a summary is tens of KiB).
JSON_LIMIT = 16 * MiB
#: One JSONL file (the agent rotates its event log and traces file at 64 MiB by default).
JSONL_LIMIT = 256 * MiB
#: All the files one command reads from a run directory.
RUN_LIMIT = 1024 * MiB


class Unreadable(Exception):
    """A file a tool cannot use; the text says why (without the file's name)."""


class Budget:
    """Bytes a command may still read; each file read takes its share."""

    def __init__(self, total: int = RUN_LIMIT) -> None:
        self.left = total

    def take(self, limit: int) -> int:
        return max(0, min(limit, self.left))

    def spend(self, n: int) -> None:
        self.left -= n


def _size(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n} bytes"


def open_regular(path: Path) -> int:
    """A read-only fd of ``path`` if it is a regular file (symlinks followed); else ``Unreadable``."""
    try:
        return safefiles.open_regular(path)
    except safefiles.NotRegularError as exc:
        raise Unreadable(f"{exc.kind}, not a regular file: skipped") from None
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None


def read_bytes(path: Path, limit: int = JSON_LIMIT, budget: Budget | None = None) -> bytes:
    """The whole file, refused when it is over ``limit`` (or what ``budget`` has left)."""
    cap = budget.take(limit) if budget is not None else limit
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    if len(data) > cap:
        why = "the tools' limit" if cap == limit else "what is left of the run's read budget"
        raise Unreadable(f"over {_size(cap)} ({why}): skipped")
    if budget is not None:
        budget.spend(len(data))
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"holds {text[:40]}, too large for a float")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"holds {text[:40]}{'...' if len(text) > 40 else ''}, an integer past 64 bits")
    return value


def loads(text: str | bytes) -> Any:
    """Strict JSON: ``ValueError`` for NaN, Infinity, numbers past a float or a 64-bit integer, and
    runaway nesting."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_int64)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json(path: Path, limit: int = JSON_LIMIT, budget: Budget | None = None) -> Any:
    """The parsed file; ``Unreadable`` naming what is wrong (binary, cut short, NaN, too big)."""
    data = read_bytes(path, limit, budget)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"not UTF-8 text (byte {exc.start}): not a file the agent wrote") from None
    if not text.strip():
        raise Unreadable("empty")
    try:
        return loads(text)
    except json.JSONDecodeError as exc:
        short = exc.pos >= len(text.rstrip()) - 1 or exc.msg.startswith("Unterminated")
        cut = "; the file ends early (cut short?)" if short else ""
        raise Unreadable(f"not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}){cut}") from None
    except ValueError as exc:
        raise Unreadable(f"not valid JSON: {exc}") from None


def read_jsonl(
    path: Path, problems: list[str], limit: int = JSONL_LIMIT, budget: Budget | None = None
) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file, reading at most ``limit`` bytes (or the budget's share).
    Unreadable lines (a torn last line, NaN, not an object) are counted and the count, a truncated
    read or an unreadable file are appended to ``problems`` with the file's name."""
    name = path.name
    try:
        fd = open_regular(path)
    except Unreadable as exc:
        problems.append(f"{name}: {exc}")
        return
    cap = budget.take(limit) if budget is not None else limit
    bad = read = 0
    try:
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            while raw := fh.readline(cap - read + 1):  # bounded even for a file without newlines
                if len(raw) > cap - read:
                    why = "the tools' limit for one file" if cap == limit else "the read budget of one run"
                    problems.append(f"{name}: read the first {_size(read)} of {_size(size)} ({why})")
                    break
                read += len(raw)
                if not raw.strip():
                    continue
                try:
                    rec = loads(raw.decode("utf-8"))
                except ValueError:  # UnicodeDecodeError is a ValueError
                    bad += 1
                    continue
                if isinstance(rec, dict):
                    yield rec
                else:
                    bad += 1
    except OSError as exc:
        problems.append(f"{name}: {exc.strerror or exc}")
    finally:
        if budget is not None:
            budget.spend(read)
    if bad:
        problems.append(f"{name}: {bad} unreadable line(s) skipped")


__all__ = ["Budget", "Unreadable", "loads", "open_regular", "read_bytes", "read_json", "read_jsonl"]
