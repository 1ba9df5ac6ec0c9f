"""torch.compile telemetry: compiles, recompiles, graph breaks, cache lookups, compile time, and a
per-rank graph fingerprint, from dynamo's own push points (no per-step cost).

Training-thread side (only while dynamo compiles, ``compile_capture``): the compile start/end
callbacks, a handler on the logger that receives every ``CompilationMetrics`` and handlers on the
graph-break/recompile artifact loggers. Each only appends a record to one BoundedBuffer. The agent
thread turns those into counters, ``dynamo.compile`` spans, and JSONL events that keep the full text
(reasons, user file:line stacks, guard failures) out of label values. Cache hit/miss counts come from
diffing dynamo's process-global ``counters`` once per poll, and so are graph breaks and graphs
compiled: the metrics equal dynamo's own ``counters["graph_break"]`` and
``counters["stats"]["unique_graphs"]`` since attach (the artifact text adds the user stack; a frame
that traced no op is no graph). Every private torch name is reached through ``torch_compat.dynamo``;
the log text (graph-break messages, guard failures) is parsed by ``torch_compat.dynamo_log``.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent.catalogue import STEP_BUCKETS
from hpar_agent.collectors.compile_capture import (
    CompileEnded,
    CompileMetrics,
    CompileStarted,
    CounterDiff,
    DynamoCapture,
    GraphBreakText,
)
from hpar_agent.collectors.steps import StepCollector
from hpar_agent.component import Component
from hpar_agent.histogram import Histogram
from hpar_agent.spans import SpanRecord
from hpar_agent.torch_compat import dynamo
from hpar_agent.torch_compat.dynamo_log import (
    break_reason,
    c10d_call,
    failed_guards,
    frame_id,
    graph_break_key,
    guard_kind,
    guard_text,
    node_name,
    user_frame,
    user_frames,
)

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

PHASES = (
    ("entire_frame", "entire_frame_compile_time_s"),
    ("backend", "backend_compile_time_s"),
    ("inductor", "inductor_compile_time_s"),
    ("code_gen", "code_gen_time_s"),
)
#: Distinct graph-break keys kept as label values; later new keys count as "other".
MAX_BREAK_KEYS = 32
_TRIGGER_LABEL = {"dynamo": "forward"}
#: Backend label value for a backend missing from dynamo's registry (a user callable).
CUSTOM_BACKEND = "custom"
FUNCTIONAL_COLLECTIVES_HINT = (
    "a torch.distributed (c10d) call inside compiled code breaks the graph: use the traceable functional "
    "collectives in torch.distributed._functional_collectives (e.g. funcol.all_reduce / broadcast), or "
    "move the call out of the compiled region"
)


def code_hash(filename: Any, firstlineno: Any, name: Any) -> str:
    """Short stable id of a code object: basename:first line:name (equal across ranks and installs)."""
    key = f"{os.path.basename(str(filename or ''))}:{firstlineno}:{name}"
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _first_line(text: Any) -> str:
    s = str(text or "").strip()
    return s.splitlines()[0][:300] if s else ""


def _by_outcome(compiles: Counter[tuple[str, str, str]]) -> Counter[tuple[str, str]]:
    out: Counter[tuple[str, str]] = Counter()
    for (o, t, _), n in compiles.items():
        out[(o, t)] += n
    return out


def _fingerprint(digests: Iterable[str]) -> int:
    """Order-independent hash of a set of graph digests, < 2**52 so a float64 gauge holds it exactly."""
    joined = "\n".join(sorted(digests)).encode()
    return int(hashlib.sha256(joined).hexdigest()[:13], 16)


@dataclass(slots=True)
class CompileNotes:
    """What the agent thread noted of each compile until its metrics arrive (bounded: each map is
    cleared past ``MAX_NOTES``): the frame it compiles, its graph breaks, its recompile text, and its
    span, which the metrics complete."""

    #: cid -> frame_id, code_hash, function, backend, step
    frames: dict[str, dict[str, Any]] = field(default_factory=dict)
    breaks: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)  # cid -> (key, frame, t_ns)
    recompile_text: dict[str, str] = field(default_factory=dict)  # cid -> the recompile artifact's text
    #: (cid, trigger) -> (span waiting for its metrics, the poll that ended it)
    ended: dict[tuple[str, str], tuple[SpanRecord, int]] = field(default_factory=dict)
    #: code hash / frame id -> backend of its last compile start
    backend_of: dict[str, str] = field(default_factory=dict)
    polls: int = 0


#: Compiles whose notes are kept at most, per map.
MAX_NOTES = 1024


class CompileCollector(Component):
    name = "compile"

    def __init__(self) -> None:
        super().__init__()
        self.capture = DynamoCapture(self.record_error)
        self.counters = CounterDiff()
        self.buffers = (self.capture.buffer,)
        self._steps: Any = None
        # state (agent thread)
        self.compiles: Counter[tuple[str, str, str]] = Counter()  # (outcome, trigger, backend)
        self.recompiles: Counter[str] = Counter()
        self.recompile_examples: dict[str, list[str]] = {}
        self.graph_breaks: Counter[str] = Counter()
        self.break_info: dict[str, dict[str, Any]] = {}
        self.limit_hits = 0
        self.cache: Counter[tuple[str, str]] = Counter()
        self.hists = {p: Histogram(STEP_BUCKETS) for p in [*(p for p, _ in PHASES), "lazy_backward"]}
        self.compile_seconds = 0.0
        self.graphs: set[str] = set()
        self.graphs_compiled = 0
        self.graph_log: deque[tuple[int, str]] = deque(maxlen=4096)  # (step, function file:line) per graph
        self.fingerprint = _fingerprint(())
        self.resets = 0
        self._open: dict[tuple[str, str], tuple[int, int]] = {}  # (cid, trigger) -> (start ns, step)
        #: (start ns, end ns) of the recent compiles, for the goodput ledger's compile time
        self.intervals: deque[tuple[int, int]] = deque(maxlen=4096)
        self.notes = CompileNotes()

    # --------------------------------------------------------------------------------- install
    @property
    def open_compiles(self) -> int:
        """Compiles started and not yet ended (the detectors' compile-activity token)."""
        return len(self._open)

    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        self.capture.buffer.capacity = ctx.config.buffer_size
        self._steps = self.capture.steps = ctx.find(StepCollector)
        dynamo.load()  # dynamo's counters and artifact loggers exist once it is imported

        self.counters.deltas(dynamo.counters_snapshot())  # the baseline: what came before is not counted
        self.capture.install()
        self.up = self.capture.callbacks

    def uninstall(self) -> None:
        self.capture.uninstall()

    # --------------------------------------------------------------------------------- agent thread
    def poll(self, now: float) -> None:
        notes = self.notes
        notes.polls += 1
        if self.capture.heal():
            self.resets += 1
            self._open.clear()
            notes.ended.clear()
            self.require_ctx().events.emit("dynamo_reset", resets=self.resets)
        for rec in self.capture.buffer.drain():
            if isinstance(rec, CompileStarted):
                self._on_start_event(rec.compile_id, rec.frame, rec.trigger, rec.t_ns, rec.step)
            elif isinstance(rec, CompileEnded):
                self._end_span(rec.compile_id, rec.trigger, rec.t_ns)
            elif isinstance(rec, CompileMetrics):
                self._on_metrics(dynamo.metrics_fields(rec.metrics))
            elif isinstance(rec, GraphBreakText):
                self._on_graph_break(rec.text, rec.t_ns, rec.compile_id)
            else:
                notes.recompile_text[rec.compile_id] = rec.text
        for key, (span, polled) in list(notes.ended.items()):
            if polled < notes.polls - 1:  # its metrics never came (e.g. an aborted compile)
                del notes.ended[key]
                self.require_ctx().add_span(span)
        self._count(self.counters.deltas(dynamo.counters_snapshot()))
        for d in (self._open, notes.breaks, notes.recompile_text, notes.frames):
            if len(d) > MAX_NOTES:
                d.clear()
        if self._open and self._steps is not None:  # a compile open is progress (its workers leave
            self._steps.busy_ts = time.time()  # the training thread waiting): ``StepCollector``

    def _count(self, deltas: list[tuple[tuple[Any, ...], int]]) -> None:
        """Dynamo's counters' increases into the collector's (graph breaks from dynamo's own count: the
        artifact text adds stacks)."""
        for key, delta in deltas:
            if key[0] == "cache":
                self.cache[(key[1], key[2])] += delta
            elif key[0] == "limit":
                self.limit_hits += delta
            elif key[0] == "graphs":
                self.graphs_compiled += delta
            else:
                self._count_break(graph_break_key(key[1]), key[1], "", delta)

    def _count_break(self, key: str, text: str, frame: str, n: int = 1) -> str:
        if key not in self.break_info and len(self.break_info) >= MAX_BREAK_KEYS:
            key = "other"
        info = self.break_info.setdefault(key, {"reason": "", "user_frames": set(), "c10d": ""})
        if not info["reason"]:
            info["reason"] = break_reason(text)
        if not info.get("c10d"):
            info["c10d"] = c10d_call(text)
        if frame and len(info["user_frames"]) < 16:
            info["user_frames"].add(frame)
        if n:
            self.graph_breaks[key] += n
        return key

    def _on_graph_break(self, text: str, t_ns: int, cid: str) -> None:
        frames = user_frames(text)
        frame = user_frame(frames, text)
        key = self._count_break(graph_break_key(text), text, frame, n=0)  # counted from dynamo's counters
        self.notes.breaks.setdefault(cid, []).append((key, frame, t_ns))
        c10d = c10d_call(text)
        fr = self.notes.frames.get(cid, {})
        self.require_ctx().events.emit(
            cat.EVENT_GRAPH_BREAK,
            compile_id=cid,
            frame_id=frame_id(cid),
            code_hash=fr.get("code_hash", ""),
            reason=key,
            reason_text=break_reason(text),
            user_frame=frame,
            user_stack=frames,
            frames=frames,
            c10d_call=c10d,
            hint=FUNCTIONAL_COLLECTIVES_HINT if c10d else "",
            message=text,
        )

    def _on_start_event(self, cid: str, info: Any, trigger: str, t_ns: int, step: int) -> None:
        """``compile_start``: the frame dynamo starts compiling (names of its locals, never values)."""
        self._open[(cid, trigger)] = (t_ns, step)
        if info is None:
            return
        filename, line, name, local_names, backend = info
        if backend not in self.capture.known_backends:
            backend = CUSTOM_BACKEND if backend else "unknown"
        fr = {
            "frame_id": frame_id(cid),
            "code_hash": code_hash(filename, line, name),
            "function": f"{name} {filename}:{line}",
            "backend": backend,
        }
        self.notes.frames[cid] = {**fr, "step": step}
        if len(self.notes.backend_of) < 4096:
            self.notes.backend_of[fr["code_hash"]] = self.notes.backend_of[fr["frame_id"]] = backend
        self.require_ctx().events.emit(
            cat.EVENT_COMPILE_START, compile_id=cid, step=step, f_locals_keys=list(local_names), **fr
        )

    def _end_span(self, cid: str, trigger: str, t_ns: int) -> None:
        opened = self._open.pop((cid, trigger), None)
        if opened is None:
            return
        start_ns, step = opened
        self.intervals.append((start_ns, t_ns))
        trig = _TRIGGER_LABEL.get(trigger, trigger)
        span = SpanRecord(
            name=cat.SPAN_COMPILE,
            start_ns=start_ns,
            end_ns=t_ns,
            step=step,
            attributes={cat.ATTR_COMPILE_ID: cid, cat.ATTR_COMPILE_TRIGGER: trig},
            anomalous=True,  # compiles are rare after warm-up: always keep the step's trace
        )
        if trig == "forward":
            fr = self.notes.frames.get(cid)
            if fr is not None:
                span.events.append((cat.EVENT_COMPILE_START, start_ns, {cat.ATTR_CODE_HASH: fr["code_hash"]}))
                span.attributes[cat.ATTR_COMPILE_BACKEND] = fr["backend"]
            for key, frame, t in self.notes.breaks.get(cid, ()):
                span.events.append(
                    (cat.EVENT_GRAPH_BREAK, t, {cat.ATTR_GRAPH_BREAK_REASON: key, cat.ATTR_USER_FRAME: frame})
                )
        self.notes.ended[(cid, trig)] = (span, self.notes.polls)

    def _on_metrics(self, m: dict[str, Any]) -> None:
        agent = self.require_ctx()
        cid = str(m["compile_id"] or "")
        forward = m["is_forward"] is not False
        trigger = "runtime" if m["is_runtime"] else ("forward" if forward else "lazy_backward")
        fail_type, fail_reason = m["fail_type"], str(m["fail_reason"] or "")
        breaks = self.notes.breaks.pop(cid, []) if forward else []
        if fail_type:
            outcome = "limit" if fail_reason.startswith(dynamo.RECOMPILE_LIMIT_PREFIX) else "failed"
        elif forward and (breaks or m["restart_reasons"]):
            outcome = "graph_break"
        else:
            outcome = "ok"
        fr = self.notes.frames.get(cid, {})
        chash = (
            code_hash(m["co_filename"], m["co_firstlineno"], m["co_name"])
            if m["co_name"]
            else fr.get("code_hash", "")
        )
        # an attempt refused by the recompile limit fires no start callback: the frame's last backend
        backend_of = self.notes.backend_of
        backend = fr.get("backend") or backend_of.get(chash) or backend_of.get(frame_id(cid)) or "unknown"
        self.compiles[(outcome, trigger, backend)] += 1
        seconds = 0.0
        if forward:
            for phase, field in PHASES:
                v = m[field]
                if v is not None:
                    self.hists[phase].observe(float(v))
            seconds = float(m["entire_frame_compile_time_s"] or 0.0)
        elif m["duration_us"] is not None:
            seconds = m["duration_us"] / 1e6
            self.hists["lazy_backward"].observe(seconds)
        self.compile_seconds += seconds
        where = f"{m['co_name']} {m['co_filename']}:{m['co_firstlineno']}" if m["co_name"] else ""
        if forward and not fail_type and (m["graph_op_count"] or 0) > 0:  # no op traced: no graph
            self._add_graph(m)
            step = fr.get("step")
            self.graph_log.append((int(step if step is not None else self._steps_count()), where))
        recompile = ""
        if forward and (m["cache_size"] or 0) > 0 and m["recompile_reason"]:
            recompile = self._on_recompile(cid, where, str(m["recompile_reason"]), chash)
        stack = m["exception_stack_trace"] or m["stack_trace"] if fail_type else None
        depth = len(stack) if isinstance(stack, (list, tuple)) else None
        node = node_name(fail_reason) if fail_type else ""
        span_entry = self.notes.ended.pop((cid, trigger), None)
        if span_entry is not None:
            span = span_entry[0]
            span.attributes[cat.ATTR_COMPILE_OUTCOME] = outcome
            if where:
                span.attributes[cat.ATTR_COMPILE_FUNCTION] = where
            if chash:
                span.attributes[cat.ATTR_CODE_HASH] = chash
            if recompile:
                span.events.append(
                    (cat.EVENT_RECOMPILE, span.start_ns, {cat.ATTR_RECOMPILE_REASON: recompile})
                )
            span.events.append(
                (
                    cat.EVENT_BACKEND_COMPILE,
                    span.end_ns,
                    {cat.ATTR_COMPILE_OUTCOME: outcome, cat.ATTR_COMPILE_BACKEND: backend},
                )
            )
            agent.add_span(span)
        agent.events.emit(
            cat.EVENT_BACKEND_COMPILE,
            compile_id=cid,
            frame_id=frame_id(cid),
            code_hash=chash,
            backend=backend,
            trigger=trigger,
            outcome=outcome,
            function=where,
            seconds=seconds,
            backend_seconds=m["backend_compile_time_s"],
            graph_op_count=m["graph_op_count"],
            cache_size=m["cache_size"],
            fail_type=fail_type,
            fail_reason=_first_line(fail_reason),
            node_name=node,
            traceback_depth=depth,
        )

    def _steps_count(self) -> int:
        return int(getattr(self._steps, "count", 0) or 0)

    def _add_graph(self, m: dict[str, Any]) -> None:
        """Identity of a compiled graph that is equal on identical ranks: code location (basename, so
        install prefixes may differ) and graph shape; never ids, compile ids or timings."""
        ident = "|".join(
            str(x)
            for x in (
                os.path.basename(str(m["co_filename"])),
                m["co_firstlineno"],
                m["co_name"],
                m["graph_op_count"],
                m["graph_node_count"],
                m["graph_input_count"],
                m["graph_node_shapes"],
            )
        )
        digest = hashlib.sha1(ident.encode()).hexdigest()
        if digest not in self.graphs:
            self.graphs.add(digest)
            self.fingerprint = _fingerprint(self.graphs)

    def _on_recompile(self, cid: str, where: str, first_guard: str, chash: str = "") -> str:
        kind = guard_kind(first_guard)
        self.recompiles[kind] += 1
        examples = self.recompile_examples.setdefault(kind, [])
        guard = guard_text(first_guard)
        if len(examples) < 5 and f"{where}: {guard}" not in examples:
            examples.append(f"{where}: {guard}")
        text = self.notes.recompile_text.pop(cid, "")
        failed = failed_guards(text)
        self.require_ctx().events.emit(
            cat.EVENT_RECOMPILE,
            compile_id=cid,
            frame_id=frame_id(cid),
            code_hash=chash,
            function=where,
            reason=kind,
            guard=first_guard,
            guard_failures=failed or [first_guard],
            failed_guards=failed or [first_guard],
            user_stack=user_frames(text)
            or ([where.split(" ", 1)[-1]] if where else []),  # size guards give none
            message=text,
        )
        return kind

    # --------------------------------------------------------------------------------- scrape
    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        c = f.counter("hpar_dynamo_compiles_total")
        for (outcome, trigger, backend), n in sorted(self.compiles.copy().items()):
            f.add(c, [outcome, trigger, backend], n)
        yield c
        for name, counts in (
            ("hpar_dynamo_recompiles_total", self.recompiles),
            ("hpar_dynamo_graph_breaks_total", self.graph_breaks),
        ):
            fam = f.counter(name)
            for reason, n in sorted(counts.copy().items()):
                f.add(fam, [reason], n)
            yield fam
        lim = f.counter("hpar_dynamo_recompile_limit_hits_total")
        f.add(lim, [], self.limit_hits)
        yield lim
        cache = f.counter("hpar_dynamo_cache_events_total")
        for (name, result), n in sorted(self.cache.copy().items()):
            f.add(cache, [name, result], n)
        yield cache
        h = f.histogram("hpar_dynamo_compile_duration_seconds")
        for phase, hist in self.hists.items():
            if hist.count:
                h.add_metric(f.labels(phase), hist.buckets(), hist.sum)
        yield h
        gc = f.counter("hpar_dynamo_graphs_compiled_total")
        f.add(gc, [], self.graphs_compiled)
        yield gc
        g = f.gauge("hpar_dynamo_unique_graphs")
        f.add(g, [], len(self.graphs))
        yield g
        fp = f.gauge("hpar_dynamo_graph_fingerprint")
        f.add(fp, [], self.fingerprint)
        yield fp

    def summary(self) -> dict[str, Any]:
        return {
            "graphs": len(self.graphs),
            "graphs_compiled": self.graphs_compiled,
            "fingerprint": self.fingerprint,
            "compiles": {f"{o}/{t}": n for (o, t), n in sorted(_by_outcome(self.compiles).items())},
            "backends": sorted({b for (_, _, b) in self.compiles}),
            "compile_seconds_total": round(self.compile_seconds, 6),
            "graph_breaks": [
                {
                    "reason": key,
                    "count": self.graph_breaks[key],
                    "message": info["reason"],
                    "user_frames": sorted(info["user_frames"]),
                    **(
                        {"c10d_call": info["c10d"], "hint": FUNCTIONAL_COLLECTIVES_HINT}
                        if info.get("c10d")
                        else {}
                    ),
                }
                for key, info in sorted(self.break_info.items())
            ],
            "recompiles": [
                {"reason": k, "count": n, "examples": self.recompile_examples.get(k, [])}
                for k, n in sorted(self.recompiles.items())
            ],
            "recompile_limit_hits": self.limit_hits,
            "cache": {f"{c}/{r}": n for (c, r), n in sorted(self.cache.items())},
            "dynamo_resets": self.resets,
        }
