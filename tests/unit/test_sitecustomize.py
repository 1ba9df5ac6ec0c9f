"""The zero-code shim (``zerocode_site/sitecustomize.py``) in fresh interpreters, without starting torch:
what it installs in a torchrun worker, a plain script and the launcher, and that it chains to an
existing sitecustomize."""

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
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("HPAR_", "TORCHELASTIC_", "PYTHONPATH")) and k not in LAUNCH_VARS}  # fmt: skip


def _probe(env: dict[str, str]) -> list[Any]:
    base = _clean_env()
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    return json.loads(out.stdout)


def test_shim_is_shipped_in_the_package() -> None:
    assert (SHIM_DIR / "sitecustomize.py").is_file()


@pytest.mark.parametrize("rank_env", [{"TORCHELASTIC_RUN_ID": "x"}, {"WORLD_SIZE": "2"}, {"SLURM_NTASKS": "8"}])
def test_worker_patches_the_process_group_only_after_torch_distributed(
    tmp_path: Path, rank_env: dict[str, str]
) -> None:
    """A torchrun worker, or a rank another launcher started: a finder waits for distributed_c10d;
    nothing imported, env kept for its children."""
    sc, mode, var, torch_loaded, finders = _probe({**child_env({}, tmp_path), **rank_env})
    assert Path(sc).resolve() == (SHIM_DIR / "sitecustomize.py").resolve()
    assert (mode, var, torch_loaded, finders) == ("worker", "1", False, ["_AfterImport"])


def test_plain_script_consumes_the_marker(tmp_path: Path) -> None:
    """``python train.py``: waits for ``import torch``; its own children are not observed."""
    _, mode, var, torch_loaded, finders = _probe({**child_env({}, tmp_path), "WORLD_SIZE": "1"})
    assert (mode, var, torch_loaded, finders) == ("script", None, False, ["_AfterImport"])


@pytest.mark.parametrize("extra", [{"HPAR_DISABLE": "1"}, {"HPAR_AUTOATTACH": ""}])
def test_disable_or_no_marker_installs_nothing(tmp_path: Path, extra: dict[str, str]) -> None:
    _, mode, _, _, finders = _probe({**child_env({}, tmp_path), **extra})
    assert (mode, finders) == ("off", [])


@pytest.mark.parametrize(("argv", "mode"), [
    (["torchrun", "--nproc-per-node", "2", "t.py"], "launcher"),  # the torchrun script
    (["-m", "torch.distributed.run", "t.py"], "launcher"),
    (["t.py", "-m", "x"], "script"),  # an argument of the script, not python's -m
    (["torchrun_helper.py"], "script"),
])
def test_torchrun_launcher_is_left_alone(tmp_path: Path, argv: list[str], mode: str) -> None:
    """The launcher process (the torchrun script, or ``python -m torch.distributed.run``) trains nothing:
    the shim installs nothing there and keeps the marker for the workers it starts. Each command runs
    the probe: a file of that name, and a stand-in ``torch.distributed.run`` ahead on the path."""
    fake = tmp_path / "fake"
    (fake / "torch" / "distributed").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "__init__.py").write_text("")
    for script in (fake / "torch" / "distributed" / "run.py", tmp_path / "torchrun", tmp_path / "t.py",
                   tmp_path / "torchrun_helper.py"):  # fmt: skip
        script.write_text(PROBE.replace("'torch' in sys.modules", "False"))
    env = {**_clean_env(), **child_env({"PYTHONPATH": str(fake)}, tmp_path / "run")}
    args = [str(tmp_path / a) if a in ("torchrun", "t.py", "torchrun_helper.py") else a for a in argv]
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=30, check=True)
    _, got, var, _, finders = json.loads(out.stdout)
    assert got == mode
    if mode == "launcher":
        assert finders == [] and var == "1"  # nothing installed; the marker stays for the workers
    else:
        assert var is None  # a script consumes the marker


def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = 'yes'\n")
    env = child_env({"PYTHONPATH": str(theirs)}, tmp_path / "run")
    base = _clean_env()
    out = subprocess.run([sys.executable, "-c", "import os, sitecustomize; print(os.environ.get('THEIRS_RAN'), "
                          "sitecustomize._hpar_mode)"], env={**base, **env}, capture_output=True, text=True,
                         timeout=30, check=True)  # fmt: skip
    assert out.stdout.split() == ["yes", "script"]
