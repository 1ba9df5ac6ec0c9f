"""torch's private surface is reached only in ``agent/torch_compat/``, and no module imports another's
private name (the source is read with ``ast``; nothing is imported).

Over what ships as ``hpar_agent``: ``agent/`` (the tools included) and ``exporters/``. The reference
trainer (``trainer/``) is a demo program that may use what it likes; tests and benchmarks likewise.

A private name starts with ``_`` and is not a dunder. Outside ``torch_compat/``, these are torch accesses:

- importing one from torch (``import torch._dynamo``, ``from torch.utils.data.dataloader import
  _BaseDataLoaderIter``);
- one as an attribute of anything a torch import bound (``torch._C``, ``torch.autograd.Variable
  ._execution_engine``, ``dist.distributed_c10d._world``), as ``x._y`` or ``getattr(x, "_y")``;
- one as an attribute of any other value (``schedule._stages``, ``getattr(mesh, "_flatten_mapping")``)
  when no module of the package defines it: torch's objects reach the agent as values (a model, a
  mesh, a schedule), and a private name the package never gives anything of its own is someone else's.
  Values of other libraries' imports (``sys._getframe``, ``os._exit``) are theirs to document;
- a string that names a private torch module or attribute (``sys.modules.get("torch._dynamo")``).

Not seen: a private name of torch's that the package also defines as an attribute of its own (a
value's attribute is judged by its name alone), and names built at run time (``getattr(x, name)``).

Another module's private name: ``from hpar_agent... import _name`` (or relative), or ``module._name``
where ``module`` was bound by importing from the package.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIRS = (REPO / "agent", REPO / "exporters")
COMPAT = "agent/torch_compat/"
PROJECT = ("hpar_agent", "hpar_trainer")
#: Documented API despite the underscore: the methods and fields of ``collections.namedtuple`` and
#: ``typing.NamedTuple`` (prefixed only so that they never clash with a field name).
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_make", "_fields", "_field_defaults"})
_TORCH_PATH = re.compile(r"torch(\.\w+)+")
_ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Name -> "torch", "project" or "other": what an import anywhere in the file bound it to."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                out[a.asname or top] = "torch" if top == "torch" else "project" if top in PROJECT else "other"
        elif isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0]
            kind = "project" if node.level or top in PROJECT else "torch" if top == "torch" else "other"
            for a in node.names:
                out[a.asname or a.name] = kind
    return out


def _accesses(tree: ast.AST) -> Iterator[tuple[ast.expr, ast.expr, str, bool]]:
    """(node, receiver, private attribute name, is a store) of every ``x._y`` and ``getattr``-family
    call with a literal private name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node, node.value, node.attr, not isinstance(node.ctx, ast.Load)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ACCESSORS:
            name = node.args[1] if len(node.args) >= 2 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                yield node, node.args[0], name.value, node.func.id in ("setattr", "delattr")


def _root(node: ast.expr) -> str | None:
    """The name an expression starts from (``torch`` in ``torch.cuda.memory._snapshot(d).x``)."""
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_objects(tree: ast.AST) -> set[str]:
    """Names whose attributes the file's own code may set: ``self``, ``cls`` and the functions and
    classes it defines (a wrapper tagged with ``_hpar_orig``)."""
    defs = {
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    return defs | {"self", "cls"}


def _attribute_names(node: ast.AST, in_function: bool = False) -> Iterator[str]:
    """Names ``node`` gives to something reachable as an attribute: module and class level functions,
    classes and variables (a function's locals are nobody's attributes)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not in_function:
        yield node.name
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and not in_function:
        yield node.id
    inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
    for child in ast.iter_child_nodes(node):
        yield from _attribute_names(child, inside)


def defined_names(sources: dict[str, str]) -> set[str]:
    """Every attribute name the package defines outside ``torch_compat/`` (where it writes torch's):
    module and class level names, and attributes set on its own objects (``self``, its functions)."""
    out: set[str] = set()
    for path, source in sources.items():
        if path.startswith(COMPAT):
            continue
        tree = ast.parse(source)
        own = _own_objects(tree)
        out.update(_attribute_names(tree))
        for _node, receiver, name, store in _accesses(tree):
            if store and isinstance(receiver, ast.Name) and receiver.id in own:
                out.add(name)
    return out


def _strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of the string literals that are code, not docstrings or other bare string statements."""
    bare = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare:
            yield node.lineno, node.value


def _import_findings(node: ast.stmt, compat: bool) -> Iterator[str]:
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        top = module.split(".")[0]
        names = [a.name for a in node.names if _private(a.name)]
        if (node.level or top in PROJECT) and names:
            yield f"imports another module's private {', '.join(names)} from {'.' * node.level}{module}"
        elif top == "torch" and not compat and (names or any(_private(p) for p in module.split("."))):
            yield f"imports from torch's private {module}: {', '.join(a.name for a in node.names)}"
    elif isinstance(node, ast.Import) and not compat:
        for a in node.names:
            parts = a.name.split(".")
            if parts[0] == "torch" and any(_private(p) for p in parts):
                yield f"imports torch's private {a.name}"


def _access_finding(
    receiver: ast.expr, name: str, scope: tuple[dict[str, str], set[str]], defined: set[str], compat: bool
) -> str | None:
    """What is wrong with reading ``receiver.name`` (None: nothing)."""
    bound, own = scope
    root = _root(receiver)
    kind = bound.get(root or "")
    if isinstance(receiver, ast.Name) and kind == "project" and root not in own:
        return f"reads another module's private {root}.{name}"
    if compat:
        return None
    if kind == "torch":
        return f"reaches torch's private {name} (on {ast.unparse(receiver)})"
    if kind is None and name not in defined and name not in NAMEDTUPLE_API:
        return f"reaches private {name}, which the package never defines: torch's (or another library's)"
    return None


def violations(sources: dict[str, str]) -> list[str]:
    """``path:line: what`` for each private torch access outside ``torch_compat/`` and each private
    name taken from another module of the package, in ``sources`` (repository path -> source)."""
    defined = defined_names(sources)
    found: list[str] = []
    for path, source in sorted(sources.items()):
        tree = ast.parse(source)
        compat = path.startswith(COMPAT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                found += (f"{path}:{node.lineno}: {what}" for what in _import_findings(node, compat))
        info = (_bindings(tree), _own_objects(tree))
        for node, receiver, name, _store in _accesses(tree):
            what = _access_finding(receiver, name, info, defined, compat)
            if what:
                found.append(f"{path}:{node.lineno}: {what}")
        for line, text in () if compat else _strings(tree):
            if _TORCH_PATH.fullmatch(text) and any(_private(p) for p in text.split(".")):
                found.append(f"{path}:{line}: names torch's private {text}")
    return found


def _package_sources() -> dict[str, str]:
    """The package's modules (``agent/assets`` links to the dashboard and deploy generators, dev tools)."""
    files = sorted(p for d in DIRS for p in d.rglob("*.py") if "assets" not in p.relative_to(d).parts)
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in files}


def test_torch_private_surface_only_in_torch_compat_and_no_private_imports() -> None:
    sources = _package_sources()
    assert "agent/torch_compat/parallel.py" in sources and "exporters/otel.py" in sources
    assert violations(sources) == []


def _one(source: str, path: str = "agent/x.py", **more: str) -> list[str]:
    return violations({path: source, **more})


NEVER_DEFINED = ", which the package never defines: torch's (or another library's)"


def test_flags_imports_of_torch_private_names() -> None:
    assert _one("import torch._dynamo\n") == ["agent/x.py:1: imports torch's private torch._dynamo"]
    assert _one("def f():\n    from torch.utils.data.dataloader import _BaseDataLoaderIter\n") == [
        "agent/x.py:2: imports from torch's private torch.utils.data.dataloader: _BaseDataLoaderIter"
    ]
    assert len(_one("from torch._C import _distributed_c10d as c\n")) == 1
    assert _one("import torch.distributed as dist\nfrom torch.distributed.tensor import DTensor\n") == []


def test_flags_private_attributes_of_torch_imports() -> None:
    assert _one("import torch\nq = torch.autograd.Variable._execution_engine.queue_callback\n") == [
        "agent/x.py:2: reaches torch's private _execution_engine (on torch.autograd.Variable)"
    ]
    group = "import torch.distributed as dist\ng = dist.distributed_c10d._get_default_group()\n"
    assert len(_one(group)) == 1
    timing = "import torch\nok = hasattr(torch.distributed.ProcessGroup, '_enable_collectives_timing')\n"
    assert len(_one(timing)) == 1
    through_a_call = "import torch\ns = torch.cuda.memory._snapshot(0)._x\n"
    assert len(_one(through_a_call)) == 2


def test_flags_private_attributes_the_package_never_defines() -> None:
    reader = "def stages(schedule):\n    return schedule._stages or [getattr(schedule, '_stage', None)]\n"
    assert len(_one(reader)) == 2
    assert len(_one("def f(optimizer):\n    optimizer._optimizer_step_code = None\n")) == 1  # a write, too
    own = "class A:\n    def __init__(self):\n        self._stages = []\n"
    assert _one(reader, **{"agent/a.py": own}) == [f"agent/x.py:2: reaches private _stage{NEVER_DEFINED}"]
    compat_writes = "def f(s):\n    s._stages = s._stage = 1\n"  # torch's objects: defines nothing
    assert len(_one(reader, **{"agent/torch_compat/p.py": compat_writes})) == 2
    local = "def f(ranks):\n    for _r, _stage in ranks:\n        pass\n"  # a local is nobody's attribute
    assert len(_one(reader, **{"agent/v.py": local})) == 2


OWN_AND_OTHERS = """
import sys, os
class A:
    _n = 0
    def __init__(self):
        self._items = []
    def f(self, other, rec):
        frame = sys._getframe(1)
        other._items.append(rec._replace(x=1)._asdict())
        return self.__class__.__name__, A._n
def wrapper(): pass
wrapper._hpar_tag = True
tagged = getattr(wrapper, '_hpar_tag', False)
os._exit(0)
"""


def test_leaves_the_package_own_and_other_libraries_private_names() -> None:
    assert _one(OWN_AND_OTHERS) == []


COMPAT_READS = """
import torch._dynamo
import torch
from torch.distributed.distributed_c10d import _get_default_store
e = torch.autograd.Variable._execution_engine
m = getattr(mesh, '_flatten_mapping', None)
"""


def test_torch_compat_may_reach_torch_but_not_other_modules_privates() -> None:
    assert _one(COMPAT_READS, "agent/torch_compat/x.py") == []
    assert len(_one("from hpar_agent.config import _TRUE\n", "agent/torch_compat/x.py")) == 1


def test_flags_strings_that_name_torch_private_modules() -> None:
    assert _one("import sys\nm = sys.modules.get('torch.distributed._composable.replicate_with_fsdp')\n") == [
        "agent/x.py:2: names torch's private torch.distributed._composable.replicate_with_fsdp"
    ]
    assert len(_one("HOOKS = {'fr': 'torch._C._distributed_c10d._dump_fr_trace'}\n")) == 1
    prose = '"""Reads torch._dynamo."""\nHELP = "use torch.distributed._functional_collectives instead"\n'
    assert _one(prose) == []  # a docstring, a sentence
    assert _one("M = 'torch.distributed.pipelining.schedules'\n") == []


def test_flags_private_names_taken_from_another_module() -> None:
    assert _one("from hpar_agent.topology import _mesh_from_model, mesh_dim_names\n") == [
        "agent/x.py:1: imports another module's private _mesh_from_model from hpar_agent.topology"
    ]
    assert len(_one("from .cluster import _peer_fr\n", "agent/detectors/x.py")) == 1
    assert len(_one("from hpar_agent import topology\nm = topology._mesh_from_model(None)\n")) == 1
    assert len(_one("import hpar_agent.agent as a\nc = getattr(a, '_current', None)\n")) == 1
    public = (
        "from hpar_agent._version import __version__\nfrom hpar_agent import topology as t\nx = t.detect\n"
    )
    assert _one(public) == []
