"""Every third-party package the agent, exporters and trainer import is a declared dependency, so a
fresh ``pip install`` has what a run needs (the issue: numpy was missing and CI did not notice)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ["agent", "exporters", "trainer"]
#: Optional imports behind an extra (imported only when configured).
EXTRAS = {"grpc"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _declared() -> set[str]:
    out = set()
    for req in metadata.requires("hpar-agent") or []:
        extra = re.search(r"extra == ['\"]([^'\"]+)", req)
        if extra is None or extra.group(1) in EXTRAS:
            out.add(_name(req))
    return out


def _imports() -> set[str]:
    """Absolute names imported anywhere in the sources (``from a.b import c`` -> ``a.b.c``: c may be a
    module of a namespace package; ``_owner`` walks up to the first importable module)."""
    found = set()
    for src in SOURCES:
        for path in (REPO / src).rglob("*.py"):
            if "assets" in path.relative_to(REPO).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _owner(module: str, files: dict[Path, str]) -> str | None:
    """The installed distribution whose files hold ``module`` (namespace packages like opentelemetry
    span many distributions, so the top-level name is not enough)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:i]))
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen"):
            return files.get(Path(spec.origin).resolve())
    return None


def test_every_imported_third_party_package_is_declared():
    files = {}
    for dist in metadata.distributions():
        for f in dist.files or ():
            if f.suffix in (".py", ".so"):
                files[Path(dist.locate_file(f)).resolve()] = _name(dist.metadata["Name"])
    declared = _declared()
    first_party = {"hpar_agent", "hpar_trainer", "__future__"}
    undeclared = {}
    for module in sorted(_imports()):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in first_party:
            continue
        owner = _owner(module, files)
        assert owner is not None, f"{module}: imported but not installed"
        if owner not in declared:
            undeclared[module] = owner
    assert not undeclared, f"imported but not declared in pyproject dependencies: {undeclared}"
    assert {"numpy", "plotly"} <= declared  # needed at run time though not imported by name everywhere
