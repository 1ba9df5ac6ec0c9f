"""``hpar-agent fr-trace RUN_DIR``: torch's own flight-recorder analyser on a run's per-rank dumps.

When an alert takes flight-recorder evidence (Hang, CollectiveMismatch), each rank writes its ring as
``evidence/<Alert>-<n>.rank<R>.<time>.<i>.fr-<recorder>.pickle``. This gathers the latest of each rank
into a directory as ``<prefix><rank>`` (what ``torch.distributed.flight_recorder.fr_trace`` reads), mends
the group table of gloo dumps (torch 2.13 keys ``pg_config`` by an empty name, once, while each entry
names its group: the analyser raises ``KeyError`` as shipped) and runs the analyser with
``--allow-incomplete-ranks`` (a dead rank wrote nothing). Its verdict ("Not all ranks joining
collective ... missing ranks: {2}") is a second opinion on the agent's own (Hang's ``details.culprits``).

The dumps are pickles, which run code when loaded: only regular files of this user, written by the
agent into its 0700 run directory, are read.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hpar_agent.safefiles import open_regular

_DUMP = re.compile(r"\.rank(\d+)\.[^/]*\.fr-(gloo|nccl)\.pickle$")
PREFIX = "rank"
ANALYSER = "torch.distributed.flight_recorder.fr_trace"


def latest_dumps(run_dir: Path, recorder: str | None = None) -> dict[str, dict[int, Path]]:
    """recorder -> rank -> the newest dump of that rank in ``run_dir/evidence``."""
    out: dict[str, dict[int, Path]] = {}
    for path in (run_dir / "evidence").glob("*.pickle"):
        m = _DUMP.search(path.name)
        if m is None or (recorder and m.group(2) != recorder) or not _ours(path):
            continue
        rank, rec = int(m.group(1)), m.group(2)
        best = out.setdefault(rec, {}).get(rank)
        if best is None or path.stat().st_mtime > best.stat().st_mtime:
            out[rec][rank] = path
    return out


def _ours(path: Path) -> bool:
    """A regular file of this user that no one else may write: what the agent writes (0600)."""
    st = path.lstat()
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def mend(dumps: dict[int, dict[str, Any]]) -> None:
    """Key every dump's ``pg_config`` by the group names its entries use, as the analyser looks them up,
    with each group's members: the ranks whose dumps hold an entry of it (the world for the default
    group, from the table torch wrote)."""
    members: dict[str, set[int]] = {}
    descs: dict[str, str] = {}
    world: str | None = None
    for rank, d in dumps.items():
        for cfg in (d.get("pg_config") or {}).values():
            if isinstance(cfg, dict) and cfg.get("ranks") and world is None:
                world = str(cfg["ranks"])
        for e in d.get("entries") or ():
            name, desc = [*(e.get("process_group") or ()), "", ""][:2]
            members.setdefault(str(name), set()).add(rank)
            descs[str(name)] = str(desc)
    for d in dumps.values():
        cfg = dict(d.get("pg_config") or {})
        for name, ranks in members.items():
            if name not in cfg:
                full = descs[name] == "default_pg" and world is not None
                cfg[name] = {
                    "name": name,
                    "desc": descs[name],
                    "ranks": world if full else str(sorted(ranks)),
                }
        d["pg_config"] = cfg


def analyse(run_dir: Path, recorder: str | None = None, extra: list[str] | None = None) -> tuple[int, str]:
    """(exit status, output) of torch's analyser over the run's dumps (status 2: nothing to analyse)."""
    found = latest_dumps(run_dir, recorder)
    if not found:
        return (
            2,
            f"no flight-recorder dumps in {run_dir / 'evidence'} (they are taken when Hang or "
            "CollectiveMismatch fires)",
        )
    rec = recorder or max(found, key=lambda r: len(found[r]))
    dumps = {}
    for rank, path in sorted(found[rec].items()):
        with os.fdopen(open_regular(path), "rb") as f:
            dumps[rank] = pickle.load(f)  # see the module doc: only the agent's own files
    mend(dumps)
    with tempfile.TemporaryDirectory(prefix="hpar-fr-") as tmp:
        for rank, d in dumps.items():
            with open(os.path.join(tmp, f"{PREFIX}{rank}"), "wb") as f:
                pickle.dump(d, f)
        cmd = [sys.executable, "-m", ANALYSER, "-p", PREFIX, "--allow-incomplete-ranks", *(extra or []), tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    head = f"torch's flight-recorder analyser on the {rec} dumps of ranks {', '.join(map(str, sorted(dumps)))}:\n"
    out = res.stdout + res.stderr  # the analyser logs its verdicts on stderr
    return res.returncode, head + "\n".join(
        line for line in out.splitlines() if "tabulate is not installed" not in line
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (HPAR_RUN_DIR of the run)")
    p.add_argument(
        "--recorder",
        choices=("gloo", "nccl"),
        help="which recorder's dumps (default: the one most ranks wrote)",
    )
    p.add_argument(
        "analyser_args", nargs=argparse.REMAINDER, help="more arguments for the analyser, after --"
    )


def run(args: argparse.Namespace) -> int:
    extra = list(args.analyser_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    status, text = analyse(Path(args.run_dir), args.recorder, extra)
    print(text)
    return status
