"""The demo stack's alert receiver: prints every Alertmanager webhook notification, one line per alert.

Alertmanager posts JSON (version 4 of its webhook payload) to http://alert-webhook:5001/<receiver>;
``docker compose logs -f alert-webhook`` shows what would have paged. Standard library only, so it
runs in a bare python image. Replace it with Slack/PagerDuty receivers in deploy/alertmanager.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20


def format_alerts(path: str, payload: dict[str, Any]) -> list[str]:
    """One line per alert: receiver path, status, alert name, severity, job id / rank, summary, and the
    runbook link when the rule has one."""
    lines = []
    for a in payload.get("alerts", []):
        labels, ann = a.get("labels", {}), a.get("annotations", {})
        where = " ".join(f"{k}={labels[k]}" for k in ("job", "job_id", "rank", "instance") if k in labels)
        runbook = f" (runbook: {ann['runbook_url']})" if ann.get("runbook_url") else ""
        lines.append(
            f"[{path.strip('/') or 'default'}] {a.get('status', '?').upper()} "
            f"{labels.get('alertname', '?')} ({labels.get('severity', '?')}) {where}: "
            f"{ann.get('summary', '')}{runbook}"
        )
    return lines


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        if not 0 < size <= MAX_BODY:
            self.send_error(413 if size else 411)
            return
        try:
            payload = json.loads(self.rfile.read(size))
        except ValueError:
            self.send_error(400, "not JSON")
            return
        for line in format_alerts(self.path, payload):
            print(line, flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the alert lines are the log."""


def main() -> None:
    port = int(os.environ.get("PORT", "5001"))
    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    print(f"alert-webhook listening on :{port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
