"""What a rank's ending says of the incident it was part of: a consequence, or a cause of its own.

A fault on one rank ends the others too: its peers' collectives and p2p ops time out, their
connections are closed or reset by the rank that went away, the backend aborts its communicators, and
the launcher terminates the ranks still running. Those endings are consequences (the ranks are
victims) and never make a rank a culprit; an ending of its own (an exception that is not a
communication failure, an out-of-memory, a signal no launcher sent) can. Read by RankGone (a peer's
goodbye) and by ``hpar-agent run`` (the ranks' exits), so both judge the same words the same way.
"""

from __future__ import annotations

import re

#: An exception text that a communication failure caused: a timeout of a collective, a p2p op or the
#: store; a connection a peer closed or reset; a communicator the backend (or its watchdog) aborted.
COMMUNICATION = re.compile(
    r"timed out|timeout|connection (?:closed|reset|refused)|by peer|broken pipe|"
    r"distbackenderror|distnetworkerror|diststoreerror|nccl communicator was aborted|"
    r"ncclremoteerror|ncclsystemerror|watchdog|abort|socket.*(?:closed|error)|recvvalue|"
    r"read error|no route to host|network is unreachable",
    re.IGNORECASE,
)
#: Signals a launcher sends the ranks still running once one failed (torchrun: SIGTERM; others SIGINT,
#: SIGHUP), and ``hpar-agent run`` forwards to every rank when it gets one.
LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def communication_failure(text: str) -> bool:
    """Whether an ending's text (``exception: RuntimeError: Timed out waiting ...``) is a
    communication failure: a consequence of a fault on another rank."""
    return bool(text) and "out of memory" not in text.lower() and bool(COMMUNICATION.search(text))


def launcher_signal(text: str) -> bool:
    """Whether an ending (``signal: SIGTERM``, ``killed by signal 15 (SIGTERM)``) is a signal a
    launcher sends the ranks still running."""
    return any(s in text for s in LAUNCHER_SIGNALS)
