"""The one adapter for torch._dynamo / torch._logging private APIs (verified on torch 2.11 and 2.13).

Everything the compile collector and zero-code mode need from dynamo go through here: the package's
name, the compile start/end callback
registry, the process-global ``counters``, the ``CompilationMetrics`` log record, the graph-break and
recompile artifact loggers and the current compile id. Each accessor feature-detects and returns an
empty/neutral value when torch moved it, so the collector reports ``up=0`` instead of failing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: dynamo's package: zero-code mode arms once the program imported it (and wraps its ``reset``).
MODULE = "torch._dynamo"
#: Receives every ``CompilationMetrics`` at INFO as ``record.args[0]`` (torch._utils_internal
#: .log_compilation_event), including attempts rejected by the recompile limit.
COMPILE_METRICS_LOGGER = "torch._utils_internal"
#: Artifact loggers (``getArtifactLogger(module, artifact)`` -> ``<module>.__<artifact>``).
ARTIFACT_LOGGERS: dict[str, tuple[str, ...]] = {
    "graph_breaks": (
        "torch._dynamo.symbolic_convert.__graph_breaks",
        "torch._dynamo.convert_frame.__graph_breaks",
        "torch._dynamo.exc.__graph_breaks",
    ),
    "recompiles": ("torch._dynamo.guards.__recompiles",),
}
#: ``counters["stats"]`` key dynamo bumps for every graph it hands to the backend.
UNIQUE_GRAPHS = "unique_graphs"
#: ``counters["unimplemented"]`` key prefix of a frame that hit ``config.recompile_limit``.
RECOMPILE_LIMIT_PREFIX = "Dynamo recompile limit exceeded"
#: (counters group, counters key) -> (cache label, result label) for the compile caches.
CACHE_COUNTERS: dict[tuple[str, str], tuple[str, str]] = {
    ("aot_autograd", "autograd_cache_hit"): ("aot_autograd", "hit"),
    ("aot_autograd", "autograd_cache_miss"): ("aot_autograd", "miss"),
    ("aot_autograd", "autograd_cache_bypass"): ("aot_autograd", "bypass"),
    ("inductor", "fxgraph_cache_hit"): ("fx_graph", "hit"),
    ("inductor", "fxgraph_cache_miss"): ("fx_graph", "miss"),
    ("inductor", "fxgraph_cache_bypass"): ("fx_graph", "bypass"),
}
#: CompilationMetrics fields the collector reads (absent fields read as None on older torch).
METRIC_FIELDS = (
    "compile_id",
    "co_name",
    "co_filename",
    "co_firstlineno",
    "cache_size",
    "recompile_reason",
    "restart_reasons",
    "fail_type",
    "fail_reason",
    "graph_op_count",
    "graph_node_count",
    "graph_input_count",
    "graph_node_shapes",
    "entire_frame_compile_time_s",
    "backend_compile_time_s",
    "inductor_compile_time_s",
    "code_gen_time_s",
    "duration_us",
    "is_forward",
    "is_runtime",
    "start_time_us",
    "end_time_us",
    "frame_key",
    "stack_trace",
    "exception_stack_trace",
    "fail_user_frame_filename",
    "fail_user_frame_lineno",
)
#: The frame of ``convert_frame._compile`` holds the frame being compiled and the backend.
_COMPILE_FN = ("_compile", "convert_frame.py")


def load() -> None:
    """Import dynamo: its artifact loggers must exist before the compile collector configures them."""
    import torch._dynamo  # noqa: F401


def _callback_handler() -> Any:
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    return callback_handler if hasattr(callback_handler, "register_start_callback") else None


def register_callbacks(start: Callable[[Any], None], end: Callable[[Any], None] | None) -> bool:
    """Register compile start/end callbacks (idempotent; ``end`` None: a start callback only); False
    when the registry is missing."""
    h = _callback_handler()
    if h is None:
        return False
    if start not in h.start_callbacks:
        h.register_start_callback(start)
    if end is not None and end not in h.end_callbacks:
        h.register_end_callback(end)
    return True


def callbacks_registered(start: Callable[[Any], None], end: Callable[[Any], None]) -> bool:
    """False after ``torch._dynamo.reset()`` cleared the registry (a cheap list scan)."""
    h = _callback_handler()
    return h is not None and start in h.start_callbacks and end in h.end_callbacks


def remove_callbacks(start: Callable[[Any], None], end: Callable[[Any], None]) -> None:
    h = _callback_handler()
    if h is None:
        return
    while start in h.start_callbacks:
        h.remove_start_callback(start)
    while end in h.end_callbacks:
        h.remove_end_callback(end)


def registered_callbacks() -> tuple[list[Any], list[Any]]:
    """The live (start, end) callback lists, for tests and diagnostics."""
    h = _callback_handler()
    return (list(h.start_callbacks), list(h.end_callbacks)) if h is not None else ([], [])


def trigger_name(args: Any) -> str:
    """``CallbackArgs.callback_trigger`` as a lower-case label (dynamo, lazy_backward, ...)."""
    trig = getattr(args, "callback_trigger", None)
    return str(getattr(trig, "name", trig or "unknown")).lower()


def compile_id_of(args: Any) -> str:
    return str(getattr(args, "compile_id", ""))


def current_compile_id() -> str:
    """The compile id of the compile running on this thread ('' outside one)."""
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:
        return ""
    return "" if cid is None else str(cid)


def is_compilation_metrics(obj: Any) -> bool:
    return type(obj).__name__ == "CompilationMetrics" and hasattr(obj, "compile_id")


def metrics_fields(obj: Any) -> dict[str, Any]:
    """Plain dict of the CompilationMetrics fields the collector uses (agent thread)."""
    return {f: getattr(obj, f, None) for f in METRIC_FIELDS}


def _counters() -> Mapping[str, Mapping[str, int]]:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return counters


def counters_snapshot() -> dict[str, Any]:
    """Copy what the collector diffs: cache lookups, recompile-limit hits, graph-break messages and
    graphs compiled (``stats.unique_graphs``: one per graph handed to the backend).

    Reads only the few groups needed (``.get`` so the defaultdict grows no new keys)."""
    c = _counters()
    caches: dict[tuple[str, str], int] = {}
    for (group, key), labels in CACHE_COUNTERS.items():
        grp = c.get(group)
        if grp:
            caches[labels] = caches.get(labels, 0) + int(grp.get(key, 0))
    unimpl = c.get("unimplemented") or {}
    limit = sum(int(v) for k, v in list(unimpl.items()) if str(k).startswith(RECOMPILE_LIMIT_PREFIX))
    breaks = dict(c.get("graph_break") or {})
    stats = c.get("stats") or {}
    return {
        "caches": caches,
        "limit": limit,
        "graph_break": breaks,
        "graphs": int(stats.get(UNIQUE_GRAPHS, 0)),
    }


def _log_state() -> Any:
    try:
        from torch._logging import _internal
    except ImportError:
        return None
    return getattr(_internal, "log_state", None)


def artifact_enabled(name: str) -> bool:
    st = _log_state()
    return bool(st is not None and st.is_artifact_enabled(name))


def enable_artifact(name: str) -> bool:
    """Turn an artifact on in torch's log state; False when the API is missing."""
    st = _log_state()
    if st is None or not hasattr(st, "enable_artifact"):
        return False
    st.enable_artifact(name)
    return True


def disable_artifact(name: str) -> None:
    st = _log_state()
    names = getattr(st, "artifact_names", None)
    if isinstance(names, set):
        names.discard(name)


def artifact_loggers(names: Iterable[str]) -> list[logging.Logger]:
    return [logging.getLogger(q) for n in names for q in ARTIFACT_LOGGERS.get(n, ())]


def _backend_name(fn: Any) -> str:
    """Registered name of a dynamo backend callable: the first name along its wrappers (dynamo's
    WrapBackendDebug, torch._TorchCompileWrapper, partials, the ``compile_fn`` of the DDPOptimizer that
    dynamo puts around the backend of a frame under DDP, a user callable that sets ``compiler_name``) in
    dynamo's registry, else the first name found ('' when none)."""
    names: list[str] = []
    for _ in range(6):
        for attr in ("_compiler_name", "compiler_name"):
            name = getattr(fn, attr, None)
            if isinstance(name, str) and name:
                names.append(name)
        nxt = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "func", None)
            or getattr(fn, "__wrapped__", None)
            or getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
        )
        if nxt is None or nxt is fn:
            break
        fn = nxt
    known = known_backends()
    return next((n for n in names if n in known), names[0] if names else "")


def compiling_frame(max_depth: int = 24) -> tuple[Any, list[str], str] | None:
    """(code object, local NAMES, backend name) of the frame dynamo is compiling on this thread.

    Called from the compile start callback: walks the Python stack up to ``convert_frame._compile``
    (a few frames) and reads its ``frame`` and ``compiler_fn`` arguments. Only the names of the
    frame's locals are taken, never their values. None when torch moved these names."""
    f: Any = sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return None
        co = f.f_code
        if co.co_name == _COMPILE_FN[0] and co.co_filename.endswith(_COMPILE_FN[1]):
            loc = f.f_locals
            frame = loc.get("frame")
            code = getattr(frame, "f_code", None) or loc.get("code")
            if code is None:
                return None
            try:
                names = [str(k) for k in getattr(frame, "f_locals", {}) or {}][:64]
            except Exception:
                names = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
            return code, names, _backend_name(loc.get("compiler_fn"))
        f = f.f_back
    return None


def known_backends() -> frozenset[str]:
    """Names in dynamo's backend registry (bounded label values); empty when unavailable."""
    try:
        from torch._dynamo import list_backends

        return frozenset(list_backends(exclude_tags=())) | {"eager", "inductor"}
    except Exception:
        return frozenset({"eager", "aot_eager", "inductor"})
