"""``hpar-agent export dashboards|rules|compose --out DIR``: the deploy files a pip user has no clone for.

The files ship inside the package under ``hpar_agent/assets/`` (in the source tree, links to the
committed ``dashboards/`` and ``deploy/``, so there is one copy; a wheel holds real files).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # hpar_agent/assets

#: What each kind writes: (path under ASSETS, glob) -> files land under OUT with the path after
#: ``strip`` removed. ``compose`` keeps the repository layout its relative mounts expect.
KINDS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "dashboards": ("dashboards", [("dashboards", "*.json")]),
    "rules": ("deploy/prometheus/rules", [("deploy/prometheus/rules", "*.yml")]),
    "compose": (
        "",
        [
            ("dashboards", "*.json"),
            ("deploy/compose", "compose.yaml"),
            ("deploy/compose", "Dockerfile"),
            ("deploy/compose", "alert_webhook.py"),
            ("deploy/compose/grafana/provisioning", "*/*.yaml"),
            ("deploy/prometheus", "prometheus.yml"),
            ("deploy/prometheus/rules", "*.yml"),
            ("deploy/alertmanager", "*.yml"),
        ],
    ),
}


def asset_files(kind: str) -> dict[Path, Path]:
    """``{relative output path: packaged source}`` for one kind; raises when the package lacks them."""
    strip, patterns = KINDS[kind]
    found: dict[Path, Path] = {}
    for sub, pattern in patterns:
        for src in sorted((ASSETS / sub).glob(pattern)):
            if src.is_file():
                found[src.relative_to(ASSETS / strip) if strip else src.relative_to(ASSETS)] = src
    if not found:
        raise FileNotFoundError(f"no {kind} files in this installation of hpar-agent ({ASSETS})")
    return found


def export(kind: str, out: Path) -> list[Path]:
    """Copy one kind of asset under ``out`` (created); existing files are overwritten. Returns the paths."""
    written = []
    for rel, src in asset_files(kind).items():
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        written.append(dest)
    return written


_NEXT = {
    "dashboards": "import them in Grafana (Dashboards > New > Import) or mount them for file provisioning",
    "rules": "list them under rule_files in prometheus.yml",
    "compose": "docker compose -f {out}/deploy/compose/compose.yaml up prometheus alertmanager alert-webhook grafana jaeger "
    "(the trainer service builds from a source checkout)",
}


def main(kind: str, out: str) -> int:
    try:
        written = export(kind, Path(out))
    except OSError as exc:
        print(f"hpar-agent export: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} {kind} file(s) under {out}; next: {_NEXT[kind].format(out=out)}")
    return 0
