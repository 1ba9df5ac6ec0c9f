"""The runtime modules import each other without a cycle, counting every import: module level,
``if TYPE_CHECKING:`` blocks and function bodies (the graph is read with ``ast``, nothing is imported).

The offline tools (CLI, doctor, diagnose, report, ...) are not runtime modules and are left out, whether
they live at the package's top level or in a subpackage of their own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"hpar_agent": ROOT / "agent", "hpar_agent.exporters": ROOT / "exporters"}
OFFLINE = {"tools"}  # hpar_agent.tools: the CLI and offline readers, never imported at run time


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if any(p in OFFLINE for p in rel) or "zerocode_site" in rel:  # zerocode_site: a sitecustomize
                continue
            name = ".".join((pkg, *rel))
            if pkg == "hpar_agent" and rel[:1] == ("exporters",):
                continue
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules ``path`` imports; ``from pkg import x`` counts ``pkg.x`` when that is a module."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parent = parts if is_pkg else parts[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_graph_sees_the_runtime_modules() -> None:
    g = _graph()
    assert {
        "hpar_agent.agent",
        "hpar_agent.context",
        "hpar_agent.component",
        "hpar_agent.detectors.sources",
        "hpar_agent.exporters.otel",
    } <= set(g)
    assert not any(m.rsplit(".", 1)[-1] in OFFLINE for m in g)
    assert "hpar_agent.collectors.steps" in g["hpar_agent.detectors.sources"]  # typed reads
    assert "hpar_agent.context" in g["hpar_agent.component"]  # a TYPE_CHECKING import counts


def test_finds_a_cycle_when_there_is_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_runtime_modules() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_version_comes_from_its_own_module() -> None:
    """``__version__`` is imported from ``hpar_agent._version``, never back from the package."""
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hpar_agent" and not node.level:
                assert "__version__" not in {a.name for a in node.names}, name


def test_components_see_the_agent_only_through_the_context() -> None:
    """Collectors, detectors and the component/context modules never import ``hpar_agent.agent``."""
    g = _graph()
    parts = ("hpar_agent.collectors", "hpar_agent.detectors", "hpar_agent.component", "hpar_agent.context")
    users = sorted(m for m, deps in g.items() if m.startswith(parts) and "hpar_agent.agent" in deps)
    assert users == []


def test_collectors_never_import_detectors() -> None:
    """Detectors read collectors, never the other way: what a collector needs of a detector's
    conclusion comes through the context (``AgentContext.conclusions``)."""
    g = _graph()
    users = sorted(
        m
        for m, deps in g.items()
        if m.startswith("hpar_agent.collectors") and any(d.startswith("hpar_agent.detectors") for d in deps)
    )
    assert users == []
