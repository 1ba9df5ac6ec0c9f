"""Clients that try to keep a scrape out of an HTTP endpoint, run in their own process (their threads
must not share the endpoint's GIL). Each client starts again whenever the server closes it, for as
long as the attack lasts, as an attacker or a broken proxy would.

    python -m testkit.hostile_clients --port P --mode dribble -n 8 --duration 60

- ``dribble``: send a request line, then one header byte every ``--every`` seconds, never ending the head;
- ``idle``: connect and send nothing;
- ``flood``: scrape in a loop (connect, GET, read the answer, close); with ``--ca`` over TLS (each
  scrape a full handshake), without credentials.

Prints ``ready`` once every client has connected, and on exit one JSON line: connections made,
answers read (flood), and how many connections the server closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import ssl
import sys
import threading
import time


class Attack:
    def __init__(self, port: int, mode: str, n: int, duration: float, every: float, ca: str = "") -> None:
        self.port, self.mode, self.n, self.every = port, mode, n, every
        self.tls = ssl.create_default_context(cafile=ca) if ca else None
        self.until = time.monotonic() + duration
        self.lock = threading.Lock()
        self.connected = threading.Semaphore(0)
        self.stats = {"connections": 0, "answers": 0, "denied": 0, "closed_by_server": 0, "refused": 0}

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

    def client(self) -> None:
        first = True
        while time.monotonic() < self.until:
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_hostname="127.0.0.1")
            except OSError:
                self.count("refused")
                time.sleep(0.05)
                continue
            self.count("connections")
            try:
                if self.mode == "flood":
                    if first:
                        self.connected.release()
                    self.scrape(sock)
                else:
                    self.hold(sock, first)
            except OSError:
                self.count("closed_by_server")
            finally:
                first = False
                sock.close()

    def scrape(self, sock: socket.socket) -> None:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: hpar\r\n\r\n")
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        if got.startswith(b"HTTP/1.1 200"):
            self.count("answers")
        elif got.startswith(b"HTTP/1.1 401"):
            self.count("denied")
        else:
            self.count("closed_by_server")

    def hold(self, sock: socket.socket, first: bool) -> None:
        if self.mode == "dribble":
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: hpar\r\nX-Slow: ")
        if first:
            self.connected.release()
        sock.settimeout(self.every)
        while time.monotonic() < self.until:
            try:
                if sock.recv(1) == b"":  # closed by the server
                    self.count("closed_by_server")
                    return
            except TimeoutError:
                if self.mode == "dribble":
                    sock.sendall(b"a")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=("dribble", "idle", "flood"), required=True)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between dribbled bytes")
    ap.add_argument("--ca", default="", help="connect over TLS, trusting this CA (PEM)")
    args = ap.parse_args(argv)
    attack = Attack(args.port, args.mode, args.n, args.duration, args.every, args.ca)
    threads = [threading.Thread(target=attack.client, daemon=True) for _ in range(args.n)]
    for t in threads:
        t.start()
    for _ in threads:
        attack.connected.acquire()
    print("ready", flush=True)
    for t in threads:
        t.join(max(0.0, attack.until - time.monotonic()) + 35)
    with contextlib.suppress(BrokenPipeError):  # the parent stopped reading
        print(json.dumps(attack.stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
