"""Process lifecycle around the agent: fork and termination signals.

Fork: a child (a DataLoader worker, a ``multiprocessing`` fork) inherits the agent's objects but none of
its threads. Left alone its exit would run ``Agent.stop`` from atexit, which waits for a server loop
that does not exist in the child (forever), and it would hold the listening socket and the event log's
descriptor. ``after_fork_in_child`` forgets the agent in the child: no atexit work, no server, the log
descriptors pointed at /dev/null. It takes no lock another thread may have held at fork time.

Signals: SIGTERM (what torchrun sends the surviving ranks) and SIGINT flush the agent (summary, last
events, queued spans, bounded), then the process does what it would have done without the agent: the
previous Python handler is called, or the default action is restored and the signal re-raised. Handlers
are installed only from the main thread and only over the default or Python handlers (an ignored
signal stays ignored; a handler installed from C is left alone).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
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


# ---------------------------------------------------------------------------------------------- signals
class SignalFlush:
    """Flush-then-chain handlers for SIGTERM/SIGINT, installed for one agent."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there; an agent attached elsewhere flushes at exit
        for name in SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                prev = signal.getsignal(signum)
                if prev is signal.SIG_IGN or prev is None:
                    continue  # ignored stays ignored; a C-level handler is not ours to wrap
                signal.signal(signum, self._handle)
                self.previous[signum] = prev
            except (ValueError, OSError) as exc:
                log.debug("hpar_agent: no %s handler (%s)", name, exc)

    def uninstall(self) -> None:
        """Put the previous handlers back, unless someone replaced ours since."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, prev in self.previous.items():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(signum) == self._handle:
                    signal.signal(signum, prev)
        self.previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        prev = self.previous.get(signum, signal.SIG_DFL)
        agent = self.agent
        try:
            if prev is signal.SIG_DFL:
                agent.stop(timeout=SIGNAL_FLUSH_S / 2)  # the process ends: a full, bounded stop
            else:
                agent.flush(timeout=SIGNAL_FLUSH_S)  # the previous handler decides what happens next
        except Exception as exc:
            with contextlib.suppress(Exception):
                agent.record_error("agent", exc)
        if callable(prev):
            prev(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: the exit status says the signal
