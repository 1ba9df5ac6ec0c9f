"""The agent's fixed cost per training step, in µs of CPU time: what a fast loop pays whatever its size.

Every figure is CPU time (``time.thread_time`` for the training thread, each agent thread's own CPU
clock), so it holds on a loaded machine where wall-clock ratios do not.

1. Training-thread hooks, on a micro step (a small MLP: forward, backward, optimizer step) in
   interleaved blocks: detached; ``attach()`` (the global optimizer hooks: step marking, the step
   anatomy's optimizer phase); ``attach(model)`` (plus the anatomy's module and autograd hooks); and a
   one-stage pipeline schedule (``--microbatches``) detached against ``attach(model)`` +
   ``watch_pipeline``. An arm's cost is its training-thread CPU per step minus the arm before it, pair
   by pair. Twice: with every step detailed (``HPAR_DETAIL_RATE=0``) and with none (a fast loop gets
   the per-step detail on every k-th step only).
2. The agent's threads, on the tiny GPT loop of ``overhead --config short-*`` (in-process, the agent
   at its defaults, traces to a file) for ``--seconds``: each thread's CPU per second and per step;
   the agent thread's per-step work (components' ``on_step``; span building, ``tracing.export_step``)
   apart from its per-pass work (``poll``, ``end_pass`` and the rest), which is fixed per second.
3. GIL holds: then the training thread alternates a step with ``--probe-ms`` of pure Python that
   notes every stretch over 0.1 ms in which it did not run, and how much CPU the agent's threads took
   in it: how long the agent keeps the GIL from a training thread that wants it. (Where the training
   thread was descheduled while an agent thread ran on another core, that counts too: a bound.)

The last lines state the fixed cost per step at ``--rate`` steps a second (100: a 10 ms step).

    python -m benchmarks.hook_cost --json hook-cost.json
    python -m benchmarks.hook_cost --device cuda --json hook-cost-gpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    ThreadClocks,
    describe,
    finish,
    need_device,
    patched_env,
    ratio_stats,
    results,
    started_since,
    thread_group,
    time_parts,
    title,
)
from benchmarks.tiny_gpt import PRESETS, TinyGPT

#: Stretches the probe takes for a stall: longer than the probe loop's own iteration by far.
GAP_S = 100e-6


def attach(
    model: Any = None, optimizer: Any = None, schedule: Any = None, run_dir: str = "", **kw: Any
) -> Any:
    import hpar_agent

    agent = hpar_agent.attach(model, optimizer=optimizer, run_dir=run_dir, **kw)
    if schedule is not None:
        agent.watch_pipeline(schedule=schedule)
    return agent


# ------------------------------------------------------------------------------------ 1. hooks
def micro(device: torch.device, microbatches: int) -> dict[str, Any]:
    """The micro step and a one-stage pipeline of the same model (world size 1, gloo or NCCL)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    torch.manual_seed(0)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)).to(
            device
        )

    model, pp_model = mlp(), mlp()
    opt, pp_opt = (
        torch.optim.SGD(model.parameters(), lr=1e-4),
        torch.optim.SGD(pp_model.parameters(), lr=1e-4),
    )
    sched = ScheduleGPipe(
        PipelineStage(pp_model, 0, 1, device),
        n_microbatches=microbatches,
        loss_fn=lambda out, y: (out - y).square().mean(),
    )
    x = torch.randn(4 * microbatches, 32, device=device)

    held = {"model": model}

    def step() -> None:
        """The model out of sight of ``attach()``'s search for it (the step's locals and their
        attributes, not a dict's items): the ``attach()`` arm is the optimizer hooks alone."""
        held["model"](x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def pp_step() -> None:
        sched.step(x, target=x)
        pp_opt.step()
        pp_opt.zero_grad(set_to_none=True)

    return {
        "model": model,
        "opt": opt,
        "step": step,
        "pp_model": pp_model,
        "pp_opt": pp_opt,
        "sched": sched,
        "pp_step": pp_step,
    }


def hook_blocks(
    m: dict[str, Any], rounds: int, per_block: int, detail_rate: str, work: str
) -> dict[str, Any]:
    """Training-thread CPU per step of each arm in interleaved blocks (``detail_rate``: the agent's
    ``HPAR_DETAIL_RATE``), and each hook's cost: an arm minus the arm it adds to, pair by pair."""
    import hpar_agent

    kw = {"metrics_port": -1, "traces": "none", "event_log": False}
    arms: dict[str, tuple[Callable[[], None], Callable[[str], Any]]] = {
        "off": (m["step"], lambda rd: None),
        "optimizer": (m["step"], lambda rd: attach(run_dir=rd, **kw)),
        "model": (m["step"], lambda rd: attach(m["model"], m["opt"], run_dir=rd, **kw)),
        "pp_off": (m["pp_step"], lambda rd: None),
        "pp_on": (m["pp_step"], lambda rd: attach(m["pp_model"], m["pp_opt"], m["sched"], run_dir=rd, **kw)),
    }
    names = list(arms)
    cpu: dict[str, list[float]] = {a: [] for a in names}
    strides: set[Any] = set()
    for r in range(rounds):
        for arm in names[r % len(names) :] + names[: r % len(names)]:
            step, attach_arm = arms[arm]
            with patched_env({"HPAR_DETAIL_RATE": detail_rate}):
                agent = attach_arm(os.path.join(work, f"hooks-{detail_rate}-{r}-{arm}"))
            try:
                for _ in range(16):  # warm, and the steps the agent sets its detail stride from
                    step()
                if agent is not None:
                    agent.tick()
                    steps = agent.component("steps")
                    strides.add(steps.summary().get("detail_stride") if steps is not None else None)
                c0 = time.thread_time()
                for _ in range(per_block):
                    step()
                cpu[arm].append((time.thread_time() - c0) / per_block)
            finally:
                if agent is not None:
                    hpar_agent.detach()

    agent = attach(run_dir=os.path.join(work, f"mark-{detail_rate}"), interval=3600.0, **kw)
    try:  # step marking alone: what the optimizer's post-hook calls, timed directly
        steps = agent.component("steps")
        c0 = time.thread_time()
        for _ in range(2000):
            steps.mark()
        mark_us = (time.thread_time() - c0) / 2000 * 1e6
    finally:
        hpar_agent.detach()

    def cost(arm: str, base: str) -> dict[str, Any]:
        return ratio_stats([(a - b) * 1e6 for a, b in zip(cpu[arm], cpu[base], strict=True)])

    return {
        "detail_rate": detail_rate,
        "strides": sorted(strides, key=str),
        "mark_us": mark_us,
        "cpu_us": {a: statistics.median(v) * 1e6 for a, v in cpu.items()},
        "optimizer_hooks_us": cost("optimizer", "off"),
        "module_hooks_us": cost("model", "optimizer"),
        "pipeline_us": cost("pp_on", "pp_off"),
    }


# ------------------------------------------------------------------------------------ 2. agent threads, 3. GIL
def gpt_loop(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    p: dict[str, Any] = PRESETS["gpu" if device.type == "cuda" else "cpu"]
    torch.manual_seed(0)
    model = TinyGPT(p["vocab"], p["seq_len"], p["dim"], p["heads"], p["layers"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4)
    data = torch.randint(0, p["vocab"], (p["batch"], p["seq_len"] + 1), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, p["vocab"]), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()

    return model, opt, step


def probe(seconds: float, probe_s: float, step: Callable[[], None], clocks: list[int]) -> dict[str, Any]:
    """Steps, each followed by ``probe_s`` of pure Python noting every stretch over ``GAP_S`` it did not
    run, with the agent threads' CPU (``clocks``) and its own CPU within the stretch."""
    stalls: list[tuple[float, float, float]] = []  # (wall, agent CPU, own CPU) of each stretch
    now, cpu_of, own_of = time.perf_counter, time.clock_gettime, time.thread_time
    end = now() + seconds
    while now() < end:
        step()
        t_end = now() + probe_s
        last_t, last_own, last_c = now(), own_of(), sum(cpu_of(c) for c in clocks)
        while last_t < t_end:
            t, own, c = now(), own_of(), sum(cpu_of(c) for c in clocks)
            if t - last_t > GAP_S:
                stalls.append((t - last_t, c - last_c, own - last_own))
            last_t, last_own, last_c = t, own, c
    holds = [
        min(a, w) for w, a, _o in stalls if a > GAP_S
    ]  # the agent's CPU while the training thread waited
    return {
        "seconds": seconds,
        "stalls": len(stalls),
        "agent_holds": len(holds),
        "agent_hold_ms": describe(holds, 1e3),
        "holds_over_1ms_per_s": sum(h > 1e-3 for h in holds) / seconds,
        "own_ms": describe([o for w, a, o in stalls if a <= GAP_S and o >= 0.5 * w], 1e3),
        "other_ms": describe([w for w, a, o in stalls if a <= GAP_S and o < 0.5 * w], 1e3),
    }


def agent_threads(
    device: torch.device, seconds: float, probe_seconds: float, probe_ms: float, work: str
) -> dict[str, Any]:
    """The tiny GPT loop with the agent at its defaults: its threads' CPU over a window, then the probe."""
    import hpar_agent

    model, opt, step = gpt_loop(device)
    for _ in range(5):
        step()
    before = threading.enumerate()
    agent = attach(model, opt, run_dir=os.path.join(work, "threads"), metrics_port=0, traces="file")
    try:
        warm_end = time.perf_counter() + min(3.0, seconds / 3)
        while time.perf_counter() < warm_end:  # the first passes and the detail stride settle
            step()
        parts: dict[str, float] = {}
        time_parts(agent, parts)
        clocks = ThreadClocks(started_since(before))
        cpu0, own0, t0 = clocks.read(), time.thread_time(), time.perf_counter()
        steps = 0
        while time.perf_counter() - t0 < seconds:
            step()
            steps += 1
        wall, cpu1 = time.perf_counter() - t0, clocks.read()
        own = time.thread_time() - own0
        summary = agent.component("steps")  # the stride the window's steps got (the probe's are longer)
        stride = summary.summary().get("detail_stride") if summary is not None else None
        parts = dict(parts)  # the window's (the probe's steps come after)
        threads: dict[str, float] = {}
        for name, c in cpu1.items():
            threads[thread_group(name)] = threads.get(thread_group(name), 0.0) + c - cpu0.get(name, c)
        by_clock = [
            clocks.clocks[n] for n in clocks.clocks if thread_group(n) in ("agent thread", "span exporter")
        ]
        gil = probe(probe_seconds, probe_ms / 1e3, step, by_clock)
    finally:
        hpar_agent.detach()
    per_step = {k: v for k, v in parts.items() if k.endswith(".on_step") or k == "tracing.export_step"}
    agent_cpu = threads.get("agent thread", 0.0)
    return {
        "steps": steps,
        "window_s": wall,
        "steps_per_s": steps / wall,
        "step_ms": wall / steps * 1e3,
        "training_thread_cpu_us_per_step": own / steps * 1e6,
        "detail_stride": stride,
        "thread_cpu_ms_per_s": {k: v / wall * 1e3 for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
        "thread_cpu_us_per_step": {k: v / steps * 1e6 for k, v in threads.items()},
        "agent_parts_us_per_step": {
            k: v / steps * 1e6 for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
        },
        "agent_per_step_work_us": sum(per_step.values()) / steps * 1e6,
        "span_building_us_per_step": parts.get("tracing.export_step", 0.0) / steps * 1e6,
        "agent_per_pass_work_ms_per_s": (agent_cpu - sum(per_step.values())) / wall * 1e3,
        "gil": gil,
    }


# ------------------------------------------------------------------------------------ report
def print_report(r: dict[str, Any]) -> None:
    print(title(r, "the agent's fixed cost per step (µs of CPU time)"))
    for h in r["hooks"]:
        c = h["cpu_us"]
        st = sorted(x for x in h["strides"] if x is not None)
        stride = "-" if not st else str(st[0]) if len(st) == 1 else f"{st[0]}-{st[-1]}"
        print(
            f"1. training-thread hooks, HPAR_DETAIL_RATE={h['detail_rate']} (detail stride {stride}); micro "
            f"step {c['off']:.1f} us, pipeline step {c['pp_off']:.1f} us detached:"
        )
        for key, what in (
            ("optimizer_hooks_us", "optimizer hooks + step marking (attach())"),
            ("module_hooks_us", "module/autograd hooks (attach(model) over attach())"),
            (
                "pipeline_us",
                f"pipeline step, {r['microbatches']} microbatches (attach(model) + "
                "watch_pipeline over detached)",
            ),
        ):
            st = h[key]
            print(
                f"   {what:70} {st['median']:7.1f} us ({st['ci_lo']:.1f}-{st['ci_hi']:.1f}, {st['ci_coverage']:.0%})"
            )
        print(
            f"   {'of the optimizer hooks, step marking (StepCollector.mark() called directly)':70} {h['mark_us']:7.1f} us"
        )
    t = r["threads"]
    print(
        f"2. agent threads on the tiny GPT loop ({t['step_ms']:.2f} ms steps, {t['steps_per_s']:.1f} steps/s, "
        f"{t['window_s']:.0f} s; detail stride {t['detail_stride']}); training thread {t['training_thread_cpu_us_per_step']:.0f} "
        "us CPU a step"
    )
    for name, ms in t["thread_cpu_ms_per_s"].items():
        print(f"   {name:20} {ms:7.2f} ms CPU per s = {t['thread_cpu_us_per_step'][name]:7.1f} us per step")
    parts = ", ".join(f"{k} {v:.1f}" for k, v in list(t["agent_parts_us_per_step"].items())[:8])
    print(f"   agent thread by part (us per step): {parts}")
    g = t["gil"]
    hold = g["agent_hold_ms"]
    print(
        f"3. GIL holds seen by a pure-Python training thread ({g['seconds']:.0f} s): {g['agent_holds']} by the agent's "
        f"threads, longest {hold.get('max', 0):.2f} ms, p99 {hold.get('p99', 0):.2f} ms, median "
        f"{hold.get('median', 0):.2f} ms; {g['holds_over_1ms_per_s']:.2f} over 1 ms a second; own stalls (GC) max "
        f"{g['own_ms'].get('max', 0):.2f} ms, descheduled max {g['other_ms'].get('max', 0):.2f} ms"
    )
    f = r["fixed"]
    train = f["optimizer_us"] + f["module_us"]
    print(
        f"\nfixed cost per step at {f['rate']:.0f} steps/s ({1e3 / f['rate']:.0f} ms steps; one detailed in {f['stride']}):"
    )
    print(
        f"  training thread, on every step: {train:.1f} us = optimizer hooks {f['optimizer_us']:.1f} (step marking "
        f"{f['mark_us']:.1f}) + module hooks {f['module_us']:.1f} (a detailed step {f['module_detailed_us']:.1f}); "
        f"a watched pipeline's step {f['pipeline_us']:.1f}"
    )
    print(
        f"  agent threads, beside it:       agent thread {f['agent_thread_us']:.1f} us = per-step work "
        f"{f['agent_per_step_us']:.1f} (span building {f['span_building_us']:.1f}; measured at one detailed in "
        f"{f['window_stride']}) + per-pass work {f['agent_per_pass_us']:.1f}; span exporter {f['exporter_us']:.1f} us"
    )
    print(
        f"  GIL: the agent's threads held it from a waiting training thread {f['hold_max_ms']:.2f} ms at the "
        f"longest (p99 {f['hold_p99_ms']:.2f} ms)"
    )


def stride_at(rate: float, measured: int | None) -> int:
    """Every how many steps the agent details one at ``rate`` steps a second with its default settings
    (its own rule), or the stride the window measured where this agent has no such rule."""
    try:
        from hpar_agent.collectors.steps import detail_stride
        from hpar_agent.config import AgentConfig

        c = AgentConfig()
        return int(detail_stride([1.0 / rate] * 64, c.detail_rate, c.trace_every))
    except (ImportError, AttributeError, TypeError):
        return measured or 1


def fixed_cost(hooks: list[dict[str, Any]], t: dict[str, Any], rate: float) -> dict[str, Any]:
    """The figures of 1-3 as one statement at ``rate`` steps a second: the hooks averaged over the detail
    stride at that rate (a detailed step every ``stride``), the agent thread's per-step work as measured
    plus its per-pass work spread over ``rate`` steps."""
    full, none = hooks[0], hooks[1]
    stride = stride_at(rate, t["detail_stride"])

    def avg(key: str) -> float:
        return float(none[key]["median"] + (full[key]["median"] - none[key]["median"]) / stride)

    per_pass_us = t["agent_per_pass_work_ms_per_s"] * 1e3 / rate
    return {
        "rate": rate,
        "stride": stride,
        "window_steps_per_s": t["steps_per_s"],
        "window_stride": t["detail_stride"],
        "optimizer_us": avg("optimizer_hooks_us"),
        "module_us": avg("module_hooks_us"),
        "mark_us": none["mark_us"] + (full["mark_us"] - none["mark_us"]) / stride,
        "module_detailed_us": full["module_hooks_us"]["median"],
        "pipeline_us": avg("pipeline_us"),
        "agent_per_step_us": t["agent_per_step_work_us"],
        "span_building_us": t["span_building_us_per_step"],
        "agent_per_pass_us": per_pass_us,
        "agent_thread_us": t["agent_per_step_work_us"] + per_pass_us,
        "exporter_us": t["thread_cpu_us_per_step"].get("span exporter", 0.0),
        "hold_max_ms": t["gil"]["agent_hold_ms"].get("max", 0.0),
        "hold_p99_ms": t["gil"]["agent_hold_ms"].get("p99", 0.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=20, help="1: interleaved rounds of every arm")
    ap.add_argument("--block", type=int, default=400, help="1: steps per block")
    ap.add_argument("--microbatches", type=int, default=4, help="1: microbatches of the pipeline step")
    ap.add_argument("--seconds", type=float, default=15.0, help="2: the agent threads' window")
    ap.add_argument("--probe-seconds", type=float, default=10.0, help="3: the GIL probe's duration")
    ap.add_argument("--probe-ms", type=float, default=20.0, help="3: pure Python after each step")
    ap.add_argument("--rate", type=float, default=100.0, help="steps a second the fixed cost is stated at")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    need_device(a.device)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one training thread's core, as the tiny GPT's CPU preset
    work = tempfile.mkdtemp(prefix="hpar-hook-cost-")
    r = results("hook_cost", a.device, argv, microbatches=a.microbatches)
    m = micro(device, a.microbatches)
    r["hooks"] = [hook_blocks(m, a.rounds, a.block, rate, work) for rate in ("0", "0.001")]
    r["threads"] = agent_threads(device, a.seconds, a.probe_seconds, a.probe_ms, work)
    r["fixed"] = fixed_cost(r["hooks"], r["threads"], a.rate)
    finish(r, a.json)
    print_report(r)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
