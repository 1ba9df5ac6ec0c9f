"""A simulator of many agent endpoints: N rank endpoints on loopback (one asyncio process, one listening
port per rank), each replaying a recorded OpenMetrics scrape of the agent.

Simulated rank i replays recorded scrape ``i % len(scrapes)`` with its ``rank`` label rewritten to i
(``pp_stage`` stays the recorded rank's). Values move every scrape interval: counters and histogram
buckets/sums/counts grow by the same factor (so buckets stay cumulative), gauges jitter by +-1 % (0/1
state flags stay as recorded) and timestamps advance. Used by ``tests/integration/test_dashboard_scale.py``
and ``benchmarks/scale.py`` (a real Prometheus scraping 64-256 ranks).

    python -m testkit.metrics_sim --base PORT --targets N --interval S --scrapes rank0.om [...]

prints ``ready`` once every port listens; SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gzip
import os
import signal
import time
from pathlib import Path

CONTENT_TYPE = b"application/openmetrics-text; version=1.0.0; charset=utf-8"
GROWTH_PER_TICK = 0.05  # counters grow 5 % of their recorded value per scrape interval


def _label_end(line: str) -> int:
    """Index just past the metric name and label set of an exposition sample line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or (0 <= space < brace):
        return space
    i, quoted = brace + 1, False
    while i < len(line):
        c = line[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i + 1
        i += 1
    raise ValueError(f"unterminated label set: {line[:80]}")


class Template:
    """One recorded scrape as a %-format string with the rank label and every value as placeholders."""

    def __init__(self, text: str) -> None:
        parts: list[str] = []
        self.values: list[float] = []
        self.kinds: list[str] = []  # counter | gauge | timestamp | static
        family_type = "untyped"
        for line in text.splitlines():
            if line.startswith("#"):
                if line.startswith("# TYPE "):
                    family_type = line.split()[3]
                parts.append(line.replace("%", "%%"))
                continue
            if not line.strip():
                continue
            end = _label_end(line)
            head, rest = line[:end], line[end:].strip()
            value, _, suffix = rest.partition(" ")
            head = head.replace("%", "%%")
            head = _sub_label(head, "rank", "%(rank)s")
            name = head.split("{", 1)[0]
            if family_type in ("counter", "histogram", "summary") and not name.endswith("_created"):
                kind = "counter"
            elif family_type == "gauge" and name.endswith("_timestamp_seconds"):
                kind = "timestamp"
            elif family_type == "gauge" and float(value) in (0.0, 1.0):
                kind = "static"  # a state flag (alert active, verdict, component up): stays 0 or 1
            elif family_type == "gauge":
                kind = "gauge"
            else:
                kind = "static"
            self.values.append(float(value))
            self.kinds.append(kind)
            n = len(self.values) - 1
            parts.append(f"{head} %(v{n})s" + (" " + suffix.replace("%", "%%") if suffix else ""))
        self.format = "\n".join(parts) + "\n"

    def render_values(self, tick: int, interval: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for n, (v, kind) in enumerate(zip(self.values, self.kinds, strict=True)):
            if kind == "counter" and v == int(v):  # counts and buckets stay integers (OpenMetrics)
                x = v + round(v * GROWTH_PER_TICK * tick)
            elif kind == "counter":
                x = v * (1.0 + GROWTH_PER_TICK * tick)
            elif kind == "gauge":
                x = v * (1.0 + 0.01 * (((tick * 7 + n) % 11) - 5) / 5)
            elif kind == "timestamp":
                x = v + tick * interval
            else:
                x = v
            out[f"v{n}"] = repr(x) if x != int(x) or abs(x) >= 1e15 else str(int(x)) + ".0"
        return out


def _sub_label(head: str, label: str, new: str) -> str:
    key = f'{label}="'
    for sep in ("{", ","):
        i = head.find(sep + key)
        if i >= 0:
            j = i + 1 + len(key)
            k = head.index('"', j)
            return head[:j] + new + head[k:]
    return head


def serve(scrapes: list[Path], base: int, n: int, interval: float, use_gzip: bool) -> None:
    templates = [Template(p.read_text()) for p in scrapes]
    formats = [templates[i % len(templates)].format.replace("%(rank)s", str(i)) for i in range(n)]
    t0 = time.monotonic()
    cache: dict[tuple[int, int], dict[str, str]] = {}

    def body(i: int) -> bytes:
        tick = int((time.monotonic() - t0) / interval)
        key = (i % len(templates), tick)
        vals = cache.get(key)
        if vals is None:
            for old in [k for k in cache if k[1] < tick - 1]:
                del cache[old]
            vals = cache[key] = templates[key[0]].render_values(tick, interval)
        return (formats[i] % vals).encode()

    async def handle(i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                data = body(i)
                extra = b""
                if use_gzip and b"gzip" in head.lower():
                    data = gzip.compress(data, compresslevel=1)
                    extra = b"Content-Encoding: gzip\r\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: "
                    + CONTENT_TYPE
                    + b"\r\n"
                    + extra
                    + b"Content-Length: "
                    + str(len(data)).encode()
                    + b"\r\n\r\n"
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        servers = []
        for i in range(n):
            servers.append(
                await asyncio.start_server(functools.partial(handle, i), "127.0.0.1", base + i, backlog=64)
            )
        print("ready", flush=True)
        await asyncio.Event().wait()

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scrapes", nargs="+", required=True, help="recorded scrapes (files)")
    p.add_argument("--base", type=int, required=True, help="the first rank's port")
    p.add_argument("--targets", type=int, required=True, help="simulated ranks")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between value updates")
    p.add_argument("--gzip", action="store_true", help="gzip responses when asked (prometheus_client does)")
    a = p.parse_args(argv)
    serve([Path(s) for s in a.scrapes], a.base, a.targets, a.interval, a.gzip)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
