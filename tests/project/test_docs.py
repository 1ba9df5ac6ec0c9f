"""The docs follow the catalogue: generated tables match it, every name users type or query is
documented on its page, and every relative link of the README and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpar_agent import catalogue as cat
from scripts.gen_docs import PAGES, render

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _text(page: str) -> str:
    return (ROOT / page).read_text()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_generated_tables_match_the_catalogue(page: str) -> None:
    text = _text(page)
    for name in PAGES[page]:
        assert f"<!-- catalogue:{name} -->" in text and f"<!-- /catalogue:{name} -->" in text, (page, name)
    assert render(text) == text, "run: python scripts/gen_docs.py"


def test_each_table_has_one_page() -> None:
    owners = [name for names in PAGES.values() for name in names]
    assert len(owners) == len(set(owners))
    for path in [ROOT / "README.md", *DOCS]:
        page = str(path.relative_to(ROOT))
        for name in re.findall(r"<!-- catalogue:(\w+) -->", path.read_text()):
            assert name in PAGES.get(page, ()), (
                f"{page} holds the {name} table, which belongs in another page"
            )


def test_every_env_var_is_documented() -> None:
    text = _text("docs/configuration.md")
    for name in [v.env for v in cat.ENV_VARS + cat.TOOL_ENV_VARS] + list(cat.RESOURCE_ENV):
        assert f"`{name}`" in text, name


#: Where the project's files name HPAR_* variables (config.py, the loader, names the removed ones).
_NAMING_HPAR = [
    "README.md",
    "docs",
    "deploy",
    "agent",
    "exporters",
    "trainer",
    "benchmarks",
    "testkit",
    "dashboards",
    "scripts",
]


def test_every_hpar_name_in_docs_and_code_is_declared() -> None:
    """A variable the docs or code name is a setting or a tools' variable of the catalogue: a name the
    code stopped reading (HPAR_LOG_BACKUPS) cannot linger in the docs, nor a read slip past the
    unknown-name warning."""
    declared = {v.env for v in cat.ENV_VARS + cat.TOOL_ENV_VARS}
    files = [
        p for top in _NAMING_HPAR for p in ([ROOT / top] if top.endswith(".md") else (ROOT / top).rglob("*"))
    ]
    seen = set()
    for path in files:
        if not path.is_file() or path.suffix not in {".md", ".py", ".yml", ".yaml", ".sh", ".toml"}:
            continue
        if path == ROOT / "agent" / "config.py":
            continue
        for name in re.findall(r"\bHPAR_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            seen.add(name)
            assert name in declared, (
                f"{path.relative_to(ROOT)} names {name}, which the catalogue does not declare"
            )
    assert {"HPAR_RUN_DIR", "HPAR_AUTOATTACH", "HPAR_DIAGNOSE_RUN"} <= seen  # the scan reads the code


def test_every_metric_is_documented() -> None:
    text = _text("docs/metrics.md")
    for m in cat.METRICS:
        assert f"`{m.name}`" in text, m.name


def test_every_alert_is_documented() -> None:
    text = _text("docs/alerts.md")
    for a in cat.ALL_ALERTS:
        assert f"`{a.name}`" in text, a.name
        assert f"\n### {a.name}\n" in text, a.name  # a section each: what, value, where to look


def test_every_runbook_url_lands_on_its_alert_section() -> None:
    anchors = _anchors(ROOT / "docs" / "alerts.md")
    assert cat.RUNBOOK_PAGE_URL.endswith("/docs/alerts.md")
    for a in cat.ALL_ALERTS:
        page, _, anchor = a.runbook_url.partition("#")
        assert page == cat.RUNBOOK_PAGE_URL and anchor in anchors, a.runbook_url


def test_every_span_and_attribute_is_documented() -> None:
    text = _text("docs/traces.md")
    names = [*cat.SPAN_NAMES, cat.SPAN_COLLECTIVE_PREFIX + "<op>"]
    attrs = [
        v for k, v in vars(cat).items() if k.startswith(("ATTR_", "RES_", "EVENT_")) and isinstance(v, str)
    ]
    for name in [*names, *attrs]:
        assert f"`{name}`" in text, name


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        rel = str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest)
        assert dest.exists(), f"{path.name}: broken link {target}"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{path.name}: no heading for #{anchor} in {rel}"


def test_no_diary_in_the_docs() -> None:
    """Results are current facts with hardware, date and command; history lives in git."""
    diary = re.compile(r"\b\w+(st|nd|rd|th) session|device call|[^a-z]lent[^a-z]", re.I)
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not diary.search(line), f"{path.name}:{n}: {line}"


def _works_with(text: str) -> str:
    return text.split("<!-- works-with -->", 1)[1].split("<!-- /works-with -->", 1)[0].strip()


def test_works_with_table_names_a_compat_job_in_every_cell() -> None:
    """README's and docs/launchers.md's "Works with" table are one table; every cell of its two modes
    names a job of tests/compat (the first backticked id) in the mode the job runs in, and every job
    is in it."""
    from tests.compat.conftest import SPECS

    table = _works_with(_text("docs/launchers.md"))
    assert _works_with(_text("README.md")) == table
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
