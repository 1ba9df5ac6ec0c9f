"""The metrics endpoint's HTTP(S) server: one asyncio loop on one daemon thread, bounded so that no
client can slow training, block exit or keep a scrape out.

Why not ``http.server`` or ``asyncio.start_server``: the first gives each connection a thread, so a
few clients that trickle their request hold every thread; the second accepts without bound and runs
the TLS handshake out of reach. Here connections are plain sockets the loop accepts itself:

- a connection's whole request head, TLS handshake included, must arrive within ``HEAD_DEADLINE_S``
  and fit in ``MAX_HEAD_BYTES``; a connection lives at most ``DEADLINE_S``;
- at most ``MAX_CONNECTIONS`` are held. At the cap, a new connection closes the oldest one that is not
  waiting for its answer and has been ``GRACE_S`` in its state: still sending its head or handshake,
  waiting for bcrypt, or not reading its answer. Slow clients so make room for a scraper, which sends
  its request at once. When no held connection can be closed, the next one waits in the kernel's
  accept queue (first come, first served) until one can: a scrape is delayed, never refused;
- answers go out at most one per ``MIN_INTERVAL_S`` over all connections, in arrival order: a flood
  spends little of the GIL training needs, and with N clients in a loop a scrape waits about
  N x ``MIN_INTERVAL_S``. Connections are accepted at most one per ``ACCEPT_INTERVAL_S``, which bounds
  what clients that connect and go away can cost;
- GET and HEAD are answered (any path); other methods get 405, bad requests 400, failed basic auth 401;
- bcrypt runs on its own worker thread, never on the loop; ``close`` does not wait for clients.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import io
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from prometheus_client.exposition import gzip_accepted

from hpar_agent.exporters.basic_auth import BasicAuth, credentials
from hpar_agent.exporters.endpoint_audit import (
    BAD_CLIENT_CERTIFICATE,
    NO_CLIENT_CERTIFICATE,
    NO_CREDENTIALS,
    UNKNOWN_USER,
    WRONG_PASSWORD,
    Audit,
)
from hpar_agent.exporters.endpoint_security import Security

log = logging.getLogger("hpar_agent")

#: Connections held at once (each is a file descriptor).
MAX_CONNECTIONS = 64
#: Seconds from accept to the end of the request head, TLS handshake included.
HEAD_DEADLINE_S = 5.0
#: Seconds a connection may live, from accept to its last byte.
DEADLINE_S = 30.0
#: Least spacing between two answers, over all connections (at most 50 a second).
MIN_INTERVAL_S = 0.02
#: Least spacing between two accepted connections (at most 200 a second).
ACCEPT_INTERVAL_S = 0.005
#: Largest request head (request line and headers) read.
MAX_HEAD_BYTES = 16 << 10
#: Seconds a connection is safe from being closed for another in each state: to finish its TLS
#: handshake and send its head, to have its password checked, to read its answer. A handshake on a
#: busy host takes a while: evicted at once, a scraper behind a flood of fast clients never got in.
GRACE_S = 1.0

# A connection's state: still sending its head, waiting for bcrypt, waiting for its turn, reading its
# answer. A queued one is never closed to make room, the others only after GRACE_S in their state.
HEAD, AUTH, QUEUED, SENDING = "head", "auth", "queued", "sending"

Render = Callable[[str, bool], tuple[bytes, str]]
_TEXT = {"Content-Type": "text/plain; charset=utf-8"}
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP method (RFC 9110 token)


class _Conn:
    __slots__ = ("handed", "peer", "since", "sock", "state", "stream", "task")

    def __init__(self, sock: socket.socket, stream: _Stream, peer: str) -> None:
        self.sock, self.stream, self.peer = sock, stream, peer
        self.handed = False  # the socket belongs to an asyncio transport, which closes it
        self.state = HEAD
        self.since = time.monotonic()
        self.task: asyncio.Task[None] | None = None


class _Stream(asyncio.Protocol):
    """Collects the request head; says when the connection is gone."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tls: bool) -> None:
        self.tls = tls
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: asyncio.Future[bytes | None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.head.done():
            return  # a body, or bytes after the head: not read
        self.buf += data
        end = _head_end(self.buf)
        if end:
            self.head.set_result(bytes(self.buf[:end]))
        elif len(self.buf) > MAX_HEAD_BYTES:
            self.head.set_result(None)

    def eof_received(self) -> bool:
        if not self.head.done():
            self.head.set_result(None)
        return not self.tls  # a client that half-closes after its request still gets the answer (TLS ends)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.head, self.lost):
            if not fut.done():
                fut.set_result(None)


def _certificate_refusal(exc: ssl.SSLError) -> str:
    """The audit reason of a handshake that failed on the client's certificate, else ""."""
    said = f"{exc.reason or ''} {exc}".upper()
    reason: str = ""
    if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in said or "CERTIFICATE_REQUIRED" in said:
        reason = NO_CLIENT_CERTIFICATE
    elif isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in said:
        reason = BAD_CLIENT_CERTIFICATE
    return reason


def _head_end(buf: bytearray) -> int:
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else 0


def parse_head(head: bytes) -> tuple[str, Any] | None:
    """(method, headers) of a request head, or None when it is not HTTP/1.x."""
    line, _, rest = head.partition(b"\n")
    try:
        words = line.rstrip(b"\r").decode("ascii").split(" ")
        if len(words) != 3 or not words[2].startswith("HTTP/1.") or not _TOKEN.match(words[0]):
            return None
        return words[0], http.client.parse_headers(io.BytesIO(rest))
    except (UnicodeDecodeError, http.client.HTTPException):
        return None


def response(status: HTTPStatus, headers: dict[str, str], body: bytes, with_body: bool = True) -> bytes:
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        "Server: hpar-agent",
        "Connection: close",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body if with_body else b"")


class MetricsServer:
    """Serves ``render(accept, gzip)`` -> (body, content type) on an already listening socket."""

    def __init__(
        self, sock: socket.socket, render: Render, security: Security, audit: Audit | None = None
    ) -> None:
        self.socket = sock
        self.render = render
        self.security = security
        self.auth = BasicAuth(security.users) if security.users else None
        self.audit = audit or Audit(lambda line: log.warning("%s", line))
        self.evicted = 0  # connections closed to make room for another
        self.timed_out = 0  # connections closed at a deadline
        self.answered = 0
        self.errors = 0  # unexpected exceptions of a connection or the loop
        self._conns: dict[_Conn, None] = {}
        self._next_turn = 0.0
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()  # a connection ended or became evictable
        self._thread = threading.Thread(target=self._run, name="hpar-metrics", daemon=True)

    @property
    def auth_failures(self) -> Mapping[str, int]:
        """Refused clients by reason (``endpoint_audit.REASONS``)."""
        failures: Mapping[str, int] = self.audit.failures
        return failures

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.socket.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving and close every connection; waits at most ``timeout`` for the loop to end."""
        try:
            self._loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:  # the loop is already closed
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.auth is not None:
            self.auth.close()

    # ------------------------------------------------------------------------------------- the loop
    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """What asyncio would log (a client's failed TLS shutdown, ...): counted, not logged into training's log."""
        self.errors += 1

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()
            self.socket.close()

    async def _main(self) -> None:
        acceptor = asyncio.ensure_future(self._accept_loop())
        flusher = asyncio.ensure_future(self._flush_audit())
        await self._stop.wait()
        tasks = [acceptor, flusher, *(c.task for c in self._conns if c.task is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self.socket)
            except OSError:  # out of file descriptors, a reset before accept: try again shortly
                await asyncio.sleep(0.1)
                continue
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            conn = _Conn(sock, _Stream(loop, self.security.tls is not None), peer)
            self._conns[conn] = None
            conn.task = loop.create_task(self._serve(conn))
            conn.task.add_done_callback(functools.partial(self._finish, conn))  # also if cancelled unstarted
            loop.call_later(GRACE_S, self._changed.set)  # evictable from then, if still in its head
            while len(self._conns) > MAX_CONNECTIONS and not self._evict(spare=conn):
                self._changed.clear()  # every held one awaits its answer: accept no more until one ends
                await self._changed.wait()
            await asyncio.sleep(ACCEPT_INTERVAL_S)

    async def _flush_audit(self) -> None:
        """The audit's pending line, once it is due, also when no more refusals come."""
        while True:
            await asyncio.sleep(1.0)
            self.audit.flush()

    def _evict(self, spare: _Conn) -> bool:
        """Close the oldest evictable connection other than ``spare``; False when there is none."""
        late = time.monotonic() - GRACE_S
        victims = [
            c for c in self._conns if c is not spare and c.state in (HEAD, AUTH, SENDING) and c.since < late
        ]
        if not victims:
            return False
        victim = min(victims, key=lambda c: c.since)
        self._drop(victim)
        self.evicted += 1
        if victim.task is not None:
            victim.task.cancel()
        return True

    def _drop(self, conn: _Conn) -> None:
        if conn in self._conns:
            del self._conns[conn]
            self._changed.set()

    def _enter(self, conn: _Conn, state: str) -> None:
        conn.state, conn.since = state, time.monotonic()
        if state in (AUTH, SENDING):  # evictable once its grace is over: wake a waiting accept then
            asyncio.get_running_loop().call_later(GRACE_S, self._changed.set)

    # ------------------------------------------------------------------------------ one connection
    async def _serve(self, conn: _Conn) -> None:
        try:
            await asyncio.wait_for(self._exchange(conn), DEADLINE_S)
        except asyncio.TimeoutError:
            self.timed_out += 1
        except ssl.SSLError as exc:  # a failed TLS handshake: a refused client certificate is audited
            reason = _certificate_refusal(exc)
            if reason:
                self.audit.refused(reason, None, conn.peer)
        except (OSError, ValueError):  # a reset
            pass
        except Exception:  # never let one connection reach the loop's exception handler
            self.errors += 1

    async def _exchange(self, conn: _Conn) -> None:
        head = await asyncio.wait_for(self._head(conn), HEAD_DEADLINE_S)
        if head is None:
            return
        answer = await self._answer(conn, head)
        transport = conn.stream.transport
        assert transport is not None
        self._enter(conn, SENDING)
        transport.write(answer)
        transport.close()  # once the answer is flushed
        self.answered += 1
        await conn.stream.lost

    async def _head(self, conn: _Conn) -> bytes | None:
        loop = asyncio.get_running_loop()
        conn.handed = True
        await loop.connect_accepted_socket(lambda: conn.stream, conn.sock, ssl=self.security.tls)
        return await conn.stream.head

    def _finish(self, conn: _Conn, _task: object) -> None:
        """The connection's task is over (answered, failed, timed out, evicted or never started)."""
        transport = conn.stream.transport
        if not conn.handed:
            conn.sock.close()
        elif transport is not None and not conn.stream.lost.done():
            transport.abort()
        self._drop(conn)  # (a handshake cut short: asyncio closed its transport)

    async def _answer(self, conn: _Conn, head: bytes) -> bytes:
        req = parse_head(head)
        allowed = req is None or await self._authorized(conn, req[1])
        self._enter(conn, QUEUED)
        await self._turn()
        if req is None:
            return response(HTTPStatus.BAD_REQUEST, _TEXT, b"bad request\n")
        method, headers = req
        send_body = method != "HEAD"  # an answer to HEAD never carries one
        if not allowed:
            challenge = {**_TEXT, "WWW-Authenticate": 'Basic realm="hpar-agent"'}
            return response(HTTPStatus.UNAUTHORIZED, challenge, b"Unauthorized\n", send_body)
        if method not in ("GET", "HEAD"):
            allow = {**_TEXT, "Allow": "GET, HEAD"}
            return response(HTTPStatus.METHOD_NOT_ALLOWED, allow, b"only GET and HEAD\n", send_body)
        gz = gzip_accepted(headers.get("Accept-Encoding", ""))
        body, content_type = self.render(headers.get("Accept", ""), gz)
        extra = {"Content-Type": content_type, **({"Content-Encoding": "gzip"} if gz else {})}
        return response(HTTPStatus.OK, extra, body, send_body)

    async def _authorized(self, conn: _Conn, headers: Any) -> bool:
        if self.auth is None:
            return True
        creds = credentials(headers.get("Authorization"))
        if creds is None:
            self.audit.refused(NO_CREDENTIALS, None, conn.peer)
            return False
        if self.auth.known(creds):
            return True
        loop = asyncio.get_running_loop()
        verdict: asyncio.Future[bool] = loop.create_future()

        def settle(ok: bool) -> None:
            if not verdict.done():
                verdict.set_result(ok)

        def done(ok: bool) -> None:  # on the worker thread
            loop.call_soon_threadsafe(settle, ok)

        self._enter(conn, AUTH)
        self.auth.check_later(creds, done, lambda: not verdict.done())
        ok = await verdict
        if not ok:  # told apart only after bcrypt ran: an unknown user costs what a wrong password costs
            why = WRONG_PASSWORD if creds[0] in self.auth.users else UNKNOWN_USER
            self.audit.refused(why, creds[0], conn.peer)
        return ok

    async def _turn(self) -> None:
        """Wait for this answer's turn: answers at least ``MIN_INTERVAL_S`` apart, first come first served."""
        now = asyncio.get_running_loop().time()
        turn = max(now, self._next_turn)
        self._next_turn = turn + MIN_INTERVAL_S
        if turn > now:
            await asyncio.sleep(turn - now)
