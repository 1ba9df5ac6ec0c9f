"""The zero-code shim (``zerocode_site/sitecustomize.py``) in fresh interpreters, without starting torch:
every process is armed the same way, whatever launched it, and it chains to an existing
sitecustomize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpar_agent.tools.run_cmd import SHIM_DIR, child_env

#: What a launcher around the test run may have set; the shim reads them.
LAUNCH_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}


PROBE = (
    "import json, os, sys; sc = sys.modules['sitecustomize']; "
    "print(json.dumps([sc.__file__, sc._hpar_mode, os.environ.get('HPAR_AUTOATTACH'), 'torch' in sys.modules, "
    "[type(f).__name__ for f in sys.meta_path if getattr(f, '_hpar_autoattach', False)]]))"
)


def _clean_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HPAR_", "TORCHELASTIC_", "PYTHONPATH")) and k not in LAUNCH_VARS
    }


def _probe(env: dict[str, str]) -> list[Any]:
    base = _clean_env()
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def test_shim_is_shipped_in_the_package() -> None:
    assert (SHIM_DIR / "sitecustomize.py").is_file()


@pytest.mark.parametrize(
    "launch_env",
    [{}, {"TORCHELASTIC_RUN_ID": "x"}, {"WORLD_SIZE": "2"}, {"SLURM_NTASKS": "8"}, {"WORLD_SIZE": "1"}],
)
def test_every_process_arms_the_same_way_and_imports_nothing(
    tmp_path: Path, launch_env: dict[str, str]
) -> None:
    """Whatever launched it: one finder waits for c10d and torch, nothing is imported, and the marker
    stays in the environment for the process's own children (mp.spawn ranks, Lightning's ranks)."""
    sc, mode, var, torch_loaded, finders = _probe({**child_env({}, tmp_path), **launch_env})
    assert Path(sc).resolve() == (SHIM_DIR / "sitecustomize.py").resolve()
    assert (mode, var, torch_loaded, finders) == ("armed", "1", False, ["_AfterImport"])


@pytest.mark.parametrize("extra", [{"HPAR_DISABLE": "1"}, {"HPAR_AUTOATTACH": ""}])
def test_disable_or_no_marker_installs_nothing(tmp_path: Path, extra: dict[str, str]) -> None:
    _, mode, _, _, finders = _probe({**child_env({}, tmp_path), **extra})
    assert (mode, finders) == ("off", [])


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = child_env({"PYTHONPATH": str(theirs)}, tmp_path / "run")
    base = _clean_env()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sitecustomize; print(os.environ.get('THEIRS_RAN'), sitecustomize._hpar_mode)",
        ],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert out.stdout.split() == ["yes", "armed"]
