"""hpar-agent zero-code shim (``hpar-agent run``): attach the agent to an unmodified script.

``hpar-agent run`` puts this directory first on its children's PYTHONPATH and sets HPAR_AUTOATTACH=1;
every Python process of the job runs this, and its own children inherit both. Standard library only,
and nothing is imported here: a process that never imports torch pays one environment lookup and a
meta-path finder. What it installs (each tagged ``_hpar_autoattach``):

- once ``torch.distributed.distributed_c10d`` has executed (during ``import torch``, before
  ``init_device_mesh`` or any library binds the name): a wrapper of ``init_process_group`` that, once
  the default group exists, attaches the agent (the process is a rank, whoever created the group) or,
  attached already, has it re-detect its topology;
- once ``import torch`` completes: ``hpar_agent.autoattach.arm()``, the other triggers (the first
  optimizer step, the first compile, the first ``hpar_agent.current()``) and the topology hooks.

Where the agent attaches follows what a process does, not what launched it: launchers, a parent that
only spawns, DataLoader and compile workers never attach. Then it runs the next ``sitecustomize`` on
sys.path, if any, so an existing one keeps working.
"""

import os
import sys

_ENV = "HPAR_AUTOATTACH"
_TRUE = ("1", "true", "yes", "on")


def _say(what, exc):
    print(
        f"hpar-agent: zero-code {what} failed ({type(exc).__name__}: {exc}); not observing", file=sys.stderr
    )


def _wrap_init_process_group(c10d):
    import functools

    orig = c10d.init_process_group
    if getattr(orig, "_hpar_autoattach", False):
        return

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        out = orig(*args, **kwargs)
        try:
            from hpar_agent.autoattach import on_process_group

            on_process_group()
        except Exception as exc:  # never break the user's script
            _say("attach", exc)
        return out

    init_process_group._hpar_autoattach = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group


def _arm(_torch):
    try:
        from hpar_agent.autoattach import arm

        arm()
    except Exception as exc:
        _say("setup", exc)


class _AfterImport:
    """A meta-path finder that runs ``then(module)`` once a module of ``waiting`` has executed."""

    _hpar_autoattach = True

    def __init__(self):
        self.waiting = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting:
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
        orig_exec, waiting, finder_self = loader.exec_module, self.waiting, self

        def exec_module(module):
            orig_exec(module)
            then = waiting.pop(fullname, None)
            if not waiting and finder_self in sys.meta_path:
                sys.meta_path.remove(finder_self)
            if then is not None:
                try:
                    then(module)
                except Exception as exc:  # never break the user's import
                    _say("setup", exc)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _after_import(finder, name, then):
    if name in sys.modules:
        then(sys.modules[name])
    else:
        finder.waiting[name] = then
        if finder not in sys.meta_path:
            sys.meta_path.insert(0, finder)


def _boot(environ):
    """Install what this process needs; returns what it did (``off`` or ``armed``)."""
    if not environ.get(_ENV) or environ.get("HPAR_DISABLE", "").strip().lower() in _TRUE:
        return "off"
    finder = _AfterImport()
    _after_import(finder, "torch.distributed.distributed_c10d", _wrap_init_process_group)
    _after_import(finder, "torch", _arm)
    return "armed"


def _chain():
    """Run the ``sitecustomize`` this one shadows."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    spec.loader.exec_module(module_from_spec(spec))


try:
    _hpar_mode = _boot(os.environ)
except Exception as _exc:
    _say("shim", _exc)
_chain()
