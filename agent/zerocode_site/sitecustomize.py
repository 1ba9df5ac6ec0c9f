"""hpar-agent zero-code shim (``hpar-agent run``): attach the agent to an unmodified script.

``hpar-agent run`` puts this directory first on its children's PYTHONPATH and sets HPAR_AUTOATTACH=1.
Standard library only, and nothing is imported here: the torchrun launcher and helper processes pay
one environment lookup. What it installs (each tagged ``_hpar_autoattach``):

- in a torchrun worker (``TORCHELASTIC_RUN_ID`` set), or one of several ranks another launcher
  started (``WORLD_SIZE``, ``SLURM_NTASKS``, ``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE`` above 1): a wrapper of ``init_process_group`` that attaches
  the agent right after the default group exists (rank, world, backend, store: before the first step;
  ``init_device_mesh`` creates its group through the same function);
- in any other Python process (``python train.py``): the agent attaches as soon as ``import torch``
  completes, before any compile or step, so ``hpar_agent.current().step()`` works in loops without an
  optimizer, and after the script's own top-of-file environment (CUDA_VISIBLE_DEVICES). That process
  takes HPAR_AUTOATTACH out of its environment: its own children (DataLoader or compile workers) are
  not observed;
- in the torchrun launcher: nothing.

Then it runs the next ``sitecustomize`` on sys.path, if any, so an existing one keeps working.
"""

import os
import sys

_ENV = "HPAR_AUTOATTACH"
_TRUE = ("1", "true", "yes", "on")
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _is_torchrun_launcher(argv):
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
        return True
    return any(a == "-m" and i + 1 < len(argv) and argv[i + 1] in _LAUNCHERS for i, a in enumerate(argv))


def _one_of_many(environ):
    """Started as one of several ranks by another launcher (srun, mpirun, a script that sets
    WORLD_SIZE): the rank is only known once the process group exists."""
    for name in _WORLD_VARS:
        try:
            if int(environ.get(name, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def _attach(trigger):
    try:
        from hpar_agent.autoattach import attach_now

        attach_now(trigger)
    except Exception as exc:  # never break the user's script
        print(f"hpar-agent: zero-code attach failed ({type(exc).__name__}: {exc}); not observing", file=sys.stderr)


def _wrap_init_process_group(c10d):
    import functools

    orig = c10d.init_process_group
    if getattr(orig, "_hpar_autoattach", False):
        return

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        out = orig(*args, **kwargs)
        _attach("init_process_group")
        return out

    init_process_group._hpar_autoattach = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group


class _AfterImport:
    """A meta-path finder that runs ``then(module)`` once ``name`` has finished executing."""

    _hpar_autoattach = True

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
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
        orig_exec, then, finder_self = loader.exec_module, self.then, self

        def exec_module(module):
            orig_exec(module)
            if finder_self in sys.meta_path:
                sys.meta_path.remove(finder_self)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _after_import(name, then):
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _boot(environ):
    """Install what this process needs; returns what it did (``off``, ``launcher``, ``worker``, ``script``)."""
    if not environ.get(_ENV) or environ.get("HPAR_DISABLE", "").strip().lower() in _TRUE:
        return "off"
    if _is_torchrun_launcher(getattr(sys, "orig_argv", sys.argv)):
        return "launcher"
    if "TORCHELASTIC_RUN_ID" in environ or _one_of_many(environ):
        _after_import("torch.distributed.distributed_c10d", _wrap_init_process_group)
        return "worker"
    environ.pop(_ENV, None)
    _after_import("torch", lambda _torch: _attach("import torch"))
    return "script"


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
    print(f"hpar-agent: zero-code shim failed ({type(_exc).__name__}: {_exc}); not observing", file=sys.stderr)
_chain()
