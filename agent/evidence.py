"""Evidence files written when an alert fires or the GPU runs out of memory: py-spy stacks, CUDA
allocator snapshots, FR dumps.

An alert's evidence is written on the agent thread (never the training thread), which keeps running
while training is stuck in C++; an out-of-memory's on the thread that ran out, once per process. Every
kind is rate-limited and size-bounded, and files are created 0600 in ``<run_dir>/evidence`` (0700):
stacks and allocation traces reveal code paths and data shapes. Missing tools (py-spy, no
ptrace permission, a CPU-only build) give one clear log line, never an exception.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hpar_agent.safefiles import private_dir, read_regular, write_new
from hpar_agent.torch_compat import cuda_memory

log = logging.getLogger("hpar_agent")

PYSPY_TIMEOUT_S = 20.0
#: ``py-spy record`` of a MemoryLeak: seconds sampled and samples per second (a bounded profile).
PROFILE_SECONDS = 5
PROFILE_RATE = 50
PROFILE_PLACEHOLDER = b'{"hpar": "py-spy record running, failed or interrupted: no profile yet"}\n'


class Evidence:
    """Per-process evidence writer; ``min_interval_s`` applies per kind, ``max_files`` per process."""

    def __init__(
        self,
        run_dir: str,
        rank: int,
        *,
        enabled: bool = True,
        min_interval_s: float = 300.0,
        max_files: int = 64,
        max_bytes: int = 64 << 20,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.dir = os.path.join(run_dir, "evidence")
        self.rank = rank
        self.enabled = enabled and bool(run_dir)
        self.min_interval_s = min_interval_s
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.on_error = on_error
        self.files: list[str] = []
        self._last: dict[str, float] = {}
        self._said: set[str] = set()
        self.history_started = False
        self.history_step: int | None = None  # the training thread's step count as the recording began
        self.snapshot_step: int | None = None  # and as the last allocator snapshot was taken
        self._steps_now: Callable[[], int] | None = None  # that count, read live
        self.history_why = (  # why there is no snapshot with history, when there is none
            "the allocator's history was not recording when the alert fired (confirmed at once)"
        )
        self.last_snapshot: dict[str, Any] | None = None  # the last allocator snapshot, until taken
        self.recording: threading.Thread | None = None  # the last py-spy record, for tests and shutdown
        self.device: Any = None  # this rank's CUDA device (the agent thread's current one is device 0)

    # ------------------------------------------------------------------------------------ plumbing
    def _say_once(self, key: str, msg: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("hpar_agent evidence: %s", msg)

    def _allowed(self, kind: str) -> bool:
        if not self.enabled or len(self.files) >= self.max_files:
            return False
        last = self._last.get(kind)
        if last is not None and time.monotonic() - last < self.min_interval_s:
            return False
        self._last[kind] = time.monotonic()
        return True

    def _write(self, name: str, data: bytes) -> str | None:
        if len(data) > self.max_bytes:
            self._say_once(
                f"size:{name}", f"{name}: {len(data)} bytes exceeds the {self.max_bytes} limit; skipped"
            )
            return None
        private_dir(self.dir)  # 0700; a planted symlink or a foreign directory is refused
        path = os.path.join(self.dir, name)
        write_new(path, data)  # O_EXCL|O_NOFOLLOW, 0600: never overwrites or follows a planted file
        self.files.append(path)
        return path

    def _name(self, tag: str, kind: str, ext: str) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return f"{tag}.rank{self.rank}.{stamp}.{len(self.files)}.{kind}.{ext}"

    # ------------------------------------------------------------------------------------ kinds
    def py_spy(self, tag: str, limit: str = "pyspy") -> list[str]:
        """``py-spy dump`` of every thread of this process, as text and as JSON (``limit``: the rate
        limit it counts against)."""
        if not self._allowed(limit):
            return []
        exe = shutil.which("py-spy") or _beside_python("py-spy")
        if exe is None:
            self._say_once("pyspy", "py-spy not found (pip install py-spy); no stack dump")
            return []
        out = []
        for ext, extra in (("txt", []), ("json", ["--json"])):
            try:
                res = subprocess.run(
                    [exe, "dump", "--pid", str(os.getpid()), *extra],
                    capture_output=True,
                    timeout=PYSPY_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                self._say_once("pyspy-run", f"py-spy dump failed ({exc}); no stack dump")
                break
            if res.returncode != 0:
                why = res.stderr.decode(errors="replace").strip().splitlines()
                self._say_once(
                    "pyspy-rc",
                    f"py-spy dump exited {res.returncode} ({why[-1] if why else 'no message'}); in a "
                    "container it needs CAP_SYS_PTRACE",
                )
                break
            path = self._write(self._name(tag, "pyspy", ext), res.stdout)
            if path:
                out.append(path)
        return out

    def py_spy_record(self, tag: str, seconds: int = PROFILE_SECONDS) -> list[str]:
        """A bounded ``py-spy record`` (speedscope JSON) of this process: the design document's
        sampled profile of a leak. py-spy runs in a subprocess waited on by a daemon thread, so neither
        the training thread nor the agent thread waits for it, and ``--nonblocking`` never pauses the
        process it samples. Returns the path the profile is written to: created now (0600) holding a
        one-line placeholder that py-spy replaces when it finishes; the placeholder stays when py-spy
        fails or the process ends first, and a profile over max_bytes is removed."""
        if not self._allowed("profile"):
            return []
        exe = shutil.which("py-spy") or _beside_python("py-spy")
        if exe is None:
            self._say_once("pyspy", "py-spy not found (pip install py-spy); no stack dump")
            return []
        path = self._write(self._name(tag, "profile", "speedscope.json"), PROFILE_PLACEHOLDER)
        if path is None:
            return []
        cmd = [
            exe,
            "record",
            "--pid",
            str(os.getpid()),
            "--duration",
            str(int(seconds)),
            "--rate",
            str(PROFILE_RATE),
            "--format",
            "speedscope",
            "--output",
            path,
            "--nonblocking",
        ]
        t = threading.Thread(
            target=self._record, args=(cmd, path, seconds), name="hpar-pyspy-record", daemon=True
        )
        t.start()
        self.recording = t
        return [path]

    def _record(self, cmd: list[str], path: str, seconds: int) -> None:
        try:
            res = subprocess.run(cmd, capture_output=True, timeout=seconds + PYSPY_TIMEOUT_S, check=False)
            if res.returncode != 0:
                why = res.stderr.decode(errors="replace").strip().splitlines()
                self._say_once(
                    "pyspy-record",
                    f"py-spy record exited {res.returncode} ({why[-1] if why else 'no message'})",
                )
            elif os.path.getsize(path) > self.max_bytes:
                self._say_once(
                    "size:profile", f"py-spy profile over the {self.max_bytes} byte limit; removed"
                )
                with contextlib.suppress(OSError):
                    os.unlink(path)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._say_once("pyspy-record", f"py-spy record failed ({exc}); no profile")

    def start_memory_history(
        self, max_entries: int = 100_000, steps_now: Callable[[], int] | None = None
    ) -> bool:
        """Start recording CUDA allocations with stacks (lazily: only once a leak is suspected).
        ``steps_now``: the training thread's step count, read as the recording starts and as the
        snapshot is taken (a pass's count is older than either by up to a pass's steps)."""
        if self.history_started or not self.enabled:
            if not self.enabled:
                self.history_why = "evidence collection is off (HPAR_EVIDENCE)"
            return self.history_started
        try:
            if not cuda_memory.cuda_initialized():
                self.history_why = "this process uses no CUDA device: no allocator history (CPU)"
                return False
            cuda_memory.record_history(self.device, max_entries)
        except Exception as exc:
            self.history_why = f"allocator history unavailable ({exc})"
            self._say_once("history", self.history_why)
            return False
        self.history_started = True
        self._steps_now = steps_now
        self.history_step = steps_now() if steps_now is not None else None
        return True

    def stop_memory_history(self) -> None:
        """Stop recording allocations (a suspicion that cleared, or the snapshot is taken): recording
        costs every allocation and free for as long as it runs."""
        if not self.history_started:
            return
        self.history_started = False
        try:
            cuda_memory.stop_history(self.device)
        except Exception as exc:
            self._say_once("history-stop", f"allocator history could not be stopped ({exc})")

    def allocator_snapshot(self, tag: str) -> list[str]:
        """A ``torch.cuda.memory._snapshot()`` pickle (open it in pytorch.org/memory_viz); the snapshot
        is also kept (``take_snapshot``) for the leak's site. The recording stops either way."""
        if not self.history_started:
            return []
        try:
            if not self._allowed("allocator"):
                self.history_why = (
                    f"the allocator snapshot was rate-limited (one every {self.min_interval_s:.0f} s, "
                    f"{self.max_files} evidence files at most)"
                )
                return []
            self.snapshot_step = self._steps_now() if self._steps_now is not None else None
            snap = cuda_memory.snapshot(self.device)
            data = pickle.dumps(snap)
        except Exception as exc:
            self.history_why = f"allocator snapshot failed ({exc})"
            self._say_once("snapshot", self.history_why)
            return []
        finally:
            self.stop_memory_history()
        self.last_snapshot = snap
        path = self._write(self._name(tag, "allocator", "pickle"), data)
        return [path] if path else []

    def take_snapshot(self) -> tuple[dict[str, Any] | None, int | None, str]:
        """(the last allocator snapshot, the steps its history recorded, why there is none), once: it
        can be large."""
        snap, self.last_snapshot = self.last_snapshot, None
        why = self.history_why
        if snap is None and self.enabled and not cuda_memory.cuda_initialized():
            why = "this process uses no CUDA device: no allocator history (CPU)"
        began, taken = self.history_step, self.snapshot_step
        return snap, (taken - began if began is not None and taken is not None else None), why

    def save(self, tag: str, kind: str, ext: str, data: bytes, limit: str = "") -> list[str]:
        """``data`` as one file of ``kind``, under the rate limit ``limit`` (default: ``kind``): the
        out-of-memory record and the snapshot it took itself."""
        if not self._allowed(limit or kind):
            return []
        path = self._write(self._name(tag, kind, ext), data)
        return [path] if path else []

    def fr_dump(self, tag: str) -> list[str]:
        """Every flight recorder this build has, without stack traces: as JSON, and as the pickle torch's
        analyser reads (``hpar-agent fr-trace RUN_DIR`` runs it on every rank's)."""
        if not self._allowed("fr"):
            return []
        from hpar_agent.torch_compat import flight_recorder as fr

        out = []
        for recorder in fr.available_recorders():
            for fmt, ext in (("json", "json"), ("pickle", "pickle")):
                try:
                    data = fr.dump_bytes(recorder, fmt)
                except Exception as exc:
                    self._say_once(
                        f"fr:{recorder}:{fmt}", f"the {recorder} flight recorder's {fmt} dump failed ({exc})"
                    )
                    continue
                path = self._write(self._name(tag, f"fr-{recorder}", ext), data) if data else None
                if path:
                    out.append(path)
        return out

    def collect(self, tag: str, kinds: tuple[str, ...]) -> list[str]:
        """Every kind of evidence in ``kinds`` (pyspy, allocator, fr, profile); the paths written."""
        paths: list[str] = []
        for kind in kinds:
            try:
                if kind == "pyspy":
                    paths += self.py_spy(tag)
                elif kind == "allocator":
                    paths += self.allocator_snapshot(tag)
                elif kind == "fr":
                    paths += self.fr_dump(tag)
                elif kind == "profile":
                    paths += self.py_spy_record(tag)
            except OSError as exc:  # a full disk, a refused path: counted, said once per kind
                if self.on_error is not None:
                    self.on_error(exc)
                self._say_once(f"os:{kind}", f"writing {kind} evidence failed ({exc})")
        return paths


def main_stack(path: str, depth: int = 3) -> list[str]:
    """The innermost ``depth`` frames of the main thread in a ``py-spy dump --json`` file that are the
    program's own (not a library's; all frames when none is), as ``file:line in function: source
    line``: what the process was doing, in its own code, when it was dumped."""
    import json
    import linecache

    try:
        threads = json.loads(read_regular(path, 1 << 20))
        main = next(t for t in threads if t.get("thread_name") == "MainThread")
        frames = main.get("frames") or []
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return []

    def library(f: dict[str, Any]) -> bool:
        name = str(f.get("filename", ""))
        return "/site-packages/" in name or "/dist-packages/" in name or "/lib/python3" in name

    user = [f for f in frames if not library(f)]  # the program's own lines first: where it called in
    chosen = (user or frames)[:depth]
    out = []
    for fr in chosen:
        src = linecache.getline(str(fr.get("filename", "")), int(fr.get("line") or 0)).strip()
        where = f"{fr.get('short_filename') or fr.get('filename')}:{fr.get('line')} in {fr.get('name')}"
        out.append(f"{where}: {src[:120]}" if src else where)
    return out


def _beside_python(name: str) -> str | None:
    """Console scripts of the interpreter's environment when its bin/ is not on PATH."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None
