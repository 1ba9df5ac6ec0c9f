"""The reader process: full flight-recorder reads, decoded and processed outside the training process.

A full read on the agent thread holds the training process's GIL twice: while torch builds the dump
(C++ holding the GIL: 16-45 ms for a 2,000-entry ring) and while ~1,000 new entries are decoded and
processed in Python (up to 15-23 ms). On a 4-rank CPU job those reads were the agent's long steps
(BENCHMARKS.md, issue 15). Here torch's worker server (``fr_server.DumpServer``) builds the dump on its
own C++ threads, and a child process (``python -m hpar_agent.collectors.fr_reader``: no torch) fetches it
over the server's private unix socket and runs the ``Ledger``; both run below the training threads
whose cores they share (``fr_server.yield_cpu``: ``SCHED_IDLE`` by default). The agent thread sends one
request per read and waits on a pipe with the GIL released; it holds the GIL only to apply the
``Update`` (plain data, sub-millisecond to unpickle).

The child lives as long as the agent: it exits when its stdin closes (detach, exit, or the training
process dying). Any failure (no worker server in this torch, a child that cannot start, answers late
or errs) leaves the collector on in-process reads, with no entry counted twice. It costs a process of
~17-22 MiB resident per rank (``benchmarks/agent_rss.py``) and its CPU, niced, beside training.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from typing import IO, Any

from hpar_agent.collectors.fr_ledger import Groups, Ledger, Update
from hpar_agent.torch_compat import fr_server

#: Seconds the agent thread waits for one read (the child's own socket wait is shorter).
TIMEOUT_S = fr_server.TIMEOUT_S + 5.0
_LEN = struct.Struct("<I")


def cpus_per_local_rank() -> float:
    """CPUs this process may run on, shared by the ranks of its host (``LOCAL_WORLD_SIZE``, torchrun's)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return cpus / local


class ReaderError(RuntimeError):
    """The reader process failed or answered with an error."""


class ReaderTimeout(ReaderError):
    """No answer within ``TIMEOUT_S``: the child is stuck, or starved of CPU below training."""


def _send(stream: IO[bytes], obj: Any) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(body)) + body)
    stream.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; waits in ``select`` (no GIL held) until ``deadline`` (monotonic)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ReaderTimeout(f"no answer from the reader process within {TIMEOUT_S:g} s")
        data = os.read(fd, n - got)
        if not data:
            raise EOFError("the reader process closed its pipe")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _recv(fd: int, deadline: float | None = None) -> Any:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    return pickle.loads(_read_exact(fd, n, deadline))  # our own child's answer


def _child_env() -> dict[str, str]:
    """The child imports ``hpar_agent`` as this process did, attaches nothing and runs no zero-code shim."""
    env = {k: v for k, v in os.environ.items() if k != "HPAR_AUTOATTACH"}
    env["HPAR_DISABLE"] = "1"
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hpar_agent/collectors/fr_reader.py
    if os.path.basename(pkg) == "hpar_agent":  # a plain tree on sys.path (an editable install maps it itself)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(pkg), env.get("PYTHONPATH")) if p)
    return env


class ReaderProcess:
    """The agent's side: the worker server in this process, the child, one ``read`` per full read."""

    def __init__(
        self, recorders: list[str], *, attach_ns: int, recent: int, max_pending: int, cursors: dict[str, int],
        sched: str = "idle",
    ) -> None:
        self.server = fr_server.DumpServer(recorders, sched)  # raises when this torch has no handler for them
        self.sched = sched
        self.recorders = frozenset(self.server.handlers)
        self.cpu_s = 0.0  # the child's CPU time, as it reports it
        self.reads = 0
        if not sys.executable:
            self.server.close()
            raise fr_server.Unsupported("no Python executable to start the reader process with")
        try:
            self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "hpar_agent.collectors.fr_reader", sched],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=_child_env(), close_fds=True,
            )  # fmt: skip
            assert self.proc.stdin is not None
            _send(self.proc.stdin, {
                "path": self.server.path, "handlers": self.server.handlers,
                "ledger": {"attach_ns": attach_ns, "recent": recent, "max_pending": max_pending,
                           "cursors": cursors},
            })  # fmt: skip
        except Exception:
            self.close()
            raise

    def read(
        self, rec: str, *, now_ns: int, nccl_timing: bool, boundaries: list[tuple[int, int]], groups: Groups | None
    ) -> Update:
        """One full read of ``rec`` by the child (agent thread; waits with the GIL released)."""
        self.send(rec, now_ns=now_ns, nccl_timing=nccl_timing, boundaries=boundaries, groups=groups)
        return self.receive()

    def send(
        self, rec: str, *, now_ns: int, nccl_timing: bool, boundaries: list[tuple[int, int]], groups: Groups | None
    ) -> None:
        """Ask the child for a full read of ``rec`` (it dumps at once); ``receive`` takes the answer."""
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise ReaderError("the reader process is closed")
        try:
            _send(proc.stdin, {"rec": rec, "now_ns": now_ns, "nccl_timing": nccl_timing,
                               "boundaries": boundaries, "groups": groups})  # fmt: skip
        except OSError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> ReaderError:
        code = self.proc.poll() if self.proc is not None else None
        return ReaderError(f"reader process {'exited ' + str(code) if code is not None else 'failed'}: {exc}")

    def receive(self) -> Update:
        """The answer to the oldest ``send`` not yet received (waits with the GIL released)."""
        proc = self.proc
        if proc is None or proc.stdout is None:
            raise ReaderError("the reader process is closed")
        try:
            reply = _recv(proc.stdout.fileno(), time.monotonic() + TIMEOUT_S)
        except (OSError, EOFError) as exc:
            raise self._failed(exc) from exc
        self.cpu_s = float(reply.get("cpu_s", self.cpu_s))
        if "error" in reply:
            raise ReaderError(f"reader process: {reply['error']}")
        self.reads += 1
        if self.reads == 1:
            self.server.renice()  # any thread the server's pool started for that first dump
        upd: Update = reply["update"]
        return upd

    def close(self) -> None:
        """Stop the child (its stdin closes: it exits; killed after a second) and the worker server."""
        proc, self.proc = getattr(self, "proc", None), None
        if proc is not None:
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(1.0)
            except Exception:
                proc.kill()
                try:
                    proc.wait(1.0)
                except Exception:
                    pass
            if proc.stdout is not None:
                proc.stdout.close()
        self.server.close()

    def forget_in_child(self) -> None:
        """A forked child of the training process: close its copies of the pipes (the reader still
        gets EOF when the training process ends), stop nothing."""
        proc, self.proc = self.proc, None
        for stream in (getattr(proc, "stdin", None), getattr(proc, "stdout", None)):
            if stream is not None:
                try:
                    stream.close()  # the file object, not just its fd: nothing closes the number twice
                except OSError:
                    pass
        if proc is not None:
            proc.returncode = 0  # not this process's child: never waited for here


# ---------------------------------------------------------------------------------------- the child
def serve(inp: IO[bytes], out: IO[bytes]) -> int:
    """The child's loop: an init message, then one request per full read, until ``inp`` closes."""
    fd = inp.fileno()
    try:
        init = _recv(fd)
    except EOFError:
        return 0
    path, handlers = init["path"], init["handlers"]
    ledger = Ledger(**init["ledger"])
    while True:
        try:
            req = _recv(fd)
        except EOFError:
            return 0
        reply: dict[str, Any]
        try:
            if req.get("groups") is not None:
                ledger.groups = req["groups"]
            ledger.add_boundaries(req["boundaries"])
            handler, query = handlers[req["rec"]]
            data = fr_server.decode(handler, fr_server.post(path, handler, query), ledger.wanted_from(req["rec"]))
            upd = ledger.process(req["rec"], data, nccl_timing=req["nccl_timing"], now_ns=req["now_ns"])
            reply = {"update": upd}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["cpu_s"] = time.process_time()
        _send(out, reply)


def main() -> int:
    # Ctrl-C and a launcher's SIGTERM reach the whole process group: the reader must outlive them until
    # the rank's last read; it ends when its stdin closes (the rank detached, exited or died).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")  # answers go to the pipe the parent reads ...
    os.dup2(2, 1)  # ... and anything printed goes where stderr goes, never into that pipe
    fr_server.yield_cpu(0, sys.argv[1] if len(sys.argv) > 1 else "idle")  # below the training threads
    return serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    sys.exit(main())
