"""Per-step cost of the agent's training-thread hooks, measured side by side in one run.

Times ``optimizer.step()`` on a tiny model in interleaved blocks with the agent attached and detached
(so drift in machine load hits both equally), then one ``StepCollector.mark()`` called directly. The
difference of the block medians is what the optimizer hooks (step boundary, anatomy's optimizer phase)
cost a training step. Then the same for a whole step (forward, backward, optimizer step) of the tiny
model attached with ``attach(model)``: that adds the step anatomy's root-module forward hooks and its
backward hooks (a grad_fn pre-hook and an autograd-engine callback per forward).

    python -m benchmarks.hook_cost [--steps 10000] [--blocks 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hpar_agent


def _time_steps(opt: torch.optim.Optimizer, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        opt.step()
    return (time.perf_counter() - t0) / n


def _time_full_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        model(x).sum().backward()
        opt.step()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000, help="optimizer steps per configuration")
    ap.add_argument("--blocks", type=int, default=10, help="interleaved on/off blocks (steps split evenly)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    model(torch.randn(4, 8)).sum().backward()  # grads stay, so every step does real work
    per_block = max(1, args.steps // args.blocks)
    run_dir = tempfile.mkdtemp(prefix="hpar-bench-")
    kwargs = dict(metrics_port=-1, traces="none", event_log=False, run_dir=run_dir)
    hpar_agent.detach()
    _time_steps(opt, per_block)  # warm-up
    on: list[float] = []
    off: list[float] = []
    for i in range(args.blocks):
        if i % 2 == 0:  # alternate which arm runs first: order effects cancel over the blocks
            off.append(_time_steps(opt, per_block))
        hpar_agent.attach(**kwargs)
        try:
            on.append(_time_steps(opt, per_block))
        finally:
            hpar_agent.detach()
        if i % 2:
            off.append(_time_steps(opt, per_block))
    x = torch.randn(4, 8)
    agent = hpar_agent.attach(**kwargs)
    try:
        steps = agent.component("steps")
        assert steps is not None
        n = args.steps
        t0 = time.perf_counter()
        for _ in range(n):
            steps.mark()  # type: ignore[attr-defined]
        mark_us = (time.perf_counter() - t0) / n * 1e6
        anat: Any = agent.component("anatomy")
        assert anat is not None
        m = min(n, 5000)
        outs = [model(torch.randn(4, 8)) for _ in range(m)]  # fresh grad_fns, as every forward makes
        t0 = time.perf_counter()
        for out in outs:
            anat._fwd_pre(model, ())
            anat._fwd_post(model, (), out)
            anat._opt_pre(opt, (), {})
        anatomy_us = (time.perf_counter() - t0) / m * 1e6
        # backward: the output tensor hook and the engine callbacks it queues, paired with a bare backward;
        # as in a distributed CPU run, the second callback that closes the DDP/FSDP wait (comm_exposed) too
        anat._dist_on = lambda: True
        diffs = []
        for i in range(m // 5):
            a_out, b_out = model(x).sum(), model(x).sum()
            a_out.register_hook(anat._bwd_pre)
            first, second = (b_out, a_out) if i % 2 else (a_out, b_out)  # alternate: order effects cancel
            t0 = time.perf_counter()
            first.backward()
            t1 = time.perf_counter()
            second.backward()
            t_first, t_second = t1 - t0, time.perf_counter() - t1
            diffs.append(t_second - t_first if i % 2 else t_first - t_second)  # hooked minus bare
        bwd_us = statistics.median(diffs) * 1e6
        anat.buffer.drain()
        per_hook = {}
        for comp in agent._step_hooks:  # the components mark() fans out to
            t0 = time.perf_counter()
            for i in range(n):
                comp.step_hook(i, time.time_ns())
            per_hook[comp.name] = (time.perf_counter() - t0) / n * 1e6
    finally:
        hpar_agent.detach()
    _time_full_steps(model, opt, x, per_block)  # warm-up
    full_on: list[float] = []
    full_off: list[float] = []
    for i in range(args.blocks):
        if i % 2 == 0:  # alternate which arm runs first: order effects cancel over the blocks
            full_off.append(_time_full_steps(model, opt, x, per_block))
        # no agent pass inside the block: this is the training thread's cost alone (a pass drains the
        # block's events afterwards; at ~20k steps/s its per-step work would compete for the GIL)
        hpar_agent.attach(model, **kwargs, interval=3600.0)
        try:
            full_on.append(_time_full_steps(model, opt, x, per_block))
        finally:
            hpar_agent.detach()
        if i % 2:
            full_off.append(_time_full_steps(model, opt, x, per_block))
    full_off_us, full_on_us = statistics.median(full_off) * 1e6, statistics.median(full_on) * 1e6
    off_us, on_us = statistics.median(off) * 1e6, statistics.median(on) * 1e6
    print(f"torch {torch.__version__}; {args.blocks} interleaved blocks x {per_block} optimizer.step() each")
    print(f"optimizer.step() detached : {off_us:8.2f} us/step (median of blocks)")
    print(f"optimizer.step() attached : {on_us:8.2f} us/step (median of blocks)")
    print(f"agent hook cost per step  : {on_us - off_us:8.2f} us  ({on_us / off_us:.3f}x of a bare step)")
    print(f"StepCollector.mark()      : {mark_us:8.2f} us/call (direct, agent attached)")
    for name, us in per_hook.items():
        print(f"  of which {name + '.step_hook':<16}: {us:8.2f} us/call")
    print(f"anatomy hooks, direct     : {anatomy_us:8.2f} us/step (forward pre+post with grad_fn pre-hook, optimizer pre)")
    print(f"anatomy backward hooks    : {bwd_us:8.2f} us/step (pre-hook + engine callback, median of paired backwards)")
    print(f"full step detached        : {full_off_us:8.2f} us/step (forward + backward + optimizer.step)")
    print(f"full step attach(model)   : {full_on_us:8.2f} us/step (+ step anatomy module/autograd hooks; no agent pass)")
    print(f"agent cost per full step  : {full_on_us - full_off_us:8.2f} us  ({full_on_us / full_off_us:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "torch": torch.__version__, "blocks": args.blocks, "steps_per_block": per_block,
            "detached_us": off_us, "attached_us": on_us, "hook_cost_us": on_us - off_us,
            "mark_us": mark_us, "step_hooks_us": per_hook,
            "full_step_detached_us": full_off_us, "full_step_attached_us": full_on_us,
            "full_step_hook_cost_us": full_on_us - full_off_us, "anatomy_hooks_direct_us": anatomy_us,
            "anatomy_backward_us": bwd_us,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
