"""Process lifecycle around the agent: fork.

Fork: a child (a DataLoader worker, a ``multiprocessing`` fork) inherits the agent's objects but none of
its threads. Left alone its exit would run ``Agent.stop`` from atexit, which waits for a server loop
that does not exist in the child (forever), and it would hold the listening socket and the event log's
descriptor. ``after_fork_in_child`` forgets the agent in the child: no atexit work, no server, the log
descriptors pointed at /dev/null. It takes no lock another thread may have held at fork time.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from typing import Any

log = logging.getLogger("hpar_agent")

#: Seconds the flush on a signal may take in all (thread join, final tick, span export).
SIGNAL_FLUSH_S = 5.0
SIGNALS = ("SIGTERM", "SIGINT")


# ---------------------------------------------------------------------------------------------- fork
def after_fork_in_child() -> None:
    from hpar_agent import agent as agent_mod

    target = agent_mod._current
    agent_mod._current = None
    agent_mod._lock = threading.Lock()  # may have been held by a parent thread at fork time
    if target is not None:
        forget_in_child(target)


def forget_in_child(agent: Any) -> None:
    """The child keeps no server, thread, atexit work or open log of the parent's agent."""
    agent.started = False
    agent.enabled = False
    with contextlib.suppress(Exception):
        atexit.unregister(agent.stop)
    agent._thread = None
    server, agent.server = agent.server, None
    if server is not None:
        with contextlib.suppress(Exception):
            server.socket.close()  # the child's copy only; the parent keeps serving
    agent.metrics_url = None
    with contextlib.suppress(Exception):
        agent.events.drop_in_child()
    tracing, agent.tracing = agent.tracing, None
    exporter = getattr(getattr(getattr(tracing, "_exporter", None), "inner", None), "_file", None)
    if exporter is not None:
        with contextlib.suppress(Exception):
            exporter.drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)
