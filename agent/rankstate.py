"""A rank's process identity and last known state, in a small memory-mapped file that outlives it.

``state.rank<R>`` in the run directory holds the rank's pid, host and process start time, the steps it
completed and when, and how it ended (a clean exit, an uncaught exception, a signal). The step hook
writes two integers into the mapping (no system call), and the kernel keeps the page when the process
dies, so after a SIGKILL or the OOM killer the file still says at which step the rank was: what
``hpar-agent run`` reads to name the first rank to fail and how, and what a peer's ``RankGone`` reads
of a process on its own host (``proc_state``) to tell a dead rank from a stopped or a slow one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpar_agent.component import Component
from hpar_agent.safefiles import open_private, open_regular

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.topology import Topology

MAGIC = b"HPR1"
#: magic, pid, rank, world, process start (clock ticks after boot), steps completed, last step (epoch
#: ns), end kind, signal, end time (epoch ns); then the host and the end's text, NUL-padded.
_HEAD = struct.Struct("<4siiiqqqiiq")
_HOST = 64
_TEXT = 256
SIZE = _HEAD.size + _HOST + _TEXT
_STEPS_AT = struct.calcsize("<4siiiq")
_STEPS = struct.Struct("<qq")
#: how a rank ended
RUNNING, EXITED, EXCEPTION, SIGNALLED = 0, 1, 2, 3
ENDS = {RUNNING: "running", EXITED: "exited", EXCEPTION: "exception", SIGNALLED: "signal"}


def file_name(rank: int) -> str:
    return f"state.rank{rank}"


def start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks after boot (``/proc/<pid>/stat`` field 22): with the pid,
    it names one process even after the pid is reused. None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def proc_state(pid: int, ticks: int | None, host: str) -> str:
    """What became of a process, as far as this host can see it: ``running``, ``stopped`` (SIGSTOP, a
    debugger), ``zombie`` (exited, not reaped yet), ``gone``, or "" when it runs on another host (or
    cannot be read)."""
    if host != socket.gethostname() or pid <= 0:
        return ""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return ""
    fields = data[data.rindex(b")") + 2 :].split()
    if ticks is not None and int(fields[19]) != ticks:
        return "gone"  # the pid was reused by another process
    state = fields[0].decode()
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(state, "running")


def exit_status(pid: int) -> int | None:
    """The wait status of an exited process that its parent has not reaped yet (``/proc/<pid>/stat``
    field 52, Linux 3.5+), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[49]) if fields[0] == b"Z" else None
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class RankRecord:
    """One ``state.rank<R>`` file as read back."""

    pid: int
    rank: int
    world: int
    ticks: int
    steps: int
    last_step_ns: int
    end: str
    signal: int
    end_ns: int
    host: str
    text: str


def read(path: str) -> RankRecord | None:
    """A state file's record; None for anything that is not one (a tool reads whatever lies there)."""
    try:
        fd = open_regular(path)  # a FIFO named like a state file must not block the tool
        with os.fdopen(fd, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    if len(data) < SIZE or data[:4] != MAGIC:
        return None
    _magic, pid, rank, world, ticks, steps, last, end, sig, end_ns = _HEAD.unpack_from(data)
    host = data[_HEAD.size : _HEAD.size + _HOST].rstrip(b"\0").decode(errors="replace")
    text = data[_HEAD.size + _HOST :].rstrip(b"\0").decode(errors="replace")
    return RankRecord(pid, rank, world, ticks, steps, last, ENDS.get(end, "running"), sig, end_ns, host, text)


class RankState(Component):
    """Keeps ``state.rank<R>`` current: the identity at install, the step count at every step boundary
    (training thread: one ``pack_into``), the end at uninstall (``AgentContext.exit_reason``)."""

    name = "rankstate"

    def __init__(self) -> None:
        super().__init__()
        self._map: mmap.mmap | None = None
        self.path = ""

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self._open(ctx.topology)

    def _open(self, topo: Topology) -> None:
        ctx = self.require_ctx()
        if not ctx.run_dir:
            return
        path = os.path.join(ctx.run_dir, file_name(topo.rank))
        fd = open_private(path, append=False, readable=True)
        try:
            os.ftruncate(fd, SIZE)
            m = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        pid = os.getpid()
        _HEAD.pack_into(
            m, 0, MAGIC, pid, topo.rank, topo.world_size, start_ticks(pid) or 0, 0, 0, RUNNING, 0, 0
        )
        m[_HEAD.size : _HEAD.size + _HOST] = socket.gethostname().encode()[:_HOST].ljust(_HOST, b"\0")
        self._map, self.path = m, path

    def on_topology(self, old: Topology, new: Topology) -> None:
        """A rank learned later (attached before its process group) moves to its own file."""
        if new.rank == old.rank or self._map is None:
            return
        steps = _STEPS.unpack_from(self._map, _STEPS_AT)
        self._close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self._open(new)
        if self._map is not None:
            _STEPS.pack_into(self._map, _STEPS_AT, *steps)

    def step_hook(self, step: int, t_ns: int) -> None:
        m = self._map
        if m is not None:
            _STEPS.pack_into(m, _STEPS_AT, step + 1, t_ns)

    def uninstall(self) -> None:
        m = self._map
        if m is None:
            return
        reason = self.require_ctx().exit_reason
        kind = (
            EXCEPTION
            if reason.startswith("exception")
            else SIGNALLED
            if reason.startswith("signal")
            else EXITED
        )
        signum = _signum(reason) if kind == SIGNALLED else 0
        struct.pack_into("<iiq", m, _HEAD.size - 16, kind, signum, _now_ns())
        m[_HEAD.size + _HOST :] = reason.encode()[:_TEXT].ljust(_TEXT, b"\0")
        self._close()

    def _close(self) -> None:
        m, self._map = self._map, None
        if m is not None:
            with contextlib.suppress(Exception):
                m.close()

    def summary(self) -> dict[str, Any]:
        return {"path": self.path}


def _signum(reason: str) -> int:
    import signal

    name = reason.partition(":")[2].strip().split()[0] if ":" in reason else ""
    return int(getattr(signal, name, 0) or 0)


def _now_ns() -> int:
    import time

    return time.time_ns()
