"""What dynamo tells the compile collector, captured on the training thread while it compiles.

The compile start/end callbacks, a handler on the logger that receives every ``CompilationMetrics`` and
handlers on the graph-break/recompile artifact loggers each only append a typed record to one
BoundedBuffer (NamedTuples: they come at compile time only, next to a compile's milliseconds, and the
metrics record holds dynamo's object anyway). ``CounterDiff`` reads dynamo's process-global counters on
the agent thread. Every private torch name is reached through ``torch_compat.dynamo``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from hpar_agent.buffer import BoundedBuffer
from hpar_agent.torch_compat import dynamo

#: The artifacts whose text the capture keeps (graph-break messages with user stacks, guard failures).
ARTIFACTS = ("graph_breaks", "recompiles")


class CompileStarted(NamedTuple):
    """Dynamo started compiling (the start callback)."""

    compile_id: str
    #: (co_filename, co_firstlineno, co_name, local names, backend) of the frame; None off the forward
    frame: tuple[str, int, str, list[str], str] | None
    t_ns: int
    trigger: str  # the callback trigger: dynamo, lazy_backward, ...
    step: int


class CompileEnded(NamedTuple):
    """Dynamo finished compiling (the end callback)."""

    compile_id: str
    t_ns: int
    trigger: str


class CompileMetrics(NamedTuple):
    """Dynamo's ``CompilationMetrics`` of one compile attempt (``dynamo.metrics_fields`` reads it)."""

    metrics: Any
    t_ns: int


class GraphBreakText(NamedTuple):
    """A graph-break artifact record: the message with its user stack."""

    text: str
    t_ns: int
    compile_id: str


class RecompileText(NamedTuple):
    """A recompile artifact record: every failed guard with the user stack."""

    text: str
    t_ns: int
    compile_id: str


CompileRecord = CompileStarted | CompileEnded | CompileMetrics | GraphBreakText | RecompileText


class _Capture(logging.Handler):
    """Training thread: enqueue a log record's payload; forward to the ancestors' handlers what the
    user saw before the agent took over the logger's level/propagation."""

    def __init__(self, capture: DynamoCapture, kind: str) -> None:
        super().__init__(logging.DEBUG)
        self.capture = capture
        self.kind = kind  # "metrics" or an artifact of ARTIFACTS
        self.text_record = GraphBreakText if kind == "graph_breaks" else RecompileText
        self.forward: dict[str, int] = {}  # logger name -> level at/above which the user saw records

    def emit(self, record: logging.LogRecord) -> None:
        capture = self.capture
        try:
            if self.kind == "metrics":
                if record.args and isinstance(record.args, tuple):
                    obj = record.args[0]
                    if dynamo.is_compilation_metrics(obj):
                        capture.buffer.put(CompileMetrics(obj, time.time_ns()))
            else:
                text = record.getMessage()
                if record.exc_info and record.exc_info[1] is not None:
                    text += "\n" + str(record.exc_info[1])
                capture.buffer.put(self.text_record(text, time.time_ns(), dynamo.current_compile_id()))
            floor = self.forward.get(record.name)
            if floor is not None and record.levelno >= floor:
                _call_ancestors(logging.getLogger(record.name), record)
        except Exception as exc:
            capture.record_error(exc)


def _call_ancestors(logger: logging.Logger, record: logging.LogRecord) -> None:
    """What ``Logger.callHandlers`` does past the logger itself (its propagation)."""
    c = logger.parent
    while c is not None:
        for h in c.handlers:
            if record.levelno >= h.level:
                h.handle(record)
        if not c.propagate:
            break
        c = c.parent


class DynamoCapture:
    """Dynamo's start/end callbacks and the compile loggers' handlers: installed at attach, healed each
    poll (``torch._dynamo.reset()`` drops the callbacks, ``torch._logging.set_logs`` the loggers' state),
    removed at detach, leaving the loggers as the user had them."""

    def __init__(self, record_error: Callable[[BaseException], None]) -> None:
        self.record_error = record_error
        self.buffer: BoundedBuffer[CompileRecord] = BoundedBuffer("compile", 1 << 14)
        self.handlers = {k: _Capture(self, k) for k in ("metrics", *ARTIFACTS)}
        self.steps: Any = None  # the StepCollector whose count is the step a compile starts in
        self.known_backends: frozenset[str] = frozenset()  # dynamo's registered backend names
        self.callbacks = False  # the start/end callbacks are registered
        self.compiled = False  # dynamo started a compile since install (set on the training thread)
        self._saved: dict[str, tuple[int, bool]] = {}  # logger -> (level, propagate) before install
        self._owned_artifacts: set[str] = set()
        self._metrics_level = logging.INFO

    def install(self) -> None:
        dynamo.load()  # artifact loggers must exist before we configure them
        self.known_backends = dynamo.known_backends()
        self.callbacks = dynamo.register_callbacks(self._on_start, self._on_end)
        self._capture_metrics()
        for art in ARTIFACTS:
            self._capture_artifact(art)

    def _capture_metrics(self) -> None:
        log = logging.getLogger(dynamo.COMPILE_METRICS_LOGGER)
        h = self.handlers["metrics"]
        if log.name not in self._saved:
            self._saved[log.name] = (log.level, log.propagate)
            h.forward[log.name] = log.getEffectiveLevel() if log.propagate else logging.CRITICAL + 1
            self._metrics_level = min(logging.INFO, log.getEffectiveLevel())
        if h not in log.handlers:
            log.addHandler(h)
        log.setLevel(self._metrics_level)
        log.propagate = False

    def _capture_artifact(self, art: str) -> None:
        user_on = dynamo.artifact_enabled(art) and art not in self._owned_artifacts
        if not user_on and dynamo.enable_artifact(art):
            self._owned_artifacts.add(art)
        h = self.handlers[art]
        for log in dynamo.artifact_loggers([art]):
            if log.name not in self._saved:
                self._saved[log.name] = (log.level, log.propagate)
            if h not in log.handlers:
                log.addHandler(h)
            log.setLevel(logging.DEBUG)
            if not user_on:
                log.propagate = False  # quiet: no stderr unless the user asked for this artifact

    def heal(self) -> bool:
        """Re-register after ``torch._dynamo.reset()`` (it clears the callbacks) and re-capture the
        loggers when ``torch._logging.set_logs`` reset them; a few attribute reads per poll. True when
        the callbacks had been dropped (a reset: compile ids start again)."""
        reset = self.callbacks and not dynamo.callbacks_registered(self._on_start, self._on_end)
        if reset:
            dynamo.register_callbacks(self._on_start, self._on_end)
        log = logging.getLogger(dynamo.COMPILE_METRICS_LOGGER)
        if self.handlers["metrics"] not in log.handlers or log.level != self._metrics_level or log.propagate:
            self._capture_metrics()
        for art in ARTIFACTS:
            if art in self._owned_artifacts and not dynamo.artifact_enabled(art):
                self._owned_artifacts.discard(art)
                self._capture_artifact(art)
        return reset

    def uninstall(self) -> None:
        if self.callbacks:
            dynamo.remove_callbacks(self._on_start, self._on_end)
            self.callbacks = False
        for name, (level, propagate) in self._saved.items():
            log = logging.getLogger(name)
            for h in self.handlers.values():
                log.removeHandler(h)
            log.setLevel(level)
            log.propagate = propagate
        self._saved.clear()
        for art in self._owned_artifacts:
            dynamo.disable_artifact(art)
        self._owned_artifacts.clear()

    # --------------------------------------------------------------------------------- training thread
    def _on_start(self, args: Any) -> None:
        self.compiled = True
        try:
            step = self.steps.count if self.steps is not None else 0
            trigger = dynamo.trigger_name(args)
            info = None
            frame = dynamo.compiling_frame() if trigger == "dynamo" else None  # a few frames read
            if frame:
                code, local_names, backend = frame
                info = (code.co_filename, code.co_firstlineno, code.co_name, local_names, backend)
            self.buffer.put(CompileStarted(dynamo.compile_id_of(args), info, time.time_ns(), trigger, step))
        except Exception as exc:
            self.record_error(exc)

    def _on_end(self, args: Any) -> None:
        try:
            self.buffer.put(
                CompileEnded(dynamo.compile_id_of(args), time.time_ns(), dynamo.trigger_name(args))
            )
        except Exception as exc:
            self.record_error(exc)


class CounterDiff:
    """Increases of dynamo's process-global counters since install (a counter that went down was
    cleared: its new value is the increase), read on the agent thread once per poll."""

    def __init__(self) -> None:
        self._seen: dict[Any, int] = {}  # last raw value of each counter

    def deltas(self, snap: dict[str, Any]) -> list[tuple[tuple[Any, ...], int]]:
        """(key, increase > 0) of every counter of ``dynamo.counters_snapshot()`` that rose: keys
        ``("cache", name, result)``, ``("limit",)``, ``("graphs",)``, ``("gb", message)``."""
        items: list[tuple[Any, int]] = [(("cache", *k), v) for k, v in snap["caches"].items()]
        items.append((("limit",), snap["limit"]))
        items.append((("graphs",), snap["graphs"]))
        items += [(("gb", k), v) for k, v in snap["graph_break"].items()]
        out = []
        for key, value in items:
            last = self._seen.get(key, 0)
            delta = value - last if value >= last else value
            self._seen[key] = value
            if delta > 0:
                out.append((key, delta))
        return out
