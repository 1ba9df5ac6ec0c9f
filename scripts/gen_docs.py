"""Docs tables generated from the catalogue: ``python scripts/gen_docs.py`` rewrites them in place,
``--check`` only says which pages drifted (exit 1).

Each table sits between ``<!-- catalogue:NAME -->`` and ``<!-- /catalogue:NAME -->`` markers in the
page that owns it (``PAGES``); a test fails when a page drifts from the catalogue. Given file paths,
the script renders those files instead.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hpar_agent import catalogue as cat

ROOT = Path(__file__).resolve().parents[1]


def env_table() -> str:
    """The settings' variables, from their declarations on ``AgentConfig``'s fields, then the tools'."""
    rows = ["| variable | `AgentConfig` field | default | values | meaning |", "|---|---|---|---|---|"]
    for s in cat.ENV_VARS:
        shown = "unset" if s.default in (None, "") else f"`{s.default}`"
        rows.append(f"| `{s.env}` | `{s.name}` | {shown} | {s.want} | {s.help} |")
    rows += [f"| `{var.env}` | - | unset | - | {var.help} |" for var in cat.TOOL_ENV_VARS]
    return "\n".join(rows)


def metrics_table() -> str:
    rows = ["| metric | type | labels (besides rank, pp_stage) | meaning |", "|---|---|---|---|"]
    for m in cat.METRICS:
        labels = ", ".join(m.labels) or "-"
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.help} |")
    return "\n".join(rows)


def alerts_table() -> str:
    rows = ["| alert | severity | meaning |", "|---|---|---|"]
    rows += [f"| `{a.name}` | {a.severity} | {a.summary} |" for a in cat.ALL_ALERTS]
    return "\n".join(rows)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def thresholds_table() -> str:
    from hpar_agent import thresholds as th

    rows = ["| alert | parameter | default | compared by |", "|---|---|---|---|"]
    for alert, params in th.DETECTOR_DEFAULTS.items():
        rows += [f"| `{alert}` | `{p}` | {_num(v)} | detector |" for p, v in params.items()]
    rows += [
        f"| step anatomy | `anatomy.{p}` | {_num(v)} | verdict |" for p, v in th.ANATOMY_DEFAULTS.items()
    ]
    for (alert, signal), params in th.RULE_THRESHOLDS.items():
        rows += [f"| `{alert}` | `{p}` | {_num(v)} | rule signal={signal} |" for p, v in params.items()]
    return "\n".join(rows)


def params_table(prefix: str) -> str:
    """The parameters of one detector (``prefix``: its alert) or of the detectors component
    (``detectors``), as declared in ``hpar_agent.thresholds``, with the key ``thresholds`` takes."""
    from hpar_agent import thresholds as th

    params = th.COMPONENT_PARAMS if prefix == "detectors" else th.DETECTOR_PARAMS[prefix]
    rows = ["| parameter | default | meaning |", "|---|---|---|"]
    rows += [f"| `{prefix}.{p.name}` | {_num(p.default)} | {p.help} |" for p in params]
    return "\n".join(rows)


def _params_tables() -> dict[str, Callable[[], str]]:
    from hpar_agent import thresholds as th

    return {
        f"params_{name}": functools.partial(params_table, name) for name in [*th.DETECTOR_PARAMS, "detectors"]
    }


TABLES: dict[str, Callable[[], str]] = {
    "env": env_table,
    "metrics": metrics_table,
    "alerts": alerts_table,
    "thresholds": thresholds_table,
    **_params_tables(),
}

#: The page that owns each generated table (relative to the repository root).
PAGES: dict[str, tuple[str, ...]] = {
    "docs/configuration.md": ("env",),
    "docs/metrics.md": ("metrics",),
    "docs/alerts.md": ("alerts", "thresholds", *(name for name in TABLES if name.startswith("params_"))),
}


def _fill(table: str, m: re.Match[str]) -> str:
    return m.group(1) + table + "\n" + m.group(2)


def render(text: str) -> str:
    for name, fn in TABLES.items():
        pattern = re.compile(rf"(<!-- catalogue:{name} -->\n)(?:.*?\n)?(<!-- /catalogue:{name} -->)", re.S)
        text = pattern.sub(functools.partial(_fill, fn()), text)
    return text


def sync_generated(files: Mapping[Path, str], check: bool, regenerate: str) -> int:
    """Write generated files; with ``check``, write nothing and return 1 if a committed file differs
    (the dashboards and manifests generators share this, so CI catches an edit made by hand)."""
    if not check:
        for path, text in files.items():
            path.write_text(text)
        return 0
    stale = [path.name for path, text in files.items() if not path.exists() or path.read_text() != text]
    if stale:
        print(f"stale (run {regenerate}): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    check = "--check" in args
    paths = [Path(a) for a in args if a != "--check"] or [ROOT / page for page in PAGES]
    return sync_generated({p: render(p.read_text()) for p in paths}, check, "python scripts/gen_docs.py")


if __name__ == "__main__":
    sys.exit(main())
