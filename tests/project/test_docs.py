"""The README's tables are generated from the catalogue and must not drift from it."""

from __future__ import annotations

from pathlib import Path

from hpar_agent import catalogue as cat
from scripts.gen_docs import render

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_tables_match_catalogue():
    text = README.read_text()
    assert render(text) == text, "run: python scripts/gen_docs.py README.md"


def test_readme_documents_every_env_var_and_metric():
    text = README.read_text()
    for var in cat.ENV_VARS:
        assert f"`{var.name}`" in text
    for m in cat.METRICS:
        assert f"`{m.name}`" in text
