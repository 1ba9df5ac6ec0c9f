"""Parsing of the text torch's dynamo logs: graph-break messages (``graph_breaks`` artifact), recompile
guard failures (``recompiles`` artifact), backend failure reasons and compile ids.

Pure functions of the log text, so they are tested on recorded messages and a change in dynamo's
wording touches this file only. Every result meant for a label is bounded (registry code, slug, or a
fixed kind table); the full text stays in the event log.
"""

from __future__ import annotations

import re

_GB_CODE = re.compile(r"/gb/(gb\d{3,5})\.html")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_AT = re.compile(r"in user code at (.+?):(\d+)")
_GUARD_PREFIX = re.compile(r"^\s*(?:- )?\d+/\d+: ")
#: First failed guard -> bounded recompile reason (first match wins).
_GUARD_KINDS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), k)
    for p, k in (
        (r"(size|rank) mismatch", "tensor_size"),
        (r"stride mismatch", "tensor_stride"),
        (r"dtype mismatch", "tensor_dtype"),
        (r"device mismatch", "tensor_device"),
        (r"requires_grad mismatch", "requires_grad"),
        (r"dispatch key set mismatch", "dispatch_keys"),
        (r"___check_type_id|type\(|isinstance|is None|is not None", "type"),
        (r"___check_obj_id|\bid\(|\S \bis\b \S", "object_id"),  # `x is y`: an identity guard
        (r"len\(", "length"),
        (r"grad_mode|GLOBAL_STATE|global state|autocast|deterministic", "global_state"),
        (r"\b(Eq|Ne|Lt|Le|Gt|Ge)\(|\bs\d+\b", "dynamic_shape"),
        (r"== -?\d+\s*(#|$)", "int_value"),
        (r"== -?\d*\.\d+", "float_value"),
    )
)
#: Lines of a graph-break message that say "a break happened", not why (dynamo's header lines).
_BREAK_PREAMBLE = re.compile(
    r"^(Encountered graph break when attempting to trace|Failed to handle graph break gracefully|"
    r"Graph break encountered|Graph Break Reason:\s*$)"
)
_C10D_FILE = re.compile(r"torch[/\\]distributed[/\\](distributed_c10d|c10d_logger)\.py$")
_NODE = re.compile(r"While executing %(\w+)|node[ _]name[=:]\s*'?(\w+)")
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")


def graph_break_key(text: str) -> str:
    """Bounded key of a graph-break message: its registry code (gbNNNN), else a slug of the reason's
    first line cut before any quoted/bracketed detail (which may hold user values)."""
    m = _GB_CODE.search(text)
    if m:
        return m.group(1)
    reason = text.split("Graph Break Reason:", 1)[-1]
    first = next((ln.strip() for ln in reason.splitlines() if ln.strip()), "")
    first = re.split(r"[:(\[{`'\"<]", first, maxsplit=1)[0]
    slug = "_".join(re.sub(r"[^a-z0-9]+", " ", first.lower()).split()[:6])
    return slug[:40] or "unknown"


def break_reason(text: str) -> str:
    """Why a graph break happened, in one line: dynamo's title line (e.g. "Failed to trace builtin
    operator") and its Explanation, skipping the header lines that only say a break was encountered."""
    body = text.split("Graph Break Reason:", 1)[-1].split("User code traceback:", 1)[0]
    title, explanation = "", ""
    for ln in (x.strip() for x in body.splitlines()):
        if not ln or _BREAK_PREAMBLE.match(ln):
            continue
        if ln.startswith("Explanation:"):
            explanation = ln[len("Explanation:") :].strip()
            break
        if ln.startswith(("Hint:", "Developer debug context:", "For more details")):
            break
        if not title:
            title = ln
    reason = f"{title}: {explanation}" if title and explanation else title or explanation
    return reason[:300]


def c10d_call(text: str) -> str:
    """The torch.distributed (c10d) function a graph break was traced into ('' when none): the
    innermost traceback frame in distributed_c10d.py / c10d_logger.py names the collective."""
    op = ""
    for f, _, fn in _FRAME.findall(text.split("User code traceback:", 1)[-1]):
        if _C10D_FILE.search(f) and fn != "wrapper":
            op = fn
        elif _C10D_FILE.search(f) and not op:
            op = "c10d"
    return op


def user_frame(frames: list[str], text: str) -> str:
    """Innermost ``file:line`` outside torch itself (the user's line that broke), else dynamo's
    'in user code at' location."""
    for fr in reversed(frames):
        where = fr.rsplit(" in ", 1)[0]
        if not _TORCH_FILE.search(where):
            return where
    m = _AT.search(text)
    return f"{m.group(1)}:{m.group(2)}" if m else (frames[-1].rsplit(" in ", 1)[0] if frames else "")


def node_name(fail_reason: str) -> str:
    """The FX node a backend failure names ("While executing %node"), '' when none."""
    m = _NODE.search(fail_reason or "")
    return (m.group(1) or m.group(2) or "") if m else ""


def frame_id(cid: str) -> str:
    """Dynamo's frame id: the first part of a compile id ``[!]frame/attempt``."""
    return cid.lstrip("!").split("/", 1)[0] if cid else ""


def guard_kind(guard: str) -> str:
    """Bounded recompile reason from the text of a failed guard."""
    g = _GUARD_PREFIX.sub("", guard.splitlines()[0] if guard else "")
    g = g.split("  #", 1)[0]  # drop the source excerpt dynamo appends after the guard
    for pattern, kind in _GUARD_KINDS:
        if pattern.search(g):
            return kind
    return "other"


def user_frames(text: str) -> list[str]:
    """``file:line in fn`` frames of a graph-break message, outermost first (the innermost is last)."""
    frames = [f"{f}:{ln} in {fn}" for f, ln, fn in _FRAME.findall(text.split("User code traceback:", 1)[-1])]
    if not frames:
        m = _AT.search(text)
        if m:
            frames = [f"{m.group(1)}:{m.group(2)}"]
    return frames


#: A failed guard's line in a recompile message: ``    - 2/0: tensor 'x' size mismatch ...``.
_FAILED_GUARD = re.compile(r"\s*- \d+/\d+: ")


def guard_text(guard: str) -> str:
    """The failed guard itself, one line (<= 300 chars): without dynamo's ``N/M:`` prefix or the
    source excerpt it appends after ``  #``."""
    s = _GUARD_PREFIX.sub("", guard or "").split("  #", 1)[0].strip()
    return s.splitlines()[0][:300] if s else ""


def failed_guards(text: str) -> list[str]:
    """Every failed guard a recompile message lists (``N/M: guard`` each), in its order."""
    return [ln.strip()[2:] for ln in text.splitlines() if _FAILED_GUARD.match(ln)]
