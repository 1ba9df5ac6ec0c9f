"""Full flight-recorder dumps built on torch's worker-server thread instead of the caller's.

``_dump_fr_trace`` / ``_dump_nccl_trace`` build their pickle in C++ holding the GIL: ~20 ms for a
2,000-entry ring, during which the training thread cannot run Python, and on a fast multi-rank loop
that was the agent's longest stall (``benchmarks/rank_timeline.py``). torch's control-plane worker
server (``_WorkerServer``, private API) answers ``POST /handler/<name>`` on its own C++ thread with the
same dump over a unix socket, which the reader process (``collectors.fr_reader``) reads: the training
process's GIL is not held for the dump, nor for its decoding (``benchmarks/fr_dump_gil.py`` measures it).

The server is a thread and a socket in the user's process; torch logs its start and stop as warnings,
which go nowhere when the main thread starts and stops it (stderr is pointed at /dev/null for the
sub-millisecond start and stop). Its gloo handler speaks JSON whose fields differ from the pickle's
(normalized here).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import Any

#: Recorder -> (handler, query) of the worker server: gloo has only the JSON form, NCCL the pickle.
HANDLERS: dict[str, tuple[str, str]] = {
    "gloo": ("fr_trace_json", ""),
    "nccl": ("dump_nccl_trace_pickle", "includecollectives=true&includestacktraces=false&onlyactive=false"),
}
#: Seconds the agent thread waits for one dump (a stuck server must not stop the agent's passes).
TIMEOUT_S = 10.0
#: How the dump's helpers (the worker server's threads and the reader process) yield the CPU to
#: training (``AgentConfig.helper_sched``). A full read is a burst of ~30-60 ms of CPU on each (the
#: dump's JSON, its decoding). At niceness 19 a helper gets ~1.5 % of a contended core, yet a bare
#: thread spending a read's CPU that way cost the 4-rank CPU job as much as the whole agent (likely
#: because a core running it still counts as busy when the scheduler places a waking training or
#: gloo thread; inferred, not observed). ``SCHED_IDLE`` threads run only where nothing else wants the
#: core: the same burst cost about half, and the agent ~0.2 % instead of ~1.7 % (BENCHMARKS.md,
#: "Sixteenth session").
HELPER_NICE = 19
_SERVER_THREAD = "pt_workerserver"


def post(path: str, handler: str, query: str = "", timeout: float = TIMEOUT_S) -> bytes:
    """``POST /handler/<handler>`` over the unix socket ``path`` (HTTP/1.1, no keep-alive); the body."""
    target = f"/handler/{handler}" + (f"?{query}" if query else "")
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(f"POST {target} HTTP/1.1\r\nHost: local\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while data := s.recv(1 << 20):
            chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode("latin-1")
    if status.split(" ")[1:2] != ["200"]:
        raise OSError(f"worker server {handler}: {status}: {body[:200]!r}")
    return body


def normalize_json(data: dict[str, Any]) -> dict[str, Any]:
    """The JSON dump as the pickle spells it: ``pg_status`` counters as ints, ``process_group`` as a
    tuple, an unset ``time_discovered_*`` as None (the JSON writes 0)."""
    status = data.get("pg_status") or {}
    data["pg_status"] = {
        str(pg): {k: int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v for k, v in fields.items()}
        for pg, fields in status.items()
        if isinstance(fields, dict)
    }
    for e in data.get("entries") or []:
        if isinstance(e.get("process_group"), list):
            e["process_group"] = tuple(e["process_group"])
        for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            if e.get(k) == 0:
                e[k] = None
    return data


def _threads(name: str) -> set[int]:
    """Ids of this process's threads whose name is ``name`` (Linux ``/proc``; empty elsewhere)."""
    out: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    out.add(int(tid))
        except (OSError, ValueError):
            continue  # the thread ended
    return out


def yield_cpu(tid: int, sched: str = "idle") -> None:
    """Put thread ``tid`` (0: the caller) below training: ``SCHED_IDLE`` for ``"idle"`` where the OS
    has it and allows it (lowering needs no privilege on Linux), else niceness ``HELPER_NICE``."""
    if sched == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, HELPER_NICE)
    except (OSError, AttributeError):
        pass


def handler_names() -> set[str]:
    """The worker server's handlers in this torch (none without a worker server)."""
    try:
        import torch._C._distributed_c10d as c10d

        if not hasattr(c10d, "_WorkerServer"):
            return set()
        return set(c10d._get_handler_names())  # type: ignore[attr-defined]  # private, not in the stubs
    except (ImportError, AttributeError):
        return set()


def handled(recorders: list[str], names: set[str] | None = None) -> dict[str, tuple[str, str]]:
    """Recorder -> (handler, query) for the recorders this torch's worker server can dump."""
    names = handler_names() if names is None else names
    return {r: HANDLERS[r] for r in recorders if r in HANDLERS and HANDLERS[r][0] in names}


def decode(handler: str, body: bytes, first_id: int | None = None) -> dict[str, Any]:
    """A handler's answer as ``flight_recorder.dump`` returns it. ``first_id``: the reader needs the
    entries from that record id on only, and the JSON's older part is left unparsed (parsing is most of
    a read's cost in the reader: 17.6 of 29.5 ms for 2,000 gloo entries, half of them new)."""
    if handler.endswith("json"):
        data = _json_from(body, first_id) if first_id is not None else None
        return normalize_json(data if data is not None else json.loads(body))
    data = pickle.loads(body)  # produced by torch itself, in the training process
    return data if isinstance(data, dict) else {}


_RID = b'"record_id":'


def _json_from(body: bytes, first_id: int) -> dict[str, Any] | None:
    """The JSON dump with only its entries from ``first_id`` on, parsed from the slice that holds them;
    None (parse it all) wherever the layout is not the one torch writes: entries oldest first and in
    consecutive record ids, their keys sorted (no object before ``record_id``), no list of objects in
    the later top-level keys (``pg_config``, ``pg_status``), and ``first_id`` in the ring or just past
    its newest entry."""
    end = body.rfind(b'}],"') + 1  # the entries' closing bracket (no later top-level key holds objects in a list)
    if end <= 0:
        return None
    pos = body.find(_RID + b"%d," % first_id)
    if pos < 0:  # nothing new, or the entry was overwritten (then the gap must be counted: parse all)
        last = body.rfind(_RID, 0, end)
        num = body[last + len(_RID) : last + len(_RID) + 20].split(b",", 1)[0] if last >= 0 else b""
        if not num.isdigit() or int(num) != first_id - 1:
            return None
        entries: list[Any] = []
    else:
        start = body.rfind(b"{", 0, pos)
        if start <= 0 or end < pos or body[start - 1 : start] not in (b"[", b","):
            return None
        try:
            entries = json.loads(b"[" + body[start:end] + b"]")
        except ValueError:
            return None
        if any(not isinstance(e, dict) or e.get("record_id") != first_id + i for i, e in enumerate(entries)):
            return None
    try:
        rest = json.loads(b"{" + body[end + 2 :])
    except ValueError:
        return None
    if not isinstance(rest, dict):
        return None
    rest["entries"] = entries
    return rest


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 on /dev/null for the block: torch's C++ log lines of the server's start and
    stop. Kept to the sub-millisecond start (with its first request) and stop, and to the main
    thread, which is then inside the agent (attach, detach, exit): another thread's line written in
    that window would be lost, so elsewhere torch's lines go through."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


class Unsupported(RuntimeError):
    """This torch (or this process) cannot run the worker-server reads: reads stay in-process."""


#: Every live server of this process: a forked child must never destroy one (``_keep_in_child``).
_LIVE: weakref.WeakSet[DumpServer] = weakref.WeakSet()


def _keep_in_child() -> None:
    """After ``fork``, in the child: the servers' C++ objects are made immortal. Destroying one runs
    its ``shutdown``, which shuts down the listening socket the child shares with the parent: the
    parent's server thread then fails to listen and torch terminates the whole training process
    (seen with torch 2.13: a forked child's exit aborted its parent). The child's copy of the socket
    closes with the child; the parent keeps serving."""
    import ctypes

    for server in list(_LIVE):
        obj = server.__dict__.pop("_server", None)
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # never released: no destructor here
        server._dir = ""  # the directory is the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_keep_in_child)


class DumpServer:
    """A worker server of this process on a private unix socket, and full dumps through it."""

    def __init__(self, recorders: list[str], sched: str = "idle") -> None:
        import torch._C._distributed_c10d as c10d

        if not hasattr(c10d, "_WorkerServer"):
            raise Unsupported("this torch has no worker server (torch._C._distributed_c10d._WorkerServer)")
        names = handler_names()
        self.handlers = handled(recorders, names)
        if not self.handlers:
            raise Unsupported(f"no worker-server handler for the recorders {recorders} in this torch")
        self._dir = tempfile.mkdtemp(prefix="hpar-fr-")  # short: a unix socket path has ~107 bytes
        self.path = os.path.join(self._dir, "s")
        self._others = _threads(_SERVER_THREAD)  # another server's (the user's own) stay as they are
        self.sched = sched
        self.reniced: set[int] = set()
        try:
            with _quiet_stderr():
                self._server: Any = c10d._WorkerServer(self.path)
                # answered once before anything else: a server shut down before its first request
                # can hang in shutdown (torch 2.13)
                post(self.path, "ping" if "ping" in names else next(iter(self.handlers.values()))[0], timeout=5.0)
        except Exception:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.renice()
        _LIVE.add(self)

    def renice(self) -> None:
        """Put this server's threads (a listener and a pool that builds every dump, started by its
        first request) below training (``yield_cpu``); cheap to repeat (threads done are skipped)."""
        new = _threads(_SERVER_THREAD) - self._others - self.reniced
        for tid in new:
            yield_cpu(tid, self.sched)
        self.reniced |= new

    def dump(self, recorder: str) -> dict[str, Any]:
        """One full dump of ``recorder`` (as ``flight_recorder.dump`` returns it); raises on failure."""
        handler, query = self.handlers[recorder]
        return decode(handler, post(self.path, handler, query))

    def close(self) -> None:
        server, self._server = getattr(self, "_server", None), None
        try:
            if server is not None:
                with _quiet_stderr():
                    server.shutdown()
        finally:
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
