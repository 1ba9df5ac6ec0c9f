"""The detectors' cross-rank exchange against one real ``TCPStore``: bytes, round time, the store's
CPU, and what an unrelated store operation waits meanwhile, for the agent's peer selection and for the
old all-peers scheme, side by side.

One ``TCPStore`` server, alone in its process, and N simulated ranks: threads in ``--procs`` worker
processes, each rank with its own client socket, as every rank of a job opens its own
(``crossrank.open_store``). Each rank's payload is made by the agent's own builder
(``detectors.component.payload`` of a real agent without its thread), at the largest the agent
publishes: its collectors hold the flight recorder's last 2,048 collectives of a transformer of
``FR_BLOCKS`` blocks (over 341 a step with tp or FSDP, so the published window is at its cap of 1,024
entries; 256 for DDP alone) ``FR_STEP0`` steps into a run, on a pipeline stage its p2p waits at each
entry (``pw``), a GPU throttled twice with ECC errors and an Xid (``gh``), and the reference GPT's
parameter checksums at 3 steps and tp gradient samples; and it reads what the agent reads
(``crossrank.plan(...).wants()``, through ``crossrank.Exchange``).

A round is the agent's exchange: every rank sets its blobs at one instant (``publish``), then every
rank gets its peers' (``read``; the agent reads a poll later). Payloads are encoded before that instant
and decoded after it: a real rank does that on its own host, and 1,024 ranks' JSON on 2 cores would
time the simulation rather than the store. For the same reason the ranks' processes run at nice 19
(``--nice``) and the store's and the prober's at -10 (``--store-nice``, as root): the store gets the
CPU first, and the unrelated operation times the store, not the VM's other tenants. The round time is
the wall time of the two phases, an upper bound (the simulated ranks themselves need ~0.1 ms of CPU
each per phase on these 2 cores); the store's CPU time in them (``/proc``) is the figure that does not
depend on the simulation. Past ``--threads`` (1,024) a thread goes through several ranks in turn
(4,096 threads thrash a 2-core VM). The agent's scheme spreads each phase as the agent does
(``crossrank.cadence`` at the default ``detectors.exchange_s`` and interval: each rank's operation at
its offset, over one pass's window up to 1,024 ranks, over several passes past that, a pass
``interval`` seconds apart); ``--spread S`` instead spreads it over S seconds (0: all at once, as
the old scheme did), ``--spread 0 agent`` runs both side by side. Blobs go compressed as the agent
sends them (``crossrank.COMPRESS_ABOVE``); ``--plain`` also runs each case with every blob plain JSON,
side by side. Before the rounds it prints what one rank's agent thread spends per exchange encoding its
payload and decoding its peers' (``codec_us``), compressed and plain.

Worst case for the agent's scheme: every purpose is set at every round (checksums and tp samples
change only every 10 steps). ``--scheme all`` is the scheme before: one merged payload per rank under
one key, every key checked at every read, and every rank reading every rank of its pipeline stage.
Meanwhile a separate process times an unrelated ``set`` + ``get`` every 2 ms (what torch's barriers
and group creation do), in the idle seconds between rounds and during the two phases.

    python -m benchmarks.store_load                                  # 64, 256, 1024 ranks; 4 layouts; both schemes
    python -m benchmarks.store_load --ranks 1024 --scheme peers --spread 0 agent   # the agent's spread against none
    python -m benchmarks.store_load --ranks 4096 --scheme peers
    python -m benchmarks.store_load --ranks 1024 --layouts dp_tp --scheme peers --plain   # compressed against plain
    python -m benchmarks.store_load --ranks 8 --layouts dp_tp --rounds 2 --json out.json   # a quick check

Layouts (N ranks): ``dp`` (dp=N), ``dp_tp`` (dp=N/8 x tp=8), ``pp_dp_tp`` (the reference trainer's
mesh order dp x pp x tp: dp=N/32, pp=4, tp=8), ``hsdp`` (dp_replicate=N/8 x dp_shard=8). The old scheme
runs up to ``--all-max`` ranks (at 1,024 one round of it moves ~20 GB, more memory than the VM has).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

#: name -> mesh dims (name, size) for N ranks, outermost first.
LAYOUTS = {
    "dp": lambda n: [("dp", n)],
    "dp_tp": lambda n: [("dp", n // 8), ("tp", 8)],
    "pp_dp_tp": lambda n: [("dp", n // 32), ("pp", 4), ("tp", 8)],
    "hsdp": lambda n: [("dp_replicate", n // 8), ("dp_shard", 8)],
}
STEPS = 30  # the steps the template rank has done (checksums at 10, 20, 30)
PROBE_EVERY_S = 0.002
IDLE_S = 1.0  # idle time before the rounds and between two rounds
START_LEAD_S = 0.2  # a timed phase starts this long after its threads are released (all asleep to it by then)
AGENT_INTERVAL_S = 1.0  # the agent's default interval (HPAR_INTERVAL): its passes come this far apart


# ------------------------------------------------------------------------------------------ payloads
#: Transformer blocks of the flight-recorder schedule: with tp (or FSDP's dp_shard) a step holds more
#: than 341 collectives, so the window a rank publishes spans 3 steps only at its cap, 1,024 entries
#: (``sources.WIDEST`` x 256), the most the agent publishes. A DDP-only rank (32 buckets) publishes 256.
FR_BLOCKS = 64
#: Steps the template rank's run is in for its sequence numbers and p2p wait totals (their digits count).
FR_STEP0 = 10_000
#: Seconds a pipeline stage waits in p2p per microbatch and direction (its published ``pw`` totals).
P2P_WAIT_S = 0.005


def _fr_window(dims: dict[str, int], n: int = 2048) -> tuple[list[dict[str, Any]], float]:
    """A rank's last ``n`` collectives (the collector keeps 2,048) ``FR_STEP0`` steps into a run, and
    its step time: per step, for each of 2 microbatches and ``FR_BLOCKS`` blocks, the tp all-reduces of
    activations (2 forward, 2 backward) or FSDP's dp_shard all-gathers (forward, backward); then the
    gradient reduction: DDP's all-reduce buckets (one per 2 blocks, sizes varying), or per block a
    dp_shard reduce-scatter and a dp_replicate all-reduce (HSDP)."""
    per_step: list[tuple[str, str, list[list[int]]]] = []
    for _mb in range(2):
        for _block in range(FR_BLOCKS):
            if dims.get("tp", 1) > 1:
                per_step += [("tp", "all_reduce", [[8, 32, 64]])] * 4
            if dims.get("dp_shard", 1) > 1:
                per_step += [("dp_shard", "_allgather_base", [[14848]])] * 2
    for block in range(FR_BLOCKS):
        if dims.get("dp_shard", 1) > 1:
            per_step += [
                ("dp_shard", "_reduce_scatter_base", [[14848]]),
                ("dp_replicate", "all_reduce", [[1856]]),
            ]
        elif "dp" in dims and block % 2 == 0:
            per_step.append(("dp", "all_reduce", [[118016 + 256 * (block % 7)]]))
    out: list[dict[str, Any]] = []
    seq = {pg: FR_STEP0 * sum(1 for g, *_ in per_step if g == pg) for pg, *_ in per_step}
    t = 1_796_000_000_000_000_000
    starts = []
    while len(out) < n + len(per_step):
        starts.append(t)
        for pg, op, sizes in per_step:
            t += 1_500_000 + (len(out) * 7919) % 900_000  # 1.5-2.4 ms apart
            seq[pg] += 1
            out.append(
                {
                    "pg": pg,
                    "seq": seq[pg],
                    "op": op,
                    "is_p2p": False,
                    "record_id": FR_STEP0 * len(per_step) + len(out),
                    "input_sizes": sizes,
                    "input_dtypes": ["Float"],
                    "time_created_ns": t,
                }
            )
    return out[-n:], statistics.median(b - a for a, b in itertools.pairwise(starts)) / 1e9


def _p2p_waits(window: list[dict[str, Any]], step_s: float) -> deque[tuple[int, int]]:
    """A pipeline stage's p2p wait log over the window's time ((exit ns, ns waited so far), as the
    pipelining wrapper keeps it): 2 microbatches x forward and backward waits a step, ``P2P_WAIT_S``
    each, totals of a run ``FR_STEP0`` steps in."""
    from hpar_agent.collectors.pipeline_p2p import MAX_WAITS

    wait_ns, step_ns = int(P2P_WAIT_S * 1e9), int(step_s * 1e9)
    first, last = window[0]["time_created_ns"], window[-1]["time_created_ns"]
    log: deque[tuple[int, int]] = deque(maxlen=MAX_WAITS)
    total = FR_STEP0 * 4 * wait_ns
    for t in range(first - step_ns, last + step_ns, step_ns // 4):
        total += wait_ns
        log.append((t, total))
    return log


def template_parts(layout: str, n: int) -> dict[str, dict[str, Any]]:
    """Rank 0's payload by purpose, from the agent's own builder (see the module doc)."""
    import torch
    from torch.distributed import HashStore

    from hpar_agent.agent import Agent
    from hpar_agent.collectors.collective_state import PgState
    from hpar_agent.collectors.collectives import CollectiveCollector
    from hpar_agent.collectors.compile import CompileCollector
    from hpar_agent.collectors.gpu_health import GpuHealthCollector
    from hpar_agent.collectors.gradsync import GradSyncCollector
    from hpar_agent.collectors.memory import NvmlCollector
    from hpar_agent.collectors.steps import StepCollector
    from hpar_agent.component import Component
    from hpar_agent.crossrank import Exchange
    from hpar_agent.detectors.cluster import ReplicaDivergence
    from hpar_agent.detectors.component import DetectorsComponent, payload
    from hpar_agent.families import Families
    from hpar_agent.topology import Topology
    from hpar_trainer.model import ModelArgs, build_model

    held = {
        name: getattr(Component, name)
        for name in (
            "install",
            "uninstall",
            "poll",
            "step_hook",
            "on_step",
            "collect",
            "span_watermark_ns",
            "summary",
        )
    }

    def holding(cls: type[Component], **state: Any) -> Component:
        """The real collector class, installing and polling nothing: it holds ``state``."""
        comp = type(f"Held{cls.__name__}", (cls,), dict(held))()
        for k, v in state.items():
            assert hasattr(comp, k), (cls.__name__, k)
            setattr(comp, k, v)
        return comp

    dims = dict(LAYOUTS[layout](n))
    torch.manual_seed(0)
    model = build_model(
        ModelArgs(vocab=128, dim=64, heads=4, layers=4, seq_len=32), seed=0
    )  # the trainer's default
    with torch.no_grad():  # trained weights: norms and biases off their round initial values, as a run's are
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    tp = dims.get("tp", 1)
    tp_sharded = (".attn.w", ".mlp.w")  # what the trainer's TP plan shards (colwise/rowwise)
    replicated = [p for name, p in model.named_parameters() if not any(s in name for s in tp_sharded)]
    dp = dims.get("dp", dims.get("dp_replicate", 1) * dims.get("dp_shard", 1))
    topo = Topology(
        rank=0,
        world_size=n,
        job_id="bench",
        dp=dp,
        tp=tp,
        pp=dims.get("pp", 1),
        dp_replicate=dims.get("dp_replicate", dp if "dp" in dims else 1),
        dp_shard=dims.get("dp_shard", 1),
    )
    run_dir = tempfile.mkdtemp(prefix="hpar-store-load-")
    agent = Agent(model, metrics_port=-1, traces="none", run_dir=run_dir)
    agent.topology = topo
    agent.families = Families(["0", "0"])
    gen = torch.Generator().manual_seed(0)  # tp gradient samples as a run's: signed, full-precision floats
    samples = (
        {
            s: [
                (torch.randn(len(replicated), generator=gen, dtype=torch.float64) * 1e-2).tolist()
                for _ in range(2)
            ]
            for s in (1, 11, 21)
        }
        if tp > 1
        else {}
    )
    window, step_s = _fr_window(dims)
    last = {e["pg"]: e["seq"] for e in window}  # each group's last collective, entered and completed
    collectives = holding(
        CollectiveCollector,
        recent_entries=deque(window, maxlen=2048),
        pgs={pg: PgState(last_enqueued=seq, last_completed=seq) for pg, seq in last.items()},
    )
    if dims.get("pp", 1) > 1:  # a pipeline stage publishes its p2p waits at each entry (``pw``)
        collectives.p2p.waited = _p2p_waits(window, step_s)  # type: ignore[attr-defined]
    now = time.time()
    for comp in (
        holding(StepCollector, count=STEPS, total=STEPS, last_step_ts=now, durations=[step_s] * 8),
        holding(CompileCollector, fingerprint=1022026788184957),
        collectives,
        holding(GradSyncCollector, tp_samples=samples),
        # its GPU's health at its largest: throttled twice, uncorrected ECC errors, an Xid (``gh``)
        holding(
            NvmlCollector,
            up=True,
            values={"clocks": {"sm": 1.41e9}, "temperature": 87, "power": 699.6, "ecc": {"uncorrected": 12}},
        ),
        holding(
            GpuHealthCollector,
            up=True,
            gpu="7",
            values={"clock_max": {"sm": 1.98e9}, "power_limit": 700.0},
            xids={79: 3},
            last_xid=(79, now - 60),
            throttled_since={"hw_slowdown": now - 120, "sw_thermal": now - 60},
        ),
    ):
        agent.add_component(comp)
    det = DetectorsComponent(exchange=Exchange(HashStore(), "bench", 0))
    agent.add_component(det)
    rep = det.detector(ReplicaDivergence)
    assert rep is not None
    rep.sampler.plan = rep.sampler._make_plan(model)
    if tp > 1:  # the trainer's TP-sharded weights hold shard "tp=<rank>"
        rep.sampler.plan = [
            (nm, p, "tp=0" if any(s in nm for s in tp_sharded) else k) for nm, p, k in rep.sampler.plan
        ]
    for step in (10, 20, STEPS):
        rep.sampler.capture(model, step)
    parts = payload(
        det.feed.snapshot(agent.context, time.time()), det.detectors
    )  # the step collector's STEPS
    assert agent.errors == {}, agent.errors
    return json.loads(json.dumps(parts))


# ------------------------------------------------------------------------------------------ ranks
def _stage_ranks(grid: Any, rank: int) -> list[int]:
    """The old scheme's peers: every rank with this rank's pp coordinate (every rank without pp)."""
    if "pp" not in grid.names:
        return list(grid.ranks)
    axis = grid.names.index("pp")
    stride = math.prod(grid.shape[axis + 1 :])
    mine = (grid.ranks.index(rank) // stride) % grid.shape[axis]
    return [r for i, r in enumerate(grid.ranks) if (i // stride) % grid.shape[axis] == mine]


class _Rank:
    """One simulated rank: its own store client; the case's exchange, reads and what it encoded/fetched."""

    def __init__(self, port: int, rank: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        self.ex: Any = None
        self.wants: dict[str, list[int]] = {}
        self.ages: dict[str, float] = {}
        self.items: list[tuple[str, bytes]] = []
        self.raw: list[Any] = []

    def offset(self, case: dict[str, Any]) -> float:
        """This rank's delay into a phase: the agent's own (``crossrank.Cadence.offset``: its pass of the
        phase, a pass every agent interval, and its offset into that pass's window)."""
        k, off = case["cadence"].offset(self.rank)
        return k * AGENT_INTERVAL_S + off

    def phase(self, name: str, case: dict[str, Any]) -> None:
        from hpar_agent import crossrank
        from hpar_agent.crossrank import EVERY_EXCHANGE, PURPOSES, Exchange, Grid, plan

        if name == "setup":
            crossrank.COMPRESS_ABOVE = case["compress_above"]  # every rank of this process runs the case
            self.ex = Exchange(self.store, case["job"], self.rank)
            grid = Grid.row_major(LAYOUTS[case["layout"]](case["n"]))
            if case["scheme"] == "all":
                self.wants, self.ages = {"all": _stage_ranks(grid, self.rank)}, {"all": 30.0}
            else:  # the agent's own peer selection and reads
                self.wants, self.ages = plan(grid, self.rank).wants(), {p: 30.0 for p in EVERY_EXCHANGE}
        elif name == "encode" and case["scheme"] == "all":
            self.items = self.ex.encode({"all": case["merged"]}, always=("all",))
        elif name == "encode":
            self.items = self.ex.encode(case["parts"], always=PURPOSES)
        elif name == "publish":
            self.ex.send(self.items)
        elif name == "read":
            if case["scheme"] == "all":
                self.ex._seen.clear()  # the old reader checked every key at every read
            self.raw = self.ex.fetch(self.wants)
        elif name == "decode":  # one blob at a time: an all-peers read of 256 ranks is 5 MB a rank
            for item in self.raw:
                self.ex.decode([item], self.ages)
            self.raw = []


def _phases(rounds: int) -> list[str]:
    return ["setup"] + ["encode", "publish", "read", "decode"] * rounds


def _renice(nice: int) -> int:
    """Change this process's niceness by ``nice`` (raising priority needs root); the niceness now."""
    try:
        return os.nice(nice)
    except OSError:
        return os.nice(0)


def _server(port_q: Any, nice: int, stop: Any) -> None:
    """The store, alone in its process (its CPU time is the exchange's cost to the store)."""
    import torch.distributed as dist

    _renice(nice)
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    port_q.put(server.port)
    stop.wait()


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (``/proc/<pid>/stat``)."""
    if pid is None:
        raise RuntimeError("the store server's process has not started")
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(
    port: int, ranks: list[list[int]], nice: int, commands: Any, barrier: Any, start_at: Any, results: Any
) -> None:
    """One process of simulated ranks: a thread per list of ``ranks`` (a store client per rank; a
    thread's ranks go one after the other). Every phase of a case is bracketed by ``barrier`` (shared
    with the coordinator); in it, every rank starts its operation at the instant ``start_at`` (plus its
    spread offset; each thread sleeps to it: releasing hundreds of threads through one barrier would
    time Python's lock convoy rather than the store). At niceness ``nice``: the simulated ranks' own
    CPU (on their own hosts in a real job) must not take the store's."""
    import torch  # noqa: F401 - before the threads: imported once

    sims: list[_Rank] = []
    lock = threading.Lock()
    gates = [threading.Lock() for _ in ranks]
    for g in gates:
        g.acquire()
    finished = threading.Event()
    now: dict[str, Any] = {}
    state = {"left": len(ranks), "errors": 0}

    def one_done() -> None:
        with lock:
            state["left"] -= 1
            if state["left"] == 0:
                finished.set()

    def loop(mine: list[int], gate: threading.Lock) -> None:
        own = [_Rank(port, r) for r in mine]
        with lock:
            sims.extend(own)
        one_done()
        while True:
            gate.acquire()
            if not now:
                return
            timed = now["phase"] in ("publish", "read")
            for sim in sorted(own, key=lambda s: s.offset(now["case"])):
                time.sleep(max(0.0, now["at"] + (sim.offset(now["case"]) if timed else 0.0) - time.time()))
                try:
                    sim.phase(now["phase"], now["case"])
                except Exception:
                    with lock:
                        state["errors"] += 1
            one_done()

    def release() -> None:
        finished.clear()
        state["left"] = len(ranks)
        for g in gates:
            g.release()

    threads = [
        threading.Thread(target=loop, args=(r, g), daemon=True) for r, g in zip(ranks, gates, strict=True)
    ]
    for t in threads:
        t.start()
    finished.wait()  # every client connected
    _renice(nice)
    barrier.wait()
    while (case := commands.get()) is not None:
        state["errors"] = 0
        for phase in _phases(case["rounds"]):
            barrier.wait()
            now.update(phase=phase, case=case, at=start_at.value)
            release()
            finished.wait()
            barrier.wait()
        results.put(
            {
                "out": sum(s.ex.bytes_out for s in sims),
                "in": sum(s.ex.bytes_in for s in sims),
                "errors": state["errors"],
            }
        )
    now.clear()
    release()
    for t in threads:
        t.join()


def _prober(port: int, nice: int, ready: Any, stop: Any, results: Any) -> None:
    """An unrelated client: ``set`` + ``get`` of one small key every ``PROBE_EVERY_S``; (start, seconds)."""
    import torch.distributed as dist

    _renice(nice)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    out = []
    ready.set()
    while not stop.is_set():
        t = time.time()
        t0 = time.perf_counter()
        store.set("unrelated/probe", "x")
        store.get("unrelated/probe")
        out.append((t, time.perf_counter() - t0))
        time.sleep(PROBE_EVERY_S)
    results.put(out)


class Ranks:
    """N simulated ranks over ``procs`` processes, connected once, and the prober: run cases on them."""

    def __init__(self, n: int, procs: int, threads: int, nice: int, store_nice: int) -> None:
        self.n = n
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        port_q = ctx.Queue()
        self.server = ctx.Process(target=_server, args=(port_q, store_nice, self.stop), daemon=True)
        self.server.start()
        port = port_q.get(timeout=300)
        self.barrier = ctx.Barrier(procs + 1)
        self.start_at = ctx.Value("d", 0.0)
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(procs)]
        per = math.ceil(n / min(n, threads))  # ranks a thread goes through one after the other
        lists = [list(range(n))[i : i + per] for i in range(0, n, per)]
        self.concurrency = len(lists)
        self.workers = [
            ctx.Process(
                target=_worker,
                args=(port, lists[i::procs], nice, q, self.barrier, self.start_at, self.results),
                daemon=True,
            )
            for i, q in enumerate(self.commands)
        ]
        for w in self.workers:
            w.start()
        self.barrier.wait()  # every rank's client connected
        self.probes = ctx.Queue()
        ready = ctx.Event()
        self.prober = ctx.Process(
            target=_prober, args=(port, store_nice, ready, self.stop, self.probes), daemon=True
        )
        self.prober.start()
        ready.wait(300)
        self.cases: list[tuple[dict[str, Any], dict[str, list[tuple[float, float]]]]] = []
        self.job = 0

    def run(
        self, layout: str, scheme: str, rounds: int, spread: float | None = 0.0, plain: bool = False
    ) -> dict[str, Any]:
        """One case; ``spread`` None: the agent's cadence, else each phase spread over that many seconds;
        ``plain``: every blob set as plain JSON (the agent compresses those over ``COMPRESS_ABOVE``)."""
        from hpar_agent.crossrank import COMPRESS_ABOVE

        cad = pace(self.n, spread)
        parts = template_parts(layout, self.n)
        merged: dict[str, Any] = {}
        for part in parts.values():
            merged.update(part)
        self.job += 1
        case = {
            "job": f"bench{self.job}",
            "layout": layout,
            "n": self.n,
            "scheme": scheme,
            "parts": parts,
            "merged": merged,
            "rounds": rounds,
            "cadence": cad,
            "compress_above": sys.maxsize if plain else COMPRESS_ABOVE,
        }
        spans: dict[str, list[tuple[float, float]]] = {"idle": [], "publish": [], "read": [], "other": []}
        cpu = 0.0  # the store's CPU seconds in the publish and read phases
        idle_from: float | None = time.time()
        time.sleep(IDLE_S)
        for q in self.commands:
            q.put(case)
        for phase in _phases(rounds):
            timed = phase in ("publish", "read")
            self.start_at.value = time.time() + (START_LEAD_S if timed else 0.0)
            self.barrier.wait()
            c0 = _cpu_s(self.server.pid)
            t0 = max(time.time(), self.start_at.value)
            if idle_from is not None:  # the idle time up to here
                spans["idle"].append((idle_from, t0))
                idle_from = None
            self.barrier.wait()
            t1 = time.time()
            if timed:
                cpu += _cpu_s(self.server.pid) - c0
            spans[phase if phase in spans else "other"].append((t0, t1))
            if phase == "decode":
                idle_from = t1
                time.sleep(IDLE_S)
        totals = [self.results.get(timeout=300) for _ in self.workers]
        out = {
            "layout": layout,
            "ranks": self.n,
            "scheme": scheme,
            "blobs": "plain" if plain else "zlib",
            "rounds": rounds,
            "spread": _spread(cad, spread),
            "window_s": cad.window_s,
            "polls": cad.polls,
            "threads": self.concurrency,
            "out": sum(t["out"] for t in totals),
            "in": sum(t["in"] for t in totals),
            "store_cpu_s": cpu,
            "errors": sum(t["errors"] for t in totals),
        }
        self.cases.append((out, spans))
        return out

    def close(self) -> list[dict[str, Any]]:
        """Stop the processes; each case's figures with the prober's latencies, idle and during it."""
        self.stop.set()
        probes = self.probes.get(timeout=300)
        for q in self.commands:
            q.put(None)
        for p in (*self.workers, self.prober, self.server):
            p.join(60)
        return [_figures(case, spans, probes) for case, spans in self.cases]


def _figures(
    case: dict[str, Any], spans: dict[str, list[tuple[float, float]]], probes: list[tuple[float, float]]
) -> dict[str, Any]:
    def within(kind: str) -> list[float]:
        return [dt for t, dt in probes if any(a <= t <= b for a, b in spans[kind])]

    n, rounds = case["ranks"], case["rounds"]
    pub = [b - a for a, b in spans["publish"]]
    read = [b - a for a, b in spans["read"]]
    rounds_s = [a + b for a, b in zip(pub, read, strict=True)]
    during = within("publish") + within("read")
    return {
        **{k: v for k, v in case.items() if k not in ("out", "in")},
        "kb_set_per_rank": case["out"] / rounds / n / 1e3,
        "kb_got_per_rank": case["in"] / rounds / n / 1e3,
        "mb_per_round": (case["out"] + case["in"]) / rounds / 1e6,
        "store_cpu_ms_per_round": case["store_cpu_s"] / rounds * 1e3,
        "publish_s": statistics.median(pub),
        "read_s": statistics.median(read),
        "round_s": statistics.median(rounds_s),
        "round_max_s": max(rounds_s),
        "idle_ms": _stats(within("idle")),
        "during_ms": _stats(during),
    }


def codec_us(layout: str, n: int, repeats: int = 30) -> dict[str, float]:
    """What one rank's agent thread spends per exchange on the exchange's codec at the largest payloads:
    ``Exchange.encode`` of every purpose and ``Exchange.decode`` of what it reads of its comparison peers
    (``plan(...).wants()``, every peer holding the same payload), compressed as the agent sends and with
    every blob plain, side by side; the median of ``repeats`` in µs. Single-threaded, in this process."""
    from torch.distributed import HashStore

    from hpar_agent import crossrank
    from hpar_agent.crossrank import PURPOSES, Exchange, Grid, plan

    parts = template_parts(layout, n)
    wants = plan(Grid.row_major(LAYOUTS[layout](n)), 0).wants()
    readers = sorted({r for ranks in wants.values() for r in ranks})
    out: dict[str, float] = {}
    saved = crossrank.COMPRESS_ABOVE
    try:
        for suffix, above in (("", saved), ("_plain", sys.maxsize)):
            crossrank.COMPRESS_ABOVE = above
            store = HashStore()
            for r in readers:
                Exchange(store, "codec", r).publish(parts)
            me = Exchange(store, "codec", 0)
            raw = me.fetch(wants)
            enc, dec = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                me.encode(parts, always=PURPOSES)
                t1 = time.perf_counter()
                me.decode(raw)
                dec.append(time.perf_counter() - t1)
                enc.append(t1 - t0)
            out[f"encode{suffix}_us"] = statistics.median(enc) * 1e6
            out[f"decode{suffix}_us"] = statistics.median(dec) * 1e6
    finally:
        crossrank.COMPRESS_ABOVE = saved
    return out


def pace(n: int, spread: float | None) -> Any:
    """The ``crossrank.Cadence`` the ranks follow: the agent's for ``n`` ranks (``spread`` None), else
    one window of ``spread`` seconds."""
    from hpar_agent.crossrank import Cadence, cadence
    from hpar_agent.thresholds import COMPONENT_DEFAULTS

    if spread is None:
        return cadence(n, COMPONENT_DEFAULTS["exchange_s"], AGENT_INTERVAL_S)
    return Cadence(spread, 1, 1, COMPONENT_DEFAULTS["exchange_s"])


def _spread(cad: Any, spread: float | None) -> str:
    """How a case spread its phases, as the table prints it."""
    window = f"{cad.window_s:g}" + (f" x {cad.polls} passes" if cad.polls > 1 else "")
    return f"agent: {window}" if spread is None else window


def _stats(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "median": statistics.median(v) * 1e3,
        "p99": v[min(len(v) - 1, int(0.99 * len(v)))] * 1e3,
        "max": v[-1] * 1e3,
    }


def _row(r: dict[str, Any]) -> str:
    i, d = r["idle_ms"], r["during_ms"]
    ranks = f"{r['ranks']:,}" + (f" ({r['threads']:,} threads)" if r["threads"] < r["ranks"] else "")
    return (
        f"| {ranks} | {r['layout']} | {r['scheme']} | {r['blobs']} | {r['spread']} "
        f"| {r['kb_set_per_rank']:.1f} | {r['kb_got_per_rank']:.1f} "
        f"| {r['mb_per_round']:.1f} | {r['store_cpu_ms_per_round']:.0f} "
        f"| {r['round_s']:.3f} ({r['publish_s']:.3f} + {r['read_s']:.3f}) "
        f"| {i.get('median', math.nan):.2f} / {i.get('p99', math.nan):.2f} "
        f"| {d.get('median', math.nan):.2f} / {d.get('p99', math.nan):.2f} / {d.get('max', math.nan):.1f} |"
    )


def _spread_arg(text: str) -> float | None:
    return None if text == "agent" else float(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--scheme", choices=("peers", "all", "both"), default="both")
    ap.add_argument("--all-max", type=int, default=256, help="largest N the old all-peers scheme runs at")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--procs", type=int, default=2, help="worker processes the simulated ranks are spread over"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1024,
        help="threads at most over all processes; past it a thread goes through several ranks in turn",
    )
    ap.add_argument(
        "--spread",
        type=_spread_arg,
        nargs="+",
        default=[None],
        metavar="S|agent",
        help="seconds over which the ranks' store operations of a phase are spread (by rank), or "
        "'agent' (the default): the agent's own cadence; the old scheme never spreads",
    )
    ap.add_argument("--nice", type=int, default=19, help="niceness of the simulated ranks' processes")
    ap.add_argument(
        "--store-nice",
        type=int,
        default=-10,
        help="niceness of the store's and the prober's processes (below 0 needs root)",
    )
    ap.add_argument(
        "--plain", action="store_true", help="also run each case with every blob plain JSON, side by side"
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    # The store's server looks up each client's name as it accepts it; on a host whose DNS does not
    # answer, every ~25th lookup stalls the accept loop for the resolver's 5 s timeout (~2 minutes to
    # connect 1,024 ranks). Our processes only: 1 s, one attempt.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per simulated rank on the server
    schemes = ("peers", "all") if args.scheme == "both" else (args.scheme,)
    print(f"# store_load: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    if None in args.spread and "peers" in schemes:
        for n in args.ranks:
            cad = pace(n, None)
            print(
                f"# {n:,} ranks, the agent's cadence: window {cad.window_s:g} s per pass over {cad.polls} "
                f"pass(es), an exchange every {cad.interval_s:g} s",
                flush=True,
            )
    print(
        "| ranks | layout | scheme | blobs | spread s per pass | KB set / rank | KB got / rank | MB / round | store CPU ms / round "
        "| round s (publish + read) | unrelated idle ms (median / p99) | during (median / p99 / max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    if "peers" in schemes:
        for n in args.ranks:
            for layout in args.layouts:
                c = codec_us(layout, n)
                print(
                    f"# {n:,} ranks, {layout}: a rank's agent thread per exchange, encode + decode "
                    f"{c['encode_us']:.0f} + {c['decode_us']:.0f} us compressed, "
                    f"{c['encode_plain_us']:.0f} + {c['decode_plain_us']:.0f} us plain",
                    flush=True,
                )
    out = []
    for n in args.ranks:
        ranks = Ranks(n, args.procs, args.threads, args.nice, args.store_nice)
        for layout in args.layouts:
            for scheme in schemes:
                if scheme == "all" and n > args.all_max:
                    continue
                for spread in args.spread if scheme == "peers" else [0.0]:
                    for plain in (False, True) if args.plain else (False,):
                        ranks.run(layout, scheme, args.rounds, spread, plain)
        for r in ranks.close():
            out.append(r)
            print(_row(r), flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at the end", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 1 if any(r["errors"] for r in out) else 0


if __name__ == "__main__":
    sys.exit(main())
