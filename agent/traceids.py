"""Deterministic trace and span ids, so every rank's spans of step N land in one trace."""

from __future__ import annotations

import functools
import hashlib


def _h(*parts: object, bits: int) -> int:
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=16).digest()
    value = int.from_bytes(digest, "big") & ((1 << bits) - 1)
    return value or 1  # 0 is an invalid id in OTel


def trace_id(job_id: str, step: int) -> int:
    """128-bit trace id of ``step`` in job ``job_id``; the same on every rank."""
    return _h("trace", job_id, step, bits=128)


def step_span_id(job_id: str, step: int, rank: int) -> int:
    """64-bit span id of rank ``rank``'s ``train.step`` span (rank 0's is the trace root)."""
    return _h("step", job_id, step, rank, bits=64)


@functools.lru_cache(maxsize=64)
def trace_id_hex(job_id: str, step: int) -> str:
    """The trace id as exemplars carry it (cached: a kept step's every collective asks for it)."""
    return f"{trace_id(job_id, step):032x}"
