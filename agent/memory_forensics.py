"""What held the memory at a CUDA out-of-memory, from metadata only: the live tensors' owners, a digest of
the allocator snapshot, the stacks of the code that allocated, and the trend before it.

Owners are read from the model and optimizer the agent knows (else those found in the locals of the
frames on the stack) with ``untyped_storage().nbytes()`` and ``data_ptr()``: no tensor's data is read,
no CUDA memory is allocated, and a scan stops at ``OWNER_BUDGET_S``. What they do not explain of the
allocator's allocated bytes is "other": activations, temporaries and tensors no known object holds.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from hpar_agent.torch_compat import parallel

#: Seconds an owner scan may take; past it the result says ``partial``.
OWNER_BUDGET_S = 0.5
#: Largest items kept in a record (tensors, blocks, sites).
TOP = 10
#: Share of a leak's growth a step one allocating site must hold to be named the leak's site.
SITE_SHARE = 0.5
#: Frames of a stack kept (the innermost ones).
STACK_FRAMES = 40
#: Frames and locals per frame searched for a model or an optimizer.
SEARCH_FRAMES, SEARCH_LOCALS = 128, 256

_AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB_DIR = _PATHS.get("stdlib", "\0") + os.sep
_SITE_DIRS = tuple(
    _PATHS[k] + os.sep for k in ("purelib", "platlib") if k in _PATHS
)  # inside stdlib outside a venv
_LINE = re.compile(r"^(.*):(\d+ in .*)$")
#: Whether a running frame's locals can be read without keeping them alive (PEP 667's proxy).
SAFE_LOCALS = sys.version_info >= (3, 13)


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def is_user_file(filename: str) -> bool:
    """A frame of the program's own code (or a library it trains with), not of torch, the agent or the
    standard library: the frame that says where an allocation came from."""
    path = os.path.abspath(filename)
    if filename.startswith("<") or path.startswith(_AGENT_DIR):
        return False
    if path.startswith(_STDLIB_DIR) and not path.startswith(_SITE_DIRS):
        return False
    try:
        return not path.startswith(_torch_dir() + os.sep)
    except Exception:
        return True


def stack_lines(frames: Iterable[traceback.FrameSummary]) -> list[str]:
    """``file:line in name`` outermost first, the agent's own frames left out, the innermost kept."""
    lines = [
        f"{f.filename}:{f.lineno} in {f.name}"
        for f in frames
        if not os.path.abspath(f.filename).startswith(_AGENT_DIR)
    ]
    return lines[-STACK_FRAMES:]


def user_site(lines: Sequence[str]) -> str:
    """The innermost user frame of ``stack_lines`` (``file:line in name``, the file as its base name);
    "" when every frame is torch's or the standard library's."""
    for line in reversed(lines):
        m = _LINE.match(line)
        if m is not None and is_user_file(m.group(1)):
            return f"{os.path.basename(m.group(1))}:{m.group(2)}"
    return ""


def frame_site(frames: Sequence[Mapping[str, Any]]) -> str:
    """``user_site`` of an allocator snapshot's frames (innermost first, as torch gives them)."""
    lines = [f"{f.get('filename', '')}:{f.get('line', '')} in {f.get('name', '')}" for f in reversed(frames)]
    return user_site(lines)


def frames_up(frame: FrameType | None) -> Iterator[FrameType]:
    """``frame`` and its callers, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def tb_frames(tb: Any) -> list[FrameType]:
    """The frames of a traceback, innermost first."""
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out[::-1]


def found_in_frames(frames: Iterable[FrameType]) -> tuple[list[Any], list[Any]]:
    """(top-level modules, optimizers) held by the locals of ``frames``: the model a training loop or a
    ``forward`` refers to when none was given to ``attach``. A module inside another one found is left
    out, so each tensor is named from the outermost module.

    Before Python 3.13 reading a running function's ``f_locals`` leaves a snapshot of its locals on the
    frame, holding them until it returns: only for a process that is ending (``SAFE_LOCALS`` otherwise)."""
    import torch

    modules: dict[int, Any] = {}
    optimizers: dict[int, Any] = {}
    for i, frame in enumerate(frames):
        if i >= SEARCH_FRAMES:
            break
        try:
            values = list(frame.f_locals.values())[:SEARCH_LOCALS]
        except Exception:
            continue
        for v in values:
            if isinstance(v, torch.nn.Module):
                modules.setdefault(id(v), v)
            elif isinstance(v, torch.optim.Optimizer):
                optimizers.setdefault(id(v), v)
    inner: set[int] = set()
    for m in modules.values():
        inner.update(id(s) for s in m.modules() if s is not m)
    return [m for k, m in modules.items() if k not in inner], list(optimizers.values())


def _storage(t: Any, device: Any) -> tuple[int, int] | None:
    """(data_ptr, nbytes) of a tensor's storage on ``device``; None for other devices or no storage."""
    t = parallel.local_tensor(t)  # a DTensor's local shard
    try:
        if t.device != device:
            return None
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except Exception:  # sparse, meta, a tensor subclass without storage
        return None


def _tensors(models: Sequence[Any], optimizers: Sequence[Any]) -> Iterator[tuple[str, str, Any]]:
    """(kind, name, tensor) of every parameter, gradient, buffer and optimizer state tensor. Parameters
    are named from the models, else by their place in the optimizer (``param_groups[g][i]``)."""
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        prefix = f"{type(model).__name__}[{i}]." if len(models) > 1 else ""
        for name, p in model.named_parameters():
            names[id(p)] = prefix + name
            yield "parameter", prefix + name, p
            if p.grad is not None:
                yield "gradient", prefix + name, p.grad
        for name, b in model.named_buffers():
            yield "buffer", prefix + name, b
    for opt in optimizers:
        for g, group in enumerate(getattr(opt, "param_groups", ())):
            for j, p in enumerate(group.get("params", ())):
                if id(p) not in names:
                    names[id(p)] = f"param_groups[{g}][{j}]"
                    yield "parameter", names[id(p)], p
                    if p.grad is not None:
                        yield "gradient", names[id(p)], p.grad
        for p, state in list(getattr(opt, "state", {}).items()):
            for key, v in state.items() if isinstance(state, dict) else ():
                if hasattr(v, "untyped_storage"):
                    yield "optimizer_state", f"{names.get(id(p), '?')}.{key}", v


def owners(
    models: Sequence[Any],
    optimizers: Sequence[Any],
    device: Any,
    allocated: int | None,
    budget_s: float = OWNER_BUDGET_S,
) -> tuple[dict[str, Any], dict[int, str]]:
    """What the known objects hold on ``device``: bytes by kind (parameter, gradient, buffer,
    optimizer_state, and ``other``: ``allocated`` less those), the largest tensors with their names, and
    ``partial`` when the budget ran out. Also storage address -> ``kind name``, to name snapshot blocks."""
    t0 = time.monotonic()
    seen: dict[int, tuple[str, str, int, Any]] = {}
    partial = False
    for n, (kind, name, t) in enumerate(_tensors(models, optimizers)):
        if n % 1024 == 1023 and time.monotonic() - t0 > budget_s:
            partial = True
            break
        st = _storage(t, device)
        if st is not None and st[0] and st[0] not in seen:  # a tied or shared storage counts once
            seen[st[0]] = (kind, name, st[1], t)
    by_kind: dict[str, int] = {}
    for kind, _, nbytes, _ in seen.values():
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    if allocated is not None:
        by_kind["other"] = max(0, int(allocated) - sum(by_kind.values()))
    largest = [
        {
            "kind": k,
            "name": nm,
            "bytes": b,
            "shape": list(getattr(t, "shape", ())),
            "dtype": str(getattr(t, "dtype", "")),
        }
        for k, nm, b, t in sorted(seen.values(), key=lambda e: -e[2])[:TOP]
    ]
    out = {"source": "", "bytes_by_kind": by_kind, "largest": largest, "partial": partial}
    return out, {ptr: f"{kind} {name}" for ptr, (kind, name, _, _) in seen.items()}


def snapshot_digest(
    snap: Mapping[str, Any], device_index: int | None, names: Mapping[int, str]
) -> dict[str, Any]:
    """The allocator snapshot of one device in a few numbers: segments and what they hold, the largest
    free block (a request larger than it but smaller than the free total is fragmentation), the largest
    live blocks with their owner (by address) and allocating site (when history was recorded), live
    bytes by allocating site, and the site of the failed request from the OOM trace entry."""
    segs = [
        s
        for s in snap.get("segments") or ()
        if device_index is None or s.get("device", device_index) == device_index
    ]
    blocks = [b for s in segs for b in s.get("blocks") or ()]
    live = [b for b in blocks if b.get("state") == "active_allocated"]
    free = [int(b.get("size", 0)) for b in blocks if b.get("state") == "inactive"]
    by_site: dict[str, int] = {}
    for b in live:
        site = frame_site(b.get("frames") or ())
        if site:
            by_site[site] = by_site.get(site, 0) + int(b.get("size", 0))
    traces = snap.get("device_traces") or []
    trace = traces[device_index] if device_index is not None and 0 <= device_index < len(traces) else []
    oom = next((t for t in reversed(trace) if t.get("action") == "oom"), None)
    largest = [
        {
            "bytes": int(b.get("size", 0)),
            "owner": names.get(int(b.get("address", -1)), ""),
            "site": frame_site(b.get("frames") or ()),
        }
        for b in sorted(live, key=lambda b: -int(b.get("size", 0)))[:TOP]
    ]
    return {
        "segments": len(segs),
        "reserved_bytes": sum(int(s.get("total_size", 0)) for s in segs),
        "allocated_bytes": sum(int(s.get("allocated_size", 0)) for s in segs),
        "live_blocks": len(live),
        "free_blocks": len(free),
        "free_bytes": sum(free),
        "largest_free_block_bytes": max(free, default=0),
        "history": any(b.get("frames") for b in blocks) or bool(trace),
        "largest_blocks": largest,
        "live_bytes_by_site": dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:TOP]),
        "oom_site": frame_site(oom.get("frames") or ()) if oom else "",
    }


def leak_site(snap: Mapping[str, Any], device_index: int | None, steps: int, slope: float) -> dict[str, Any]:
    """Where a leak allocates, from an allocator snapshot whose history began ``steps`` steps ago: of
    the blocks allocated since (the ones that carry frames) and still live, the bytes by allocating
    site (the program's innermost frame); the site holding the most, with its growth a step, when
    that growth is at least ``SITE_SHARE`` of the ``slope`` the memory grew (bytes a step). Else
    ``site: "unknown"`` and ``site_unknown`` saying why: a batch's allocations churn (allocated and
    freed every step), so they hold at most one step's worth, and a site that holds more grew."""
    if steps <= 0:
        return _unknown("the allocator's history began at the step the alert fired: no step recorded")
    by_site: dict[str, int] = {}
    for seg in snap.get("segments") or ():
        if device_index is not None and seg.get("device", device_index) != device_index:
            continue
        for b in seg.get("blocks") or ():
            frames = b.get("frames")
            if b.get("state") == "active_allocated" and frames:
                site = frame_site(frames)
                if site:
                    by_site[site] = by_site.get(site, 0) + int(b.get("size", 0))
    if not by_site:
        return _unknown(
            f"no allocation of the {steps} steps recorded is still live at a frame of the program"
        )
    site, live = max(by_site.items(), key=lambda kv: kv[1])
    growth = live / steps
    if growth < SITE_SHARE * slope:
        return _unknown(
            f"no site holds the growth: of the allocations of the {steps} steps recorded, {site} holds the "
            f"most still live, {live} bytes ({growth:.0f} a step), under {SITE_SHARE:.0%} of the "
            f"{slope:.0f} bytes a step the memory grew"
        )
    return {"site": site, "site_live_bytes": live, "site_growth_bytes_per_step": growth, "site_steps": steps}


def _unknown(why: str) -> dict[str, Any]:
    return {"site": "unknown", "site_unknown": why}


def trend(series: Mapping[str, Sequence[tuple[int, float]]], last: int = 16) -> dict[str, Any]:
    """The last ``last`` post-step samples of each source, and how fast allocated (else reserved) memory
    grew over them, in bytes a step."""
    out: dict[str, Any] = {k: [[int(s), int(b)] for s, b in v[-last:]] for k, v in series.items() if v}
    for source in ("allocator", "reserved", "nvml"):
        pts = out.get(source) or []
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            out["growth_bytes_per_step"] = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            out["growth_source"] = source
            break
    return out
