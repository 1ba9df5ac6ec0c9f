"""The agent knows none of the reference trainer's flags: the demo and the fault matrix get their trainer
argv from ``hpar_trainer.scenarios``, imported only when a tool runs the trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hpar_trainer.config import build_parser

REPO = Path(__file__).resolve().parents[2]
#: every directory that ships as ``hpar_agent`` (runtime, exporters, and the tools wherever they live).
AGENT_DIRS = [REPO / "agent", REPO / "exporters"]


def trainer_flags() -> set[str]:
    """Every long option the trainer's parser takes (so a flag added to the trainer is covered too)."""
    return {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def trainer_flag_uses(source: str, flags: set[str]) -> list[str]:
    """Trainer flags spelled in ``source``'s code: a string literal (or f-string part) that is a trainer
    flag (``"--dp"``, ``"--steps=5"``), or a literal holding one among its words (``"--dp 2 --tp 1"``)
    unless the agent's own CLI defines that flag too (its messages may name it). Exempt: the agent's
    own ``add_argument`` option names and docstrings (prose may mention the trainer)."""
    tree = ast.parse(source)
    own: set[int] = set()
    own_flags: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    own.add(id(arg))
                    own_flags.add(arg.value)
    skip = own | _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        exact = text.split("=", 1)[0] in flags
        if exact or any(w.split("=", 1)[0] in flags - own_flags for w in text.split()):
            found.append(f"line {node.lineno}: {text!r}")
    return found


def test_no_agent_module_spells_a_trainer_flag():
    flags = trainer_flags()
    assert {"--inject", "--dp", "--compile", "--steps", "--out"} <= flags  # the parser was read
    files = sorted(p for d in AGENT_DIRS for p in d.rglob("*.py"))
    assert any(p.name == "diagnose.py" for p in files) and any(p.name == "cli.py" for p in files)
    bad = {str(p.relative_to(REPO)): uses for p in files if (uses := trainer_flag_uses(p.read_text(), flags))}
    assert bad == {}, "trainer flags belong in trainer/scenarios.py"


@pytest.mark.parametrize(
    "code",
    [
        'args = ["--dp", "2"]',
        'argv += ["--inject", name]',
        'argv = [f"--steps={n}"]',
        'argv = "--pp 1 --compile eager".split()',
        'print("use --dp-mode ddp")',
    ],
)
def test_the_check_catches_a_trainer_flag(code):
    assert trainer_flag_uses(code, trainer_flags())


def test_the_check_allows_the_agents_own_cli_and_prose():
    code = '''"""Runs ``--inject NAME`` and ``--dp-mode ddp`` modes."""
p.add_argument("--inject", action="append", help="failure mode (see hpar-train --help)")
p.add_argument("--steps", type=int)
print("give --inject NAME or --all")
'''
    assert trainer_flag_uses(code, trainer_flags()) == []


def _cli_without_trainer(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``hpar-agent ARGS`` in an interpreter where ``hpar_trainer`` cannot be imported."""
    code = "import sys; sys.modules['hpar_trainer'] = None; from hpar_agent.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


@pytest.mark.parametrize("command", [["demo"], ["diagnose", "--inject", "straggler"], ["diagnose", "--all"]])
def test_without_the_trainer_demo_and_diagnose_say_so_in_one_line(tmp_path, command):
    res = _cli_without_trainer(*command, cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"hpar-agent {command[0]}: error: the reference trainer is not importable"), line
    assert "hpar_trainer" in line
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_tools_that_do_not_run_the_trainer_work_without_it(tmp_path):
    res = _cli_without_trainer("export", "rules", "--out", str(tmp_path / "rules"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert any((tmp_path / "rules").glob("*.yml"))
