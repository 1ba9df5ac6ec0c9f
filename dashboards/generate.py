"""Generate the hpar-agent Grafana dashboards (Grafana 11 flavour) from code.

Dashboards are built with Grafana Labs' grafana-foundation-sdk builders (pinned
``grafana-foundation-sdk==1769699379!11.6.0``) and committed as JSON next to this file, so a metric
rename breaks ``--check`` and the tests rather than a panel in production.

    python -m dashboards.generate           # (re)write dashboards/*.json
    python -m dashboards.generate --check   # exit 1 when a committed JSON differs from the code

Every query filters on the ``$job``, ``$rank`` and ``$pp_stage`` variables (and ``$pg`` on the
collectives dashboard); cross-rank aggregates read the recording rules of
``deploy/prometheus/rules/hpar-recording.yml``.

Built for 1,024 ranks: no panel draws every rank. Per-rank time series show the worst (or best)
``$topn`` ranks over the visible time range (:func:`~dashboards.panels.worst`); the whole job is seen
in rank x time heatmaps and in tables (one row per rank at most). Per-rank queries join ``job_id`` from
``hpar_rank_info`` (the run's id, ``$job_id``), which is not Prometheus's scrape ``job``. Alerts and
compiles are annotations. Latency panels ask for exemplars, whose ``trace_id``
label the provisioned Prometheus datasource links to Jaeger. Panels whose description ends with
:data:`GPU_MARK` only have data on CUDA ranks (NVML and the caching allocator).

The shared panel, query and board helpers are in ``panels.py``; each dashboard is built in its own
module beside it (``overview.py``, ``collectives.py``, ``compile.py``, ``memory.py``, ``pipeline.py``).
This module lists them and writes or checks their JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from dashboards.collectives import collectives
from dashboards.compile import compile_board
from dashboards.memory import memory
from dashboards.overview import overview
from dashboards.panels import GPU_MARK, Board, build
from dashboards.pipeline import pipeline
from scripts.gen_docs import sync_generated

OUT_DIR = Path(__file__).resolve().parent


BOARDS: dict[str, Callable[[], Board]] = {
    "overview": overview,
    "collectives": collectives,
    "compile": compile_board,
    "memory": memory,
    "pipeline": pipeline,
}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard (stable key order, trailing newline)."""
    return {
        f"{name}.json": json.dumps(build(fn()), indent=2, sort_keys=True) + "\n"
        for name, fn in BOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if committed JSON differs from the code")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output directory (default: next to this file)")
    args = ap.parse_args(argv)
    files = {args.out / name: text for name, text in render().items()}
    return sync_generated(files, args.check, "python -m dashboards.generate")


__all__ = ["BOARDS", "GPU_MARK", "main", "render"]  # GPU_MARK: the deploy tests read it from here

if __name__ == "__main__":
    sys.exit(main())
