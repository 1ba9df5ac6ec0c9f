"""The real Prometheus and Alertmanager (Debian packages) on loopback, with a webhook receiver in the
test process: Prometheus loads the shipped rules of ``deploy/prometheus/rules``, scrapes targets it
discovers from per-job files (so a test adds a trainer's endpoints once the trainer is up) and sends
its alerts to the Alertmanager, which routes every alert to the webhook."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import yaml

from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

T = TypeVar("T")


class Webhook:
    """An Alertmanager webhook receiver: keeps every notification posted to it."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        received = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with received._lock:
                    received.notifications.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)
        self._thread.start()

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Every alert of every notification so far whose labels include ``labels``."""
        with self._lock:
            notes = list(self.notifications)
        return [
            a for n in notes for a in n["alerts"] if all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server:
    """A server subprocess with its log in a file; stopped with SIGTERM, killed if it lingers."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()

    def tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-3000:]


class PromStack:
    """Prometheus (1 s scrape and evaluation interval, the shipped rules, exemplar storage) and an
    Alertmanager routing every alert to :class:`Webhook` with no grouping delay.

    ``jobs`` are the scrape jobs; each discovers its targets from ``<dir>/targets-<job>.json``
    (:meth:`set_targets`), so endpoints come and go without a restart. ``scrape_options`` adds keys to
    a job's scrape config (``scheme``, ``basic_auth``, ``tls_config``, ...).
    """

    def __init__(
        self,
        workdir: Path,
        jobs: Sequence[str],
        interval: str = "1s",
        scrape_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if PROMETHEUS is None or ALERTMANAGER is None:
            raise RuntimeError("prometheus / prometheus-alertmanager not installed")
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[_Server] = []
        self.webhook = Webhook()
        self.scrape_options = dict(scrape_options or {})
        try:
            self._start(jobs, interval)
        except BaseException:
            self.close()
            raise

    def _start(self, jobs: Sequence[str], interval: str) -> None:
        assert PROMETHEUS is not None and ALERTMANAGER is not None
        am_cfg = {
            "route": {
                "receiver": "webhook",
                "group_by": ["job", "alertname"],
                "group_wait": "0s",
                "group_interval": "1s",
                "repeat_interval": "1h",
            },
            "receivers": [{"name": "webhook", "webhook_configs": [{"url": self.webhook.url}]}],
        }
        (self.dir / "alertmanager.yml").write_text(yaml.safe_dump(am_cfg))
        self.am_url = self._spawn(
            "alertmanager",
            lambda port: [
                ALERTMANAGER,
                f"--config.file={self.dir / 'alertmanager.yml'}",
                f"--storage.path={self.dir / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
        )
        for job in jobs:
            self.set_targets(job, [])
        prom_cfg = {
            "global": {
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "evaluation_interval": interval,
            },
            "rule_files": [str(RULES_DIR / "*.yml")],
            "alerting": {
                "alertmanagers": [{"static_configs": [{"targets": [self.am_url.split("//", 1)[1]]}]}]
            },
            "scrape_configs": [
                {
                    "job_name": job,
                    "file_sd_configs": [{"files": [str(self._targets_file(job))], "refresh_interval": "1s"}],
                    **self.scrape_options.get(job, {}),
                }
                for job in jobs
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        self.url = self._spawn(
            "prometheus",
            lambda port: [
                PROMETHEUS,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
        )

    def _spawn(self, name: str, cmd: Callable[[int], list[str]]) -> str:
        """Start a server on a free port (another on a new port if that one was taken meanwhile);
        return its base URL once ``/-/ready`` answers."""
        for attempt in range(3):
            port = free_port()
            server = _Server(name, cmd(port), self.dir / f"{name}.{attempt}.log")
            self.servers.append(server)
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 30
            while time.time() < deadline and server.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/-/ready", timeout=2):
                        return url
                except OSError:
                    time.sleep(0.2)
            server.stop()
            if "address already in use" not in server.tail():
                break
        raise RuntimeError(f"{name} did not start: {self.servers[-1].tail()}")

    def _targets_file(self, job: str) -> Path:
        return self.dir / f"targets-{job}.json"

    def set_targets(self, job: str, targets: Iterable[str]) -> None:
        """Replace the job's targets (``host:port``); Prometheus notices the file change by itself."""
        path = self._targets_file(job)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": sorted(targets)}] if targets else []))
        os.replace(tmp, path)

    # ------------------------------------------------------------------------------------ HTTP API
    def api(self, path: str, **params: object) -> Any:
        """``data`` of a Prometheus HTTP API answer; raises on an error answer (e.g. a bad query)."""
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {params}: HTTP {e.code}: {e.read().decode()[:500]}") from e
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, object] = {"query": expr}
        if at is not None:
            params["time"] = at
        return list(self.api("query", **params)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def targets(self, job: str) -> list[dict[str, Any]]:
        """The job's active targets as Prometheus sees them (``health``, ``lastError``, ...)."""
        return [
            t for t in self.api("targets", state="active")["activeTargets"] if t["labels"].get("job") == job
        ]

    def alerts(self) -> list[dict[str, Any]]:
        """Prometheus' active alerts (pending and firing)."""
        return list(self.api("alerts")["alerts"])

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.webhook.close()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path.name})\n{s.tail()}" for s in self.servers)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    """Every finite sample value of an instant (``value``) or range (``values``) query result."""
    out = []
    for series in result:
        points = series.get("values") or [series["value"]]
        out += [v for v in (float(p[1]) for p in points) if math.isfinite(v)]
    return out


def wait_for(check: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
    """Poll ``check`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.time() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
