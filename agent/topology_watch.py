"""What says how this rank is parallel, when it appears after attach: the default process group, a
data-parallel wrapper (DDP, FSDP, FSDP2's ``fully_shard``, ``replicate``), a DeviceMesh or a pipeline
stage (built, or run by a schedule: a stage built before attach).

A program often attaches before these exist (``hpar-agent run`` attaches at ``init_process_group``; the
HF Trainer and Lightning wrap the model in DDP after it; ``init_device_mesh`` creates the group inside
the mesh's constructor). ``install`` patches the classes of ``torch_compat.parallel.HOOK_POINTS`` (once
their module is imported; each patch tagged and restored only while still ours) and, while no default
group exists, ``init_process_group``. A hook runs when the object is built, never per step: it keeps a
weak reference to the newest source (a strong one too, until the agent re-detected: a short job may
drop its wrapper before the agent's next pass) and calls the listeners; the running agent's ``TopologyWatch``
component (``collectors.topology``) then re-detects its topology at its next pass (``Agent.redetect``),
on the agent thread.

Standard library only at import: the zero-code shim arms this in every process that imports torch.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from hpar_agent.torch_compat import parallel, pipelining

log = logging.getLogger("hpar_agent")

#: Attribute a patched callable carries: the callable it replaced.
TAG = "_hpar_watch"
#: Meshes remembered (the newest): a program builds a few (the world mesh; FSDP2's default one).
MAX_MESHES = 8
#: Hook failures kept for the next pass to count (a hook never raises into the program).
MAX_ERRORS = 16

Listener = Callable[[str], None]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owners: set[object] = set()
        self.patched: list[tuple[Any, str, Any, Any]] = []  # (owner object, attribute, original, patch)
        self.waiting: list[tuple[str, Callable[[ModuleType], None]]] = []  # after_import callbacks of ours
        self.listeners: list[Listener] = []
        self.wrapper: weakref.ReferenceType[Any] | None = None
        self.meshes: list[weakref.ReferenceType[Any]] = []
        self.stages: list[weakref.ReferenceType[Any]] = []  # pipeline stages built or run, oldest first
        self.kinds: list[str] = []  # kinds notified, in order (bounded)
        self.errors: list[BaseException] = []
        self.held: list[Any] = []  # sources not yet re-detected from (strong references)


_state = _State()


# ---------------------------------------------------------------------------------------------- sources
def notify(kind: str, obj: Any = None) -> None:
    """A hook saw ``kind`` ("process_group", "wrapper", "mesh") built, a pipeline stage built or a
    schedule's stages ("stage": one stage or a list), or the default group about to be destroyed
    ("destroy"); never raises."""
    try:
        if kind == "stage" and obj is not None:
            _add_stages(obj if isinstance(obj, list) else [obj])
        elif kind == "wrapper" and obj is not None:
            _state.wrapper = weakref.ref(obj)
        elif kind == "mesh" and obj is not None:
            _state.meshes = [
                *(r for r in _state.meshes[-(MAX_MESHES - 1) :] if r() is not None),
                weakref.ref(obj),
            ]
        if obj is not None and _state.listeners:
            _state.held.append(obj)  # until a listener re-detected: a short job may drop it before that
            del _state.held[:-MAX_MESHES]
        if kind != "destroy" and len(_state.kinds) < 64:
            _state.kinds.append(kind)
        for fn in list(_state.listeners):
            fn(kind)
        if kind == "destroy":  # what was built on the group goes with it (a later group is a new job)
            _state.wrapper, _state.meshes, _state.stages = None, [], []
            _state.held.clear()
    except Exception as exc:
        _error(exc)


def _add_stages(new: list[Any]) -> None:
    alive = [r for r in _state.stages if r() is not None and all(r() is not s for s in new)]
    _state.stages = [*alive, *(weakref.ref(s) for s in new)][-MAX_MESHES:]


def _error(exc: BaseException) -> None:
    if len(_state.errors) < MAX_ERRORS:
        _state.errors.append(exc)


def wrapper() -> Any:
    """The newest data-parallel wrapper (or module FSDP2/replicate was applied to) still alive."""
    ref = _state.wrapper
    return ref() if ref is not None else None


def mesh(world_size: int | None = None) -> Any:
    """The job's mesh: of the meshes built and still alive that span ``world_size`` ranks (any, when
    None), the one with the most named dims, the newest among equals. Slices of a mesh span fewer
    ranks than the world and are left out."""
    best: tuple[int, int] | None = None
    chosen = None
    for i, ref in enumerate(_state.meshes):
        m = ref()
        if m is None:
            continue
        if world_size is not None and parallel.mesh_size(m) != world_size:
            continue
        key = (len(getattr(m, "mesh_dim_names", None) or ()), i)
        if best is None or key > best:
            best, chosen = key, m
    return chosen


def stages() -> list[Any]:
    """This rank's pipeline stages: of the stages built or run and still alive, those on the newest
    one's pipeline group (a program that rebuilds its pipeline drops the old stages)."""
    alive = [s for s in (r() for r in _state.stages) if s is not None]
    if not alive:
        return []
    group = pipelining.stage_group(alive[-1])
    return [s for s in alive if pipelining.stage_group(s) is group]


def seen() -> list[str]:
    """Kinds of sources built since the first ``install`` (for the summary and tests)."""
    return list(_state.kinds)


def listen(fn: Listener) -> None:
    with _state.lock:
        if fn not in _state.listeners:
            _state.listeners.append(fn)


def unlisten(fn: Listener) -> None:
    with _state.lock:
        if fn in _state.listeners:
            _state.listeners.remove(fn)


def release() -> None:
    """A re-detection read the sources: keep only weak references to them from now on."""
    _state.held.clear()


def take_errors() -> list[BaseException]:
    out, _state.errors = _state.errors, []
    return out


# ---------------------------------------------------------------------------------------------- patches
def install(owner: object) -> None:
    """Patch every hook point (now, or once its module is imported); idempotent, one set of patches
    for all owners."""
    with _state.lock:
        first = not _state.owners
        _state.owners.add(owner)
        if not first:
            return
        for point in parallel.HOOK_POINTS:
            then = functools.partial(_patch_point, point=point)
            if after_import(point.module, then):
                _state.waiting.append((point.module, then))
        for name in parallel.PROCESS_GROUP_MODULES:
            module = sys.modules.get(name)
            if module is not None:
                if not parallel.has_default_group():
                    _patch_init_process_group(module)
                _patch_destroy_process_group(module)


def uninstall(owner: object) -> None:
    """Drop ``owner``; the last one out restores every patch that is still ours."""
    with _state.lock:
        _state.owners.discard(owner)
        if _state.owners:
            return
        for target, attr, orig, patch in reversed(_state.patched):
            if _own_attr(target, attr) is patch:
                setattr(target, attr, orig)
        _state.patched.clear()
        for name, then in _state.waiting:
            cancel_after_import(name, then)
        _state.waiting.clear()
        _state.wrapper, _state.meshes, _state.kinds = None, [], []  # nothing watched them meanwhile
        _state.stages = []
        _state.held.clear()


def installed() -> bool:
    return bool(_state.owners)


def _own_attr(target: Any, attr: str) -> Any:
    return target.__dict__.get(attr) if isinstance(target, type) else getattr(target, attr, None)


def _patch_point(module: ModuleType, *, point: parallel.HookPoint) -> None:
    cls = getattr(module, point.cls, None)
    orig = cls.__dict__.get(point.method) if isinstance(cls, type) else None
    if orig is None or getattr(orig, TAG, None) is not None:
        return  # torch moved it, or patched already

    def tell(self: Any, args: tuple[Any, ...]) -> None:
        try:
            src = point.source(self, args)
        except Exception as exc:
            _error(exc)
        else:
            if src is not None:
                notify(point.kind, src)

    @functools.wraps(orig)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if point.before:
            tell(self, args)
        out = orig(self, *args, **kwargs)
        if not point.before:
            tell(self, args)
        return out

    setattr(hooked, TAG, orig)
    setattr(cls, point.method, hooked)
    _state.patched.append((cls, point.method, orig, hooked))


def _patch_init_process_group(module: ModuleType) -> None:
    orig = getattr(module, "init_process_group", None)
    # the zero-code shim's own wrapper (``_hpar_autoattach``) tells the watch itself
    if orig is None or getattr(orig, TAG, None) is not None or getattr(orig, "_hpar_autoattach", False):
        return

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        notify("process_group")
        return out

    setattr(init_process_group, TAG, orig)
    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    _state.patched.append((module, "init_process_group", orig, init_process_group))


def _patch_destroy_process_group(module: ModuleType) -> None:
    """Before the default group goes: ``notify("destroy")`` (a re-detection still due runs while the
    group and the wrappers built on it can still be read)."""
    orig = getattr(module, "destroy_process_group", None)
    if orig is None or getattr(orig, TAG, None) is not None:
        return

    @functools.wraps(orig)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        if group is None or group is getattr(getattr(module, "GroupMember", None), "WORLD", None):
            notify("destroy")
        return orig(group, *args, **kwargs)

    setattr(destroy_process_group, TAG, orig)
    module.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    _state.patched.append((module, "destroy_process_group", orig, destroy_process_group))


# ---------------------------------------------------------------------------------------------- imports
_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}
_finder: _AfterImport | None = None


def after_import(name: str, then: Callable[[ModuleType], None]) -> bool:
    """Call ``then(module)`` once module ``name`` has executed (now, when it has already); never
    imports it. Returns True when the call waits for the import."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return False
    _waiting.setdefault(name, []).append(then)
    if _finder is None or _finder not in sys.meta_path:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)
    return True


def cancel_after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    global _finder
    fns = _waiting.get(name, [])
    if then in fns:
        fns.remove(then)
    if not fns:
        _waiting.pop(name, None)
    if not _waiting and _finder is not None:
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


class _AfterImport:
    """The meta-path finder of ``after_import``: wraps the loader of a waited-for module."""

    _hpar_autoattach = True  # the zero-code shim's own finders carry the same tag

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        orig_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            orig_exec(module)
            for then in _waiting.pop(fullname, []):
                try:
                    then(module)
                except Exception as exc:
                    _error(exc)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
