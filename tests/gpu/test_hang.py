"""A rank waiting on its GPU is hung; a rank evaluating between steps is not.

Between steps, Hang counts the training thread working on a CPU as progress (an evaluation). On a GPU the
thread that waits for a kernel spins on a CPU as well (CUDA's default schedule), so there progress also
needs the thread to have run Python or the allocator to have served an allocation: a wait for a kernel
that never ends does neither, an evaluation both.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

EVAL_S, STUCK_S, TIMEOUT_S = 4.0, 5.0, 1.5


def _kernel_seconds(seconds: float) -> None:
    """Enqueue ``seconds`` of ``torch.cuda._sleep`` on the current stream (calibrated here)."""
    t = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    per_cycle = (time.perf_counter() - t) / 10**8
    for _ in range(int(seconds)):
        torch.cuda._sleep(int(1.0 / per_cycle))
    torch.cuda._sleep(int((seconds % 1.0) / per_cycle) + 1)


def test_a_wait_for_a_kernel_that_never_ends_is_a_hang_and_an_evaluation_is_not(
    attached: Callable[..., Any],
) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    agent = attached(
        model, traces="none", metrics_port=-1, interval=0.2, evidence=False,
        thresholds={"Hang.timeout_s": TIMEOUT_S},
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 2048, device="cuda")
    for _ in range(5):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    steps = agent.component("steps")
    seen: list[tuple[str, bool, float | None]] = []  # (phase, Hang active, thread's CPU share), 0.1 s
    doing = ["steps"]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            hang = any(a.name == "Hang" for a in agent.active_alerts())
            seen.append((doing[0], hang, steps.cpu_share))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        doing[0] = "eval"
        t_end = time.time() + EVAL_S
        with torch.no_grad():
            while time.time() < t_end:  # forwards, a metric read back each batch
                model(x).argmax(-1).float().mean().item()
        progress_in_eval = steps.last_progress_ts - steps.last_step_ts
        doing[0] = "stuck"
        _kernel_seconds(STUCK_S)
        torch.ones(1, device="cuda").sum().item()  # waits behind the kernel
        doing[0] = "done"
        time.sleep(0.5)
    finally:
        stop.set()
        watcher.join()
    stuck_shares = [s for p, _h, s in seen if p == "stuck" and s is not None]
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "gpu-hang.json").write_text(
            json.dumps({"progress_in_eval_s": progress_in_eval, "seen": seen}, indent=0)
        )
    assert progress_in_eval > 1.0, seen  # the evaluation was progress
    assert not [s for s in seen if s[1] and s[0] in ("steps", "eval")], seen
    assert ("stuck", True) in [(p, h) for p, h, _s in seen], seen  # the wait on the GPU is not
    # what made it a test: the waiting thread spun (the CPU alone would have called it work)
    assert stuck_shares and max(stuck_shares) >= 0.5, seen
