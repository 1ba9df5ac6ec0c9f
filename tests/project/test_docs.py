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


def _works_with(text: str) -> str:
    return text.split("<!-- works-with -->", 1)[1].split("<!-- /works-with -->", 1)[0].strip()


def test_works_with_table_names_a_compat_job_in_every_cell():
    """README's and docs/launchers.md's "Works with" table are one table, every cell of its two modes
    names a job of tests/compat (the first backticked id), in the mode the job runs in, and every job
    is in it."""
    import re

    from tests.compat.conftest import SPECS

    page = (README.parent / "docs" / "launchers.md").read_text()
    table = _works_with(page)
    assert _works_with(README.read_text()) == table
    named: set[str] = set()
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 3, row
        for cell, zero_code in ((cells[1], False), (cells[2], True)):
            ids = [i for i in re.findall(r"`([a-z0-9_]+)`", cell) if i in SPECS]
            assert ids, f"no compat job named in {cell!r}"
            for i in ids:
                assert SPECS[i].zero_code is zero_code, (i, cell)
            named.update(ids)
    assert named == set(SPECS), set(SPECS) ^ named
