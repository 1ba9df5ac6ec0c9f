"""GPU tests: the agent's numbers on CUDA and NCCL against independent sources (torch.profiler, sysfs,
torch.cuda, the allocator snapshot). Every test here is skipped without CUDA, and a test marked
``gpus(n)`` without n devices, so the CPU suite collects and skips them in well under a second.

They need nothing beyond torch (a CUDA build), prometheus_client, nvidia-ml-py, numpy and pytest, plus
what the project's own dependencies bring as wheels (opentelemetry-*, protobuf, py-spy, plotly). See
README.md here for the commands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if HERE not in item.path.parents:
            continue
        mark = item.get_closest_marker("gpus")
        need = int(mark.args[0]) if mark is not None and mark.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {have}"))


@pytest.fixture(scope="session")
def nccl_group() -> Iterator[torch.device]:
    """A world-size-1 NCCL process group on cuda:0 for the in-process tests (one for the session: a
    process holds one default group)."""
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


@pytest.fixture
def attached(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``attach(model=None, **settings)``: the agent with a run directory of the test's own, detached at
    the end of the test (one agent a process)."""
    import hpar_agent

    def attach(model: Any = None, **kw: Any) -> Any:
        kw.setdefault("run_dir", str(tmp_path / "agent"))
        return hpar_agent.attach(model, **kw)

    yield attach
    hpar_agent.detach()
    import gc

    import torch

    gc.collect()  # what the test held (an out-of-memory test fills the card): the next tests get the GPU back
    torch.cuda.empty_cache()


#: The reference trainer on one GPU (inductor, bf16, a small model: ~25 ms steps) with the agent.
TRAINER = (
    "--device cuda --compile inductor --dtype bf16 --layers 4 --dim 1024 "
    "--heads 8 --seq-len 512 --global-batch 8 --vocab 8192 --lr 3e-4 "
    "--steps 150 --log-every 50"
).split()
TRAINER_RUNS = {"clean": [], "slow-data": ["--inject", "slow-data", "--inject-delay", "0.05"]}


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One clean run of ``TRAINER`` and one with a slow data loader (50 ms a batch), each with the agent
    and every step's detail and trace: their run directories (``trainer.json`` the trainer's record)."""
    from hpar_trainer.launch import run_torchrun

    base = tmp_path_factory.mktemp("trainer")
    out = {}
    for name, extra in TRAINER_RUNS.items():
        run = base / name
        env = {
            "HPAR_RUN_DIR": str(run),
            "HPAR_JOB_ID": f"gpu-{name}",
            "HPAR_METRICS_PORT": "-1",
            "HPAR_TRACES": "file",
            "HPAR_TRACE_EVERY": "1",
            "HPAR_DETAIL_RATE": "0",
        }
        res = run_torchrun(1, [*TRAINER, *extra, "--out", str(run / "trainer.json")], env=env, timeout=600)
        assert res.returncode == 0, (name, res.stderr[-3000:])
        out[name] = run
    return out
