"""How each rank of a job ended, as ``hpar-agent run`` sees it from outside: ``ExitWatcher``.

The ranks are not ``hpar-agent run``'s children (torchrun's, or a spawning parent's), so their exit
status is not its to wait for. Each rank's agent writes ``state.rank<R>`` (``rankstate``) with its pid
at attach; the watcher opens a pidfd for each such process of this host (Linux 5.3+; else polls
``/proc``), and when one becomes readable the process has just exited: its time is exact, and while it
is a zombie, not yet reaped by its parent (torchrun reaps every 0.1 s), ``/proc/<pid>/stat`` still
holds its wait status: a signal or an exit code. The rank's state file adds its last step and what it
noted on the way out (an uncaught exception, a signal it handled). Together they tell the first rank
to fail and how, where the launcher's own report names the first it noticed.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpar_agent import rankstate

POLL_S = 0.25


@dataclass
class Exit:
    """One rank's process as it ended: when (epoch seconds) and its wait status when it was seen."""

    rank: int
    pid: int
    t: float
    status: int | None


class ExitWatcher:
    """Watches every rank process of this host that wrote a state file under ``run_dir``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.exits: dict[int, Exit] = {}
        self._watched: dict[int, tuple[int, int | None]] = {}  # pid -> (rank, pidfd or None)
        self._known: set[int] = set()  # every pid ever watched (an ended one is not watched again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hpar-exits", daemon=True)
        self._host = socket.gethostname()

    def start(self) -> ExitWatcher:
        self._thread.start()
        return self

    def stop(self, grace_s: float = 10.0) -> dict[int, Exit]:
        """Stop watching once every watched rank ended (at most ``grace_s``: a launcher that died leaves
        its ranks ending after it); rank -> its exit, for the ranks seen to end."""
        deadline = time.time() + grace_s
        while self._watched and time.time() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(2 * POLL_S + 1)
        self._look()
        for _rank, fd in self._watched.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._watched.clear()
        return dict(self.exits)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._discover()
            self._look(POLL_S)

    def _discover(self) -> None:
        for path in self.run_dir.glob("state.rank*"):
            rec = rankstate.read(str(path))
            if rec is None or rec.host != self._host or rec.pid in self._known or rec.end != "running":
                continue
            if rankstate.proc_state(rec.pid, rec.ticks or None, rec.host) in ("gone", ""):
                continue  # ended before it was seen (a record of an earlier run, or a fast death)
            fd: int | None = None
            with contextlib.suppress(OSError, AttributeError):
                fd = os.pidfd_open(rec.pid)
            self._watched[rec.pid] = (rec.rank, fd)
            self._known.add(rec.pid)

    def _look(self, timeout: float = 0.0) -> None:
        """Wait up to ``timeout`` for a watched process to exit; note every one that did."""
        fds = {fd: pid for pid, (_r, fd) in self._watched.items() if fd is not None}
        ready: set[int] = set()
        if fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            with contextlib.suppress(OSError):
                ready = {fds[fd] for fd, _ev in poller.poll(timeout * 1000)}
        elif timeout:
            self._stop.wait(timeout)
        for pid, (rank, pidfd) in list(self._watched.items()):
            if pid in ready or (
                pidfd is None and rankstate.proc_state(pid, None, self._host) in ("zombie", "gone")
            ):
                self.exits[rank] = Exit(rank, pid, time.time(), rankstate.exit_status(pid))
                del self._watched[pid]
                if pidfd is not None:
                    with contextlib.suppress(OSError):
                        os.close(pidfd)


def describe_status(status: int | None) -> str:
    """A wait status in words: ``killed by signal 9 (SIGKILL)``, ``exit code 1``; "" when not seen."""
    if status is None:
        return ""
    if os.WIFSIGNALED(status):
        n = os.WTERMSIG(status)
        try:
            name = signal.Signals(n).name
        except ValueError:
            name = "?"
        return f"killed by signal {n} ({name})"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return ""
