"""Straggler at scale: many ranks' flight-recorder timelines, pass after pass, judged by the real detector.

The job runs ``steps`` of a synthetic program on one consistent timeline (numpy, all ranks at once):
per step a forward of 4 compute segments, each ending in a tp all-reduce that blocks its tp group
(with tp), then a backward whose ``buckets`` gradient all-reduces on the dp group are enqueued as
their gradients are ready, without waiting (DDP); the step ends for every rank when the last bucket's
reduction completes, plus the optimizer. With ``pp`` stages (dp x pp) a replica's forward goes
through its stages in turn and its backward back (each stage waits for its neighbour's activations
or gradients, p2p, which the flight recorder does not show: each rank publishes the time it waited
in p2p by each of its entries, ``pw``, as the agent's pipelining wrapper times it), each stage's
buckets over its own backward; ``stage_work`` makes a stage slower by design. A pure pipeline (``dp`` 1):
no collectives; each stage's step ends after its own backward and optimizer, and its waits for
activations and gradients are counted from its previous step's end; each rank publishes its own work
a step (``pwork``, from its ``Straggler.publish``). A rank's compute is its ``factor`` (a slow GPU: 1.5) x a
fixed per-GPU speed (``gpu_sigma``) x per-segment noise (lognormal ``sigma``, with ``spike_p`` spikes
of ``spike`` x). Every ``steps_per_pass`` steps an exchange: each rank's last ``window`` entries are
what its peers read (``crossrank.plan``), and each judged rank's own ``Straggler`` (kept from pass to
pass, its step hook fed its step ends) evaluates. The store and the exchange's timing are left out
(``benchmarks/store_load.py`` measures those).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpar_agent.collectors.pipeline_p2p import waited_by
from hpar_agent.crossrank import Grid, plan
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import StepTick, Verdict
from hpar_agent.detectors.cluster import Straggler
from hpar_agent.detectors.feed import WINDOW_STEPS
from hpar_agent.detectors.snapshot import CompileWarmup, PeerView, Snapshot
from hpar_agent.topology import Topology

T0_NS = 1_796_000_000_000_000_000
FORWARD_S = 0.1  # the step's forward, in 4 segments
BACKWARD_S = 0.2  # its backward, in ``buckets`` segments
OPTIMIZER_S = 0.005
COMM_S = 0.002


@dataclass
class Noise:
    sigma: float = 0.0  # lognormal sigma of every compute segment
    spike_p: float = 0.0  # chance a segment takes ``spike`` x as long
    spike: float = 5.0
    gpu_sigma: float = 0.0  # lognormal sigma of each GPU's fixed speed


MILD = Noise(0.02)
HEAVY = Noise(0.3, 0.01, 5.0)
HEAVY_GPUS = Noise(0.3, 0.01, 5.0, 0.05)


@dataclass
class Job:
    dp: int
    tp: int = 1
    buckets: int = 1
    noise: Noise = field(default_factory=Noise)
    slow: Mapping[int, float] = field(default_factory=dict)  # rank -> compute factor (1.5: 1.5x slower)
    pp: int = 1  # pipeline stages (dp x pp, pp innermost): one microbatch through the stages
    stage_work: Mapping[int, float] = field(default_factory=dict)  # stage -> its compute by design (1.3)
    slow_from: int = 0  # the step from which ``slow`` applies
    microbatches: int = 1  # a pure pipeline's (dp 1) microbatches a step
    window: int = 256  # flight-recorder entries each rank publishes (at least; ``StragglerSim.window``)
    steps_per_pass: int = 10  # 0.3 s steps, an exchange every 3 s
    seed: int = 0

    @property
    def n(self) -> int:
        return self.dp * self.tp * self.pp


class StragglerSim:
    """The job's timeline and each judged rank's detector (``judged``: all ranks when None; ``cover``
    gives the ranks that matter for a fault and a clean sample)."""

    def __init__(self, job: Job, judged: Collection[int] | None = None, **thresholds: float) -> None:
        self.job = job
        self.grid = Grid.row_major(_dims(job))
        self.rng = np.random.default_rng(job.seed)
        n = job.n
        self.speed = (
            np.exp(self.rng.normal(0.0, job.noise.gpu_sigma, n)) if job.noise.gpu_sigma else np.ones(n)
        )
        if not job.slow_from:
            self._slow_down()
        for r in range(n):
            self.speed[r] *= job.stage_work.get(r % job.pp, 1.0)
        self.coords = [self._coords(r) for r in range(n)]
        self.ops = (4 if job.tp > 1 else 0) + job.buckets  # collectives a step
        # the feed's window: ``window`` entries, more to span 3 steps (``sources.FrWindow``)
        self.window = min(src.WIDEST * job.window, max(job.window, WINDOW_STEPS * self.ops + 1))
        self.keep = self.window // self.ops + 2  # steps whose entries a window can hold
        self.times: list[np.ndarray] = []  # per step: (ops, ranks) enqueue ns
        #: per step with pp: (4, ranks): the exits of its two p2p waits and the ns waited by each
        self.waits: list[np.ndarray] = []
        self.waited = np.zeros(n, dtype=np.int64)  # ns each rank waited in p2p so far
        self.ends: list[int] = []  # step end ns (every rank's step hook)
        #: a pure pipeline's step end ns of each rank (each stage's own), the last step's first
        self.rank_ends = np.full(n, T0_NS, dtype=np.int64)
        self.step = 0
        self.now_ns = T0_NS
        ranks = range(n) if judged is None else judged
        params = {f"Straggler.{k}": v for k, v in thresholds.items()}
        self.detectors = {r: Straggler(params) for r in ranks}
        self.plans = {r: plan(self.grid, r) for r in ranks}
        self.verdicts: dict[int, Verdict] = {}
        self.uids = [self._uids(r) for r in range(n)]

    @property
    def pure(self) -> bool:
        """A pure pipeline: stages only, no collective."""
        return self.job.pp > 1 and self.job.dp == 1 and self.job.tp == 1

    def _slow_down(self) -> None:
        for r, f in self.job.slow.items():
            self.speed[r] *= f

    def _coords(self, r: int) -> dict[str, int]:
        if self.job.pp > 1:
            dp, pp = divmod(r, self.job.pp)
            return {"dp_replicate": dp, "dp_shard": 0, "cp": 0, "tp": 0, "pp": pp}
        dp, tp = divmod(r, self.job.tp)
        return {"dp_replicate": dp, "dp_shard": 0, "cp": 0, "tp": tp, "pp": 0}

    def _uids(self, r: int) -> list[str]:
        tp = [src.group_key_of("tp", self.coords[r])] * (4 if self.job.tp > 1 else 0)
        return tp + [src.group_key_of("dp", self.coords[r])] * self.job.buckets

    def _compute(self, seconds: float) -> np.ndarray:
        """One segment's compute ns on every rank."""
        nz = self.job.noise
        t = seconds * self.speed
        if nz.sigma:
            t = t * np.exp(self.rng.normal(0.0, nz.sigma, t.shape))
        if nz.spike_p:
            t = np.where(self.rng.random(t.shape) < nz.spike_p, t * nz.spike, t)
        return (t * 1e9).astype(np.int64)

    def run_step(self) -> None:
        job = self.job
        if job.slow_from and self.step == job.slow_from:
            self._slow_down()
        if self.pure:
            self._pure_step()
            return
        start = self.now_ns
        cursor = np.full(job.n, start, dtype=np.int64)
        rows = []
        if job.pp > 1:  # forward through the stages, then backward back: each waits for its neighbour
            own = self._compute(FORWARD_S).reshape(job.dp, job.pp)
            at = np.full(job.dp, start, dtype=np.int64)
            begun = np.zeros((job.dp, job.pp), dtype=np.int64)  # when each stage's activations came
            for st in range(job.pp):
                begun[:, st] = at
                at = at + own[:, st] + int(COMM_S * 1e9)
            grads = self._compute(BACKWARD_S).reshape(job.dp, job.pp)
            ready = np.zeros((job.dp, job.pp), dtype=np.int64)  # when each stage may start its backward
            for st in reversed(range(job.pp)):
                ready[:, st] = at
                at = at + grads[:, st] + int(COMM_S * 1e9)
            cursor = ready.reshape(-1)
            fwd_done = (begun + own).reshape(-1)
            first = self.waited + (begun.reshape(-1) - start)  # waited for the activations
            self.waited = first + np.maximum(0, cursor - fwd_done)  # ... and for the gradients
            self.waits.append(np.stack([begun.reshape(-1), first, cursor, self.waited]))
            for _ in range(job.buckets):  # the stage's buckets over its backward
                cursor = cursor + (grads.reshape(-1) // job.buckets)
                rows.append(cursor)
            self._close_step(rows, cursor)
            return
        if job.tp > 1:
            for _ in range(4):
                at = cursor + self._compute(FORWARD_S / 4)
                rows.append(at)
                done = at.reshape(job.dp, job.tp).max(axis=1)  # the tp all-reduce blocks its group
                cursor = np.repeat(done, job.tp) + int(COMM_S * 1e9)
        else:
            cursor = cursor + self._compute(FORWARD_S)
        for _ in range(job.buckets):  # async: each bucket enqueued when its gradients are ready
            cursor = cursor + self._compute(BACKWARD_S / job.buckets)
            rows.append(cursor)
        self._close_step(rows, cursor)

    def _pure_step(self) -> None:
        """One GPipe step of a pure pipeline over ``microbatches``: every forward, then every backward.
        A stage runs a microbatch's forward once its activations have come (stage 0: at once) and it is
        done with its previous work (its last step, for the first), the last stage each backward after
        its forwards, the others once the gradients have come; a stage's step ends after its last
        backward and the optimizer. Its waits for activations and gradients are logged as the
        pipelining wrapper times them: (exit ns, ns waited so far)."""
        n, m, comm = self.job.n, self.job.microbatches, int(COMM_S * 1e9)
        fwd = (self._compute(FORWARD_S) // m).tolist()
        bwd = (self._compute(BACKWARD_S) // m).tolist()
        free = [int(t) for t in self.rank_ends]  # when each stage is done with its previous work
        waited = [int(w) for w in self.waited]
        log: list[list[int]] = [[] for _ in range(n)]

        def run(st: int, come: int | None, work: int) -> int:
            if come is not None and come > free[st]:  # it waits for its neighbour
                waited[st] += come - free[st]
                log[st] += [come, waited[st]]
                free[st] = come
            free[st] += work
            return free[st]

        for _ in range(m):
            done = None
            for st in range(n):
                done = run(st, None if done is None else done + comm, fwd[st])
        for _ in range(m):
            done = None
            for st in reversed(range(n)):
                done = run(st, None if done is None else done + comm, bwd[st])
        width = max(len(x) for x in log)
        rows = np.array([x + x[-2:] * ((width - len(x)) // 2) if x else [0, 0] * (width // 2) for x in log])
        self.waits.append(rows.T)
        if len(self.waits) > self.job.steps_per_pass + 2:  # what a publish reads: the steps since the last
            self.waits.pop(0)
        self.waited = np.array(waited, dtype=np.int64)
        self.rank_ends = np.array(free, dtype=np.int64) + int(OPTIMIZER_S * 1e9)
        self.ends.append(int(self.rank_ends.max()))
        self.now_ns = int(self.rank_ends.max())
        self.step += 1

    def _close_step(self, rows: list[np.ndarray], cursor: np.ndarray) -> None:
        end = int(cursor.max()) + int((COMM_S + OPTIMIZER_S) * 1e9)
        self.times.append(np.stack(rows))
        self.ends.append(end)
        if len(self.times) > self.keep:
            self.times.pop(0)
        if len(self.waits) > self.keep:
            self.waits.pop(0)
        self.now_ns = end
        self.step += 1

    def entries(self, r: int) -> list[sig.FrEntry]:
        """Rank ``r``'s last ``window`` flight-recorder entries."""
        out: list[sig.FrEntry] = []
        first = self.step - len(self.times)
        tp_ops = 4 if self.job.tp > 1 else 0
        for i, rows in enumerate(self.times):
            s = first + i
            for j, uid in enumerate(self.uids[r]):
                seq = s * tp_ops + j if j < tp_ops else s * self.job.buckets + (j - tp_ops)
                out.append((uid, seq, "all_reduce", "[[1024]]", "Float", int(rows[j, r])))
        return out[-self.window :]

    def exchange(self) -> dict[int, Verdict]:
        """Every judged rank's verdict on its peers' windows now."""
        cache: dict[int, dict[str, Any]] = {}

        def payload(q: int) -> dict[str, Any]:
            if q not in cache:
                c = self.coords[q]
                cache[q] = {"c": {**c, "dp": c["dp_replicate"], "stage": c["pp"]}}
                log = [(int(w[i, q]), int(w[i + 1, q])) for w in self.waits for i in range(0, len(w), 2)]
                log = [x for x in log if x[0]]  # a stage that did not wait
                if self.pure:  # its own work a step, as its detector publishes it in ``s``
                    det = self.detectors.get(q)
                    state = src.NO_COLLECTIVES._replace(p2p_waited=log)
                    own = det.publish(self._snapshot(q, {}, state)) if det is not None else {}
                    cache[q].update(own.get("s", {}))
                    return cache[q]
                fr = self.entries(q)
                cache[q]["fr"] = fr
                if self.waits:
                    cache[q]["pw"] = sig.pack_totals(waited_by(log, [e[5] for e in fr]))  # as published
            return cache[q]

        out = {}
        for r, det in self.detectors.items():
            peers = {q: payload(q) for q in (*self.plans[r].peers, r)}
            for q in self.plans[r].world:  # read for their ``s`` alone
                peers.setdefault(q, {k: v for k, v in payload(q).items() if k not in ("fr", "pw")})
            snap = self._snapshot(r, peers)
            v = det.evaluate(snap)
            if v is not None:
                out[r] = v
        self.verdicts = out
        return out

    def _snapshot(
        self, r: int, peers: dict[int, dict[str, Any]], collectives: src.CollectiveState = src.NO_COLLECTIVES
    ) -> Snapshot:
        c = self.coords[r]
        topo = Topology(
            rank=r,
            world_size=self.job.n,
            job_id="sim",
            dp=self.job.dp,
            tp=self.job.tp,
            dp_rank=c["dp_replicate"],
            dp_replicate=self.job.dp,
            tp_rank=c["tp"],
            pp=self.job.pp,
            pp_stage=c["pp"],
        )
        view = PeerView(peers=peers, fresh=True, seen=peers, groups=self.plans[r].groups)
        return Snapshot(
            now=self.now_ns / 1e9,
            topology=topo,
            coords=c,
            steps_done=self.step,
            warmup=CompileWarmup(quiet_steps=self.step),
            collectives=collectives,
            exchange=view,
        )

    def run(self, passes: int, fill: bool = True) -> list[dict[int, Verdict]]:
        """``passes`` exchanges (the first after a window's worth of steps with ``fill``, else as a job
        that just started: after ``steps_per_pass``); each judged rank's step hook sees every step end."""
        out = []
        for p in range(passes):
            for _ in range(self.keep if p == 0 and fill else self.job.steps_per_pass):
                self.run_step()
                for r, det in self.detectors.items():
                    end = int(self.rank_ends[r]) if self.pure else self.ends[-1]
                    det.step_hook(StepTick(self.step - 1, end, None, self.job.n))
            out.append(self.exchange())
        return out


def fired(history: list[dict[int, Verdict]], confirm: int = 2) -> set[int]:
    """Ranks whose verdict was active on ``confirm`` consecutive passes (the alert fires there)."""
    out: set[int] = set()
    streak: dict[int, int] = {}
    for verdicts in history:
        for r in list(streak):
            if not (r in verdicts and verdicts[r].active):
                streak.pop(r)
        for r, v in verdicts.items():
            if v.active:
                streak[r] = streak.get(r, 0) + 1
                if streak[r] >= confirm:
                    out.add(r)
    return out


def named(history: list[dict[int, Verdict]]) -> set[int]:
    """Every rank some active verdict named as a culprit, in any pass."""
    return {c for vs in history for v in vs.values() if v.active for c in v.details.get("culprits") or ()}


def first_fired_pass(history: list[dict[int, Verdict]], rank: int, confirm: int = 2) -> int | None:
    streak = 0
    for i, verdicts in enumerate(history):
        v = verdicts.get(rank)
        streak = streak + 1 if v is not None and v.active else 0
        if streak >= confirm:
            return i
    return None


def readers(grid: Grid, ranks: Collection[int]) -> set[int]:
    """The ranks that read any of ``ranks`` (comparison plans are symmetric), and those ranks."""
    out = set(ranks)
    for r in ranks:
        out.update(plan(grid, r).peers)
    return out


def cover(job: Job, sample: int = 48) -> set[int]:
    """The ranks to judge for exact culprit sets at a fraction of the cost: every rank whose view holds
    a slow rank (only there is a median shifted, or a slow rank named), and ``sample`` ranks spread
    over the job whose views are clean (every other view is like one of them)."""
    grid = Grid.row_major(_dims(job))
    return readers(grid, job.slow) | set(range(0, job.n, max(1, job.n // sample)))


def score(verdicts: Mapping[int, Verdict], rank: int) -> float:
    v = verdicts.get(rank)
    return math.nan if v is None else v.value


def _dims(job: Job) -> list[tuple[str, int]]:
    if job.pp > 1:
        return [("dp", job.dp), ("pp", job.pp)]
    return [("dp", job.dp), ("tp", job.tp)] if job.tp > 1 else [("dp", job.dp)]
