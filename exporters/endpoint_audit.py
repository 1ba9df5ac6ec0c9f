"""The endpoint's audit trail: each refused client counted by reason
(``hpar_endpoint_auth_failures_total{reason}``), and one log line a minute at most naming the last
refused user and peer address, never a password: enough to see a brute force or a misconfigured
scraper without letting a flood of failures flood the training log."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

#: Why a client was refused (the ``reason`` label values).
NO_CREDENTIALS = "no_credentials"
WRONG_PASSWORD = "wrong_password"
UNKNOWN_USER = "unknown_user"
NO_CLIENT_CERTIFICATE = "no_client_certificate"
BAD_CLIENT_CERTIFICATE = "bad_client_certificate"
REASONS = (NO_CREDENTIALS, WRONG_PASSWORD, UNKNOWN_USER, NO_CLIENT_CERTIFICATE, BAD_CLIENT_CERTIFICATE)
#: Least seconds between two log lines.
LOG_EVERY_S = 60.0
_NAME_CHARS = 64


def _shown(user: str) -> str:
    """A user name fit for a log line: quoted, escaped and cut (it is whatever a client sent)."""
    text = user if len(user) <= _NAME_CHARS else user[:_NAME_CHARS] + "..."
    return ascii(text)


class Audit:
    """Counts refusals; ``say`` gets at most one line per ``LOG_EVERY_S`` (the first refusal at once,
    the ones after it summed into the next line, which ``flush`` writes when it is due)."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.clock = say, clock
        self.failures: Counter[str] = Counter(
            dict.fromkeys(REASONS, 0)
        )  # fixed keys: read from other threads
        self._pending: Counter[str] = Counter()
        self._last: tuple[str, str, str] | None = None  # reason, user, peer of the latest refusal
        self._logged_at: float | None = None

    def refused(self, reason: str, user: str | None, peer: str) -> None:
        self.failures[reason] += 1
        self._pending[reason] += 1
        self._last = (reason, "" if user is None else _shown(user), peer)
        self.flush()

    def flush(self) -> None:
        """Write the pending line if one is due."""
        now = self.clock()
        if not self._pending or self._last is None:
            return
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        n = sum(self._pending.values())
        reasons = ", ".join(f"{r.replace('_', ' ')} {c}" for r, c in sorted(self._pending.items()))
        reason, user, peer = self._last
        who = f"user {user} from {peer}" if user else f"a client at {peer}"
        since = "" if self._logged_at is None else f" in the last {now - self._logged_at:.0f} s"
        self.say(
            f"hpar_agent: metrics endpoint refused {n} client(s){since} ({reasons}); the last: {who} "
            f"({reason.replace('_', ' ')})"
        )
        self._pending.clear()
        self._logged_at = now
