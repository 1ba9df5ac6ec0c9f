"""Numbers as the offline tools print them: three significant digits and a unit, because a 16-digit
float says nothing more than "12.3 ms" and hides what it measures."""

from __future__ import annotations

import math
from typing import Any

#: How many significant digits a measured value keeps.
DIGITS = 3


def sig(v: float, digits: int = DIGITS) -> str:
    """``v`` with ``digits`` significant digits in fixed notation (12.3, 0.00123, 1230)."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    exp = math.floor(math.log10(abs(v)))
    rounded = round(v, digits - 1 - exp)
    exp = math.floor(math.log10(abs(rounded))) if rounded else exp  # 9.996 rounds up to 10.0
    return f"{rounded:.{max(0, digits - 1 - exp)}f}"


def seconds(v: float | None) -> str:
    """A duration: "850 ns", "12.3 µs", "4.56 ms", "1.23 s" (from 1000 s on, whole seconds)."""
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 1000:
        return f"{v:.0f} s"
    r = float(sig(v))  # rounded first: 0.99996 s is "1.00 s", not "1000 ms"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(r) >= scale:
            return f"{sig(r / scale)} {unit}"
    return f"{sig(r / 1e-9)} ns"


def size(v: float | None) -> str:
    """Bytes in binary units: "512 B", "1.50 KiB", "345 MiB", "1.20 GiB"."""
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1000 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{sig(v)} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def change(ratio_minus_one: float) -> str:
    """A relative change: "+4.6%", "-12.3%", "+172%"."""
    pct = ratio_minus_one * 100
    return f"{pct:+.0f}%" if abs(pct) >= 100 else f"{pct:+.1f}%"


def value(v: Any) -> str:
    """Any value from a file: numbers with three significant digits, the rest as text."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, int) or not math.isfinite(v):
        return str(v)
    return sig(v) if 1e-4 <= abs(v) < 1e6 or v == 0 else f"{v:.{DIGITS - 1}e}"


def evidence(key: str, v: Any) -> str:
    """A named figure as a reader wants it: ``*_s``/``*_seconds*`` as a duration, ``*_bytes`` as a
    size, ``*share*``/``*ratio*`` as a percentage, other numbers with three significant digits."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        k = key.lower()
        if k.endswith("_s") or "seconds" in k:
            return seconds(v)
        if k.endswith("bytes"):
            return size(v)
        if "share" in k or "ratio" in k:
            return f"{sig(v * 100)}%"
    return value(v)


def rounded(obj: Any) -> Any:
    """``obj`` (JSON-like) with every float cut to three significant digits, for printing whole."""
    if isinstance(obj, float):
        return float(sig(obj)) if math.isfinite(obj) and obj != 0 else obj
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


__all__ = ["change", "evidence", "rounded", "seconds", "sig", "size", "value"]
