"""The runtime package never imports the offline tools (``hpar_agent.tools``): what runs inside training
stays the code that must, and the CLI, report and diagnose can change without touching a training job."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "agent" / "tools"
#: ``python -m hpar_agent`` is the command itself: it delegates to ``hpar_agent.tools.cli`` by design.
ENTRY_POINTS = {REPO / "agent" / "__main__.py"}


def runtime_files() -> list[Path]:
    files = [*(REPO / "agent").rglob("*.py"), *(REPO / "exporters").rglob("*.py")]
    return sorted(
        p for p in files if TOOLS not in p.parents and p not in ENTRY_POINTS and "assets" not in p.parts
    )


def tools_imports(source: str, rel: tuple[str, ...]) -> list[str]:
    """Imports of ``hpar_agent.tools`` in ``source`` (the file at ``rel`` under the repository): absolute,
    ``from hpar_agent import tools``, or relative from inside ``agent/``; as ``line N: module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and rel[0] == "agent":  # relative: resolve against the file's package
                pkg = ["hpar_agent", *rel[1:-1]]
                base = ".".join([*pkg[: len(pkg) - node.level + 1], *([base] if base else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found += [
            f"line {node.lineno}: {n}"
            for n in names
            if n == "hpar_agent.tools" or n.startswith("hpar_agent.tools.")
        ]
    return found


def test_the_static_check_sees_every_spelling() -> None:
    where = ("agent", "collectors", "probe.py")
    cases = {
        "import hpar_agent.tools.cli": True,
        "from hpar_agent.tools.report import main": True,
        "from hpar_agent import tools": True,
        "from ..tools import summary": True,
        "from .. import tools": True,
        "from hpar_agent import catalogue": False,
        "from ..torch_compat import dynamo": False,
        "from . import steps": False,
    }
    assert {src: bool(tools_imports(src, where)) for src in cases} == cases


def test_no_runtime_module_imports_the_tools() -> None:
    files = runtime_files()
    assert any(p.name == "agent.py" for p in files) and any(p.parent.name == "collectors" for p in files)
    bad = {
        str(p.relative_to(REPO)): hits
        for p in files
        if (hits := tools_imports(p.read_text(), p.relative_to(REPO).parts))
    }
    assert bad == {}, "the runtime must not import hpar_agent.tools"


def test_importing_the_runtime_loads_no_tool() -> None:
    """Import every runtime module in a fresh interpreter; none may pull in ``hpar_agent.tools``."""
    code = """
import importlib, json, pkgutil, sys
import hpar_agent, hpar_agent.agent
mods = ["hpar_agent.agent"]
for pkg in ("hpar_agent.collectors", "hpar_agent.detectors", "hpar_agent.exporters", "hpar_agent.torch_compat"):
    mods.append(pkg)
    mods += [m.name for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + ".")]
mods += [m.name for m in pkgutil.iter_modules(hpar_agent.__path__, "hpar_agent.") if not m.ispkg]
for m in mods:
    importlib.import_module(m)
print(json.dumps({"imported": mods, "tools": sorted(m for m in sys.modules if m.startswith("hpar_agent.tools"))}))
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO / "tests"
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"hpar_agent.agent", "hpar_agent.collectors.steps", "hpar_agent.exporters.otel"} <= set(
        out["imported"]
    )
    assert "hpar_agent.__main__" in out["imported"]  # importing the entry point runs nothing
    assert not any(m.startswith("hpar_agent.tools") for m in out["imported"])
    assert out["tools"] == []
