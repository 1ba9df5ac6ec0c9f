"""Per-rank run record: step times, forward time, memory, compile counters and parameter checksums.

Written as JSON after every step so tests (and people) can compare ranks even when a run crashes.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from hpar_agent.safefiles import private_dir, write_atomic


def rss_mb() -> float:
    """Current resident set size (falls back to peak RSS where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_path(out: str, rank: int) -> Path:
    p = Path(out)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class RankRecorder:
    """Collects what one rank observed; ``forward_timer`` hooks measure local forward time."""

    def __init__(self, out: str | None, rank: int, coords: dict[str, int]) -> None:
        self.path = rank_path(out, rank) if out else None
        self.data: dict[str, Any] = {
            "rank": rank,
            "coords": coords,
            "steps": [],
            "compile": {"graphs": 0, "ops": 0, "comm_ops": 0},
            "leaked_bytes": 0,
        }
        self.current: dict[str, Any] = {}
        self._fwd_t0: float | None = None

    @property
    def compile_stats(self) -> dict[str, int]:
        return self.data["compile"]

    def forward_timer(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._fwd_start)
        module.register_forward_hook(self._fwd_end)

    def _fwd_start(self, *_: Any) -> None:
        self._fwd_t0 = time.perf_counter()

    def _fwd_end(self, *_: Any) -> None:
        if self._fwd_t0 is not None:
            self.current["fwd_s"] = self.current.get("fwd_s", 0.0) + time.perf_counter() - self._fwd_t0
            self._fwd_t0 = None

    def begin_step(self, step: int) -> None:
        self.current = {"step": step, "fwd_s": 0.0, "t0": time.time()}  # t0: when diagnose counts from

    def end_step(self, step_s: float, loss: float | None) -> None:
        self.current.update(step_s=step_s, loss=loss, rss_mb=rss_mb(), leaked_bytes=self.data["leaked_bytes"])
        self.data["steps"].append(self.current)
        self.flush()

    def finish(self, parts: list[nn.Module]) -> None:
        from torch._dynamo.utils import counters

        self.data["dynamo"] = {
            "frames": dict(counters["frames"]),
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompile_limit_hits": sum(
                v for k, v in counters["unimplemented"].items() if "recompile limit" in k
            ),
        }
        self.data["checksums"] = param_checksums(parts)
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            private_dir(str(self.path.parent), chosen=True)  # 0600 in 0700, as the agent's own files
            write_atomic(str(self.path), json.dumps(self.data, indent=1).encode())


def param_checksums(parts: list[nn.Module]) -> dict[str, float]:
    """Sum of each parameter's local values: equal on replicas that stayed in sync."""
    sums: dict[str, float] = {}
    for part in parts:
        for name, p in part.named_parameters():
            local = p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # type: ignore[attr-defined]
            sums[name] = float(local.double().sum()) + float(local.double().abs().sum())
    return sums
