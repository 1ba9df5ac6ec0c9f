"""The secured endpoint's front: a small process of the agent's own that terminates TLS and checks
passwords, so that no client can take the training process's CPU or GIL for them.

With a TLS-only web config, 200 clients connecting and scraping in a loop made the training step's
p90 15-25x longer when the handshakes, the encryption and the answers ran on a thread of the training
process. Here they run in the front, a Python process started with ``subprocess`` (fork and exec at
once: nothing of a CUDA parent runs in it) at a lower priority (``nice`` +10), which serves the
listening socket the agent bound (port handling is unchanged) with the same bounded server
(``http_server``). The training process keeps one thread, which sleeps in ``recv`` until the front
asks for the exposition: at most once per ``CACHE_S`` per format, however many clients scrape, since
the front shares one rendering between them.

The two talk over a socket pair in JSON lines: the front sends ``render`` (answered by a header line
and the body), ``stats`` (its connection and refusal counts, when they change), ``log`` (an audit
line), ``ready`` or ``error``. The front ends when the agent closes the endpoint (SIGTERM), or within
``WATCH_S`` of the training process ending however it ends (its parent changes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("hpar_agent")

#: The front's scheduling priority below training (``os.nice`` increment).
NICE = 10
#: Seconds between the front's checks that the training process is still its parent.
WATCH_S = 0.5
#: Seconds a rendered exposition is shared by the front's scrapes.
CACHE_S = 1.0
#: Seconds the front waits for the training process to render before the scrape fails.
RENDER_WAIT_S = 5.0
_MAX_LINE = 1 << 16


# ------------------------------------------------------------------------------- training process
class Front:
    """The training process's side: starts the front on ``sock`` and feeds it ``render``'s output.

    Exposes the front's counts as ``MetricsServer`` does (``evicted``, ``timed_out``, ``answered``,
    ``errors``, ``auth_failures``) for the health families."""

    def __init__(
        self,
        sock: socket.socket,
        render: Callable[[str, bool], tuple[bytes, str]],
        settings: Mapping[str, str | None],
        on_error: Callable[[str], None],
    ) -> None:
        self.render = render
        self.on_error = on_error
        self._address = (str(sock.getsockname()[0]), int(sock.getsockname()[1]))
        self.evicted = self.timed_out = self.answered = self.errors = 0
        self.auth_failures: Counter[str] = Counter()
        self.ready = threading.Event()
        self._closing = False
        self.socket, child = socket.socketpair()  # ``socket``: what a forked child closes
        env = {k: v for k, v in os.environ.items() if k != "HPAR_AUTOATTACH"}
        env["PYTHONSAFEPATH"] = "1"  # the working directory's modules never shadow the front's
        cmd = [
            sys.executable,
            "-m",
            "hpar_agent.exporters.secure_front",
            str(sock.fileno()),
            str(child.fileno()),
            json.dumps(dict(settings)),
        ]
        try:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(sock.fileno(), child.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a Ctrl-C to the job's process group is training's to handle
            )
        except BaseException:
            self.socket.close()
            raise
        finally:
            child.close()
            sock.close()  # the front's now: closed here, the port is the front's alone
        self._send_lock = threading.Lock()
        self._feeder = threading.Thread(target=self._feed, name="hpar-metrics-feed", daemon=True)
        self._feeder.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def close(self, timeout: float = 2.0) -> None:
        """End the front (it closes every connection) and wait at most ``timeout`` for it."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self._feeder.join(timeout)
        self.socket.close()

    def _feed(self) -> None:
        """Answer the front until it ends; sleeps in ``recv`` (no GIL) in between."""
        reader = self.socket.makefile("rb")
        try:
            while line := reader.readline(_MAX_LINE):
                self._handle(json.loads(line))
        except (OSError, ValueError) as exc:
            if not self._closing:
                self.on_error(f"lost the endpoint's front process: {exc}")
        finally:
            reader.close()
        if self._closing:
            return
        try:
            code: int | None = self.proc.wait(WATCH_S * 4)
        except subprocess.TimeoutExpired:
            code = None
        if code != 1:  # 1: it said why (an ``error`` message)
            self.on_error(
                f"the endpoint's front process ended (exit status {code}); no metrics endpoint on this rank "
                "until the agent is attached again (training goes on)"
            )

    def _handle(self, msg: dict[str, Any]) -> None:
        if "render" in msg:
            accept, gz = msg["render"]
            try:
                body, content_type = self.render(str(accept), bool(gz))
                head = {"id": msg.get("id"), "type": content_type, "len": len(body)}
            except Exception as exc:
                body, head = b"", {"id": msg.get("id"), "error": f"{type(exc).__name__}: {exc}"}
                self.on_error(f"rendering the exposition failed: {exc!r}")
            with self._send_lock:
                self.socket.sendall(json.dumps(head).encode() + b"\n" + body)
        elif "stats" in msg:
            stats = msg["stats"]
            for key in ("evicted", "timed_out", "answered", "errors"):
                setattr(self, key, int(stats.get(key, 0)))
            self.auth_failures = Counter({str(k): int(v) for k, v in stats.get("auth_failures", {}).items()})
        elif "log" in msg:
            log.warning("%s", str(msg["log"]))
        elif "error" in msg:
            self.on_error(str(msg["error"]))
        elif msg.get("ready"):
            self.ready.set()


# --------------------------------------------------------------------------------------- the front
class _Link:
    """The front's side of the socket pair: ``render`` for the server's loop (cached, shared by
    concurrent scrapes), ``send`` for the rest."""

    def __init__(self, chan: socket.socket) -> None:
        self.chan = chan
        self.buf = bytearray()  # what was received and not yet used: a timeout loses nothing
        self.lock = threading.Lock()
        self.closed = False
        self._next_id = 0
        self._cache: dict[tuple[str, bool], tuple[float, bytes, str]] = {}

    def send(self, msg: dict[str, Any]) -> None:
        try:
            with self.lock:
                self.chan.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            self.closed = True

    def render(self, accept: str, gz: bool) -> tuple[bytes, str]:
        from prometheus_client.exposition import choose_encoder

        key = (choose_encoder(accept)[1], gz)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1], hit[2]
        self._next_id += 1
        want = self._next_id
        self.send({"render": [accept, gz], "id": want})
        deadline = time.monotonic() + RENDER_WAIT_S
        try:
            while True:  # a late answer to an earlier request is read and dropped
                end = self._fill(deadline, lambda: self.buf.find(b"\n") + 1)
                head = json.loads(self.buf[:end])
                total = end + int(head.get("len", 0))
                self._fill(deadline, functools.partial(self._whole, total))
                body = bytes(self.buf[end:total])
                del self.buf[:total]  # only once whole: a timeout in between loses nothing
                if head.get("id") == want:
                    break
        except (OSError, ValueError):
            if hit is not None:
                return hit[1], hit[2]  # the training process is busy: the last rendering
            raise
        if "error" in head:
            raise RuntimeError(head["error"])
        self._cache[key] = (time.monotonic(), body, str(head["type"]))
        return body, str(head["type"])

    def _whole(self, total: int) -> int:
        return total if len(self.buf) >= total else 0

    def _fill(self, deadline: float, ready: Callable[[], int]) -> int:
        """Receive until ``ready()`` is non-zero (and return it) or the deadline passes (TimeoutError)."""
        while not (n := ready()):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the training process did not render in time")
            self.chan.settimeout(left)
            chunk = self.chan.recv(1 << 20)
            if not chunk:
                self.closed = True
                raise ConnectionError("the training process closed the endpoint")
            self.buf += chunk
        return n


def _stats(server: Any) -> dict[str, Any]:
    return {
        "evicted": server.evicted,
        "timed_out": server.timed_out,
        "answered": server.answered,
        "errors": server.errors,
        "auth_failures": dict(server.audit.failures),
    }


def main(argv: list[str]) -> int:
    """The front: ``LISTEN_FD CHANNEL_FD SETTINGS_JSON``."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
    parent = os.getppid()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    link = _Link(socket.socket(fileno=int(argv[1])))

    from hpar_agent.config import AgentConfig
    from hpar_agent.exporters.endpoint_audit import Audit
    from hpar_agent.exporters.endpoint_security import WebConfigError, load_security
    from hpar_agent.exporters.http_server import MetricsServer

    try:
        # the files again, from this process (an SSL context cannot be handed over): the training
        # process checked them a moment ago, and a change in between fails here as it would there
        security = load_security(AgentConfig(**json.loads(argv[2])), environ={})
    except (WebConfigError, ValueError, TypeError) as exc:
        link.send({"error": f"no metrics endpoint on this rank: {exc} (training goes on)"})
        return 1
    sock.setblocking(False)
    server = MetricsServer(sock, link.render, security, Audit(lambda line: link.send({"log": line})))
    server.start()
    link.send({"ready": True})
    last: dict[str, Any] = {}
    while not stop.wait(WATCH_S) and os.getppid() == parent and not link.closed:
        stats = _stats(server)
        if stats != last:
            link.send({"stats": stats})
            last = stats
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
