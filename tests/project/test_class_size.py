"""One job per object: no class of the agent or its exporters holds more than ``MAX_ATTRIBUTES``
instance attributes (the distinct ``self.<name>`` a class's own methods assign, read with ``ast``).
A class past the bar has become several jobs: split it by job rather than raise the bar."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_ATTRIBUTES = 24


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for fn in ast.walk(cls):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            else:
                continue
            while targets:
                t = targets.pop()
                if isinstance(t, ast.Tuple | ast.List):
                    targets.extend(t.elts)
                elif isinstance(t, ast.Starred):
                    targets.append(t.value)
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def _classes() -> dict[str, int]:
    out: dict[str, int] = {}
    for root in (ROOT / "agent", ROOT / "exporters"):
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    out[f"{path.relative_to(ROOT)}:{node.name}"] = len(_instance_attributes(node))
    return out


def test_no_class_holds_more_than_the_bar() -> None:
    classes = _classes()
    over = {k: n for k, n in classes.items() if n > MAX_ATTRIBUTES}
    assert not over, f"split these classes by job (at most {MAX_ATTRIBUTES} instance attributes): {over}"


def test_the_count_sees_every_kind_of_assignment() -> None:
    cls = ast.parse(
        "class C:\n"
        "    def __init__(self):\n"
        "        self.a = self.b = 0\n"
        "        self.c: int = 1\n"
        "        self.d, (self.e, x) = 1, (2, 3)\n"
        "    def f(self):\n"
        "        self.a += 1\n"
        "        self.g[0] = self.h.i = 3\n"
    ).body[0]
    assert isinstance(cls, ast.ClassDef)
    assert _instance_attributes(cls) == {"a", "b", "c", "d", "e"}
