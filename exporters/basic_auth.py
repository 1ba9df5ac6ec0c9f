"""HTTP basic auth against bcrypt hashes, as the exporter-toolkit's ``basic_auth_users`` defines it.

bcrypt costs tens of milliseconds by design, so it never runs on the endpoint's loop: one worker
thread does it (bcrypt releases the GIL while it hashes). A user's last good password is remembered
as its SHA-256, so a scraper pays bcrypt once per process rather than on every scrape, as the toolkit
caches it too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger("hpar_agent")

Credentials = tuple[str, bytes]


def credentials(header: str | None) -> Credentials | None:
    """(user, password) of an ``Authorization: Basic`` header, or None when it is absent or malformed."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(value.strip(), validate=True)
        user, sep, password = raw.partition(b":")
        return (user.decode("utf-8"), password) if sep else None
    except (binascii.Error, ValueError):  # bad base64, or a user name that is not UTF-8
        return None


class BasicAuth:
    """The users' bcrypt hashes, the remembered good passwords and the bcrypt worker."""

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self.users = dict(users)
        self._good: dict[str, bytes] = {}  # user -> SHA-256 of the last password bcrypt accepted
        self._jobs: queue.SimpleQueue[tuple[Credentials, Callable[[bool], None], Callable[[], bool]] | None]
        self._jobs = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._dummy: bytes | None = None

    def known(self, creds: Credentials) -> bool:
        """Whether these credentials passed bcrypt before (cheap: no bcrypt)."""
        good = self._good.get(creds[0])
        return good is not None and hmac.compare_digest(good, hashlib.sha256(creds[1]).digest())

    def check(self, creds: Credentials) -> bool:
        """bcrypt: slow, off the loop."""
        import bcrypt

        user, password = creds
        hashed = self.users.get(user)
        if hashed is None and self._dummy is None:
            # an unknown user costs what a wrong password costs: names cannot be probed by timing
            cost = int(next(iter(self.users.values()))[4:6])
            self._dummy = bcrypt.hashpw(os.urandom(16), bcrypt.gensalt(rounds=cost))
        try:
            ok = bcrypt.checkpw(password, hashed or self._dummy or b"") and hashed is not None
        except ValueError:  # a password over bcrypt's 72 bytes
            ok = False
        if ok:
            self._good[user] = hashlib.sha256(password).digest()
        return ok

    def check_later(
        self, creds: Credentials, done: Callable[[bool], None], wanted: Callable[[], bool]
    ) -> None:
        """Run ``check`` on the worker thread and hand the verdict to ``done`` there; skipped when
        ``wanted()`` is false by then (the connection went away)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="hpar-metrics-auth", daemon=True)
            self._worker.start()
        self._jobs.put((creds, done, wanted))

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            creds, done, wanted = job
            try:
                if wanted():
                    done(self.check(creds))
            except Exception as exc:  # never let the worker die: a failed check is a refusal
                log.debug("hpar_agent: basic auth check failed: %r", exc)
                try:
                    done(False)
                except Exception:
                    pass
