"""The compatibility runs: one small job per launcher or framework on 2 CPU gloo ranks, each under
``hpar-agent run`` and again with the program calling ``hpar_agent.attach()`` itself, run once per
session on first use and shared by every test that reads it.

The programs (``programs/``) mention hpar_agent only for that ``attach()`` line; each rank writes what it really did
(optimizer steps, dynamo's own counters) to ``result.rank<R>.json`` for the tests to compare with
what the agent reported. Hugging Face is kept offline (models are built from configs)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from testkit.zerocode import Launches, Run, Spec

PROGRAMS = Path(__file__).resolve().parent / "programs"
BIN = Path(sys.executable).parent


def _torchrun(*args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", *args]


def _accelerate(*args: str) -> list[str]:
    return [
        str(BIN / "accelerate"),
        *"launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no".split(),
        *args,
    ]


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


TRAIN = str(PROGRAMS / "train.py")


#: name -> job. Steps are few: what is compared is exact, not statistical; the fault runs run longer,
#: as long as their detector needs (MemoryLeak: ~16 steps; Straggler: two store exchanges after warm-up).
SPECS: dict[str, Spec] = {
    "torchrun": Spec(
        _torchrun(TRAIN, "env", "--steps", "8", "--compile", "aot_eager"), compile_backend="aot_eager"
    ),
    "mp_spawn": Spec(_py(TRAIN, "spawn", "--steps", "8")),
    "start_processes": Spec(_py(TRAIN, "start_processes", "--steps", "8")),
    "mp_process_leak": Spec(
        _py(TRAIN, "process", "--steps", "40", "--step-s", "0.05", "--leak-mib", "4", "--leak-rank", "1"),
        faults={1: "MemoryLeak"},
    ),
    "srun_env_straggler": Spec(
        _py(
            str(PROGRAMS / "srun_like.py"),
            "2",
            sys.executable,
            TRAIN,
            *"env --steps 50 --step-s 0.02 --slow-rank 1 --slow-s 0.3".split(),
        ),
        faults={1: "Straggler"},
    ),
    "ddp_gan": Spec(_torchrun(str(PROGRAMS / "gan.py"), "--steps", "12")),
    "single_process": Spec(
        _py(TRAIN, "single", "--steps", "8", "--compile", "eager"), world=1, compile_backend="eager"
    ),
    "nanogpt_single": Spec(_py(str(PROGRAMS / "nanogpt.py"), "--steps", "24", "--eval-every", "8"), world=1),
    "accelerate": Spec(
        _accelerate(str(PROGRAMS / "accelerate_train.py"), "--steps", "8"), needs="accelerate"
    ),
    "lightning": Spec(
        _py(str(PROGRAMS / "lightning_train.py"), "--steps", "8", "--compile", "aot_eager"),
        needs="lightning",
        compile_backend="aot_eager",
    ),
    "hf_trainer_torchrun": Spec(
        _torchrun(str(PROGRAMS / "hf_trainer.py"), "--steps", "8", "--compile", "aot_eager"),
        needs="transformers",
        compile_backend="aot_eager",
    ),
    "hf_trainer_accelerate": Spec(
        _accelerate(str(PROGRAMS / "hf_trainer.py"), "--steps", "8"), needs="transformers"
    ),
    # evaluations at steps the detail stride (20 at these ~9 ms steps) does not pick
    "hf_trainer_eval": Spec(
        _torchrun(str(PROGRAMS / "hf_trainer.py"), *"--steps 160 --eval-every 37 --eval-size 1200".split()),
        needs="transformers",
    ),
    # The same launchers with the program calling hpar_agent.attach() itself (no hpar-agent run).
    "attach_torchrun": Spec(_torchrun(TRAIN, "env", "--steps", "6", "--attach"), zero_code=False),
    "attach_mp_spawn": Spec(_py(TRAIN, "spawn", "--steps", "6", "--attach"), zero_code=False),
    "attach_start_processes": Spec(
        _py(TRAIN, "start_processes", "--steps", "6", "--attach"), zero_code=False
    ),
    "attach_mp_process": Spec(_py(TRAIN, "process", "--steps", "6", "--attach"), zero_code=False),
    "attach_srun_env": Spec(
        _py(str(PROGRAMS / "srun_like.py"), "2", sys.executable, TRAIN, "env", "--steps", "6", "--attach"),
        zero_code=False,
    ),
    "attach_single_process": Spec(_py(TRAIN, "single", "--steps", "6", "--attach"), world=1, zero_code=False),
    "attach_accelerate": Spec(
        _accelerate(str(PROGRAMS / "accelerate_train.py"), "--steps", "6", "--attach"),
        needs="accelerate",
        zero_code=False,
    ),
    "attach_lightning": Spec(
        _py(str(PROGRAMS / "lightning_train.py"), "--steps", "6", "--attach"),
        needs="lightning",
        zero_code=False,
    ),
    "attach_hf_trainer_torchrun": Spec(
        _torchrun(str(PROGRAMS / "hf_trainer.py"), "--steps", "6", "--attach"),
        needs="transformers",
        zero_code=False,
    ),
    "attach_hf_trainer_accelerate": Spec(
        _accelerate(str(PROGRAMS / "hf_trainer.py"), "--steps", "6", "--attach"),
        needs="transformers",
        zero_code=False,
    ),
}


@pytest.fixture(scope="session")
def compat_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Run]]:
    """``compat_run(name)``: the run of ``SPECS[name]``, launched on first use."""
    base = tmp_path_factory.mktemp("compat")
    yield Launches(base, SPECS)
    shutil.rmtree(base, ignore_errors=True)
