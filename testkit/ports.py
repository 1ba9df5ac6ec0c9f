"""Free loopback ports for servers a test or benchmark starts (never a fixed port: the machine is shared)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port the OS says is free now (bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive free ports, below the ephemeral range (32768+) so the ranks'
    own gloo connections cannot take one between this check and the agent's bind."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")
