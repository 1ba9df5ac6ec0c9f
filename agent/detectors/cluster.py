"""Cross-rank detectors: each rank publishes a small payload to the store, reads its peers' and raises
the alert only where it is itself the offender (attributed by majority), so ``hpar_alert_active`` is 1
on the offending rank's own series and no rank has to be a coordinator that could itself be stuck."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import pairwise
from statistics import median
from typing import TYPE_CHECKING, Any

from hpar_agent import gil
from hpar_agent.buffer import BoundedBuffer
from hpar_agent.collectors.pipeline_p2p import waited_by
from hpar_agent.context import Conclusion
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import Detector, FeedNeeds, StepTick, Verdict
from hpar_agent.samples import copy_to_host, sample_cat, segment_sums, strided
from hpar_agent.torch_compat import parallel

if TYPE_CHECKING:
    from hpar_agent.detectors.snapshot import Snapshot


class CompileDivergence(Detector):
    """Ranks of one pipeline stage that compiled different graphs (rank-dependent code, config drift).

    A rank publishes its fingerprint only once its compile activity has settled (a rank mid-compile,
    or a moment after, publishes none), and the exchange carries a newly settled one once
    ``exchange_min_s`` passed since the last publish (the peers read it a poll later) rather than at
    the next 3 s slot. Judged once every comparison peer has published (with two of four
    known, a clean rank and the odd one would split 1-1 and both be named). Confirmed on two consecutive
    exchanges.

    Where this rank read every rank of its stage (a job of up to 8 ranks reads every rank), the
    stage's clear majority decides (``signals.outvoted``: 3-1 of dp2 x tp2). Else compared with this
    rank's comparison peers (``crossrank.plan``: every member of a small group, four of a large one,
    per mesh dim), one dim at a time: the culprits are the ranks off a clear majority of this rank and
    its peers along one dim, never the minority of all compared together (a node whose tp group compiled alike would outvote its healthy dp peers:
    along tp the node agrees, along dp each of its ranks is outvoted 4 to 1). Where the values split
    with no clear majority (1-1, 3-2: half the job compiled differently) no culprit is named and
    ``culprit_unknown`` and ``split`` say so; the alert is raised on the ranks of the split. The stage
    as a whole is the Prometheus rule's (``job_pp_stage:hpar_dynamo_graph_fingerprint:distinct``).
    Value: compared ranks whose fingerprint differs from ours.
    """

    name = "CompileDivergence"
    threshold_param = "warmup_steps"
    cross_rank = True
    confirm = 2

    def settled_fingerprint(self, snap: Snapshot) -> int | None:
        if snap.warmup.quiet_s < self.p("settle_s") or snap.compile is None:
            return None
        return snap.compile.fingerprint

    def change_token(self, snap: Snapshot) -> int | None:
        return self.settled_fingerprint(snap)  # a newly settled fingerprint goes out before the next slot

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        fp = self.settled_fingerprint(snap)
        return {} if fp is None else {"s": {"fp": fp}}

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        if not snap.exchange.fresh:
            return None
        rank = snap.rank
        stage = {
            r: p["fp"]
            for r, p in snap.exchange.peers.items()
            if "fp" in p
            and p.get("c", {}).get("stage") == snap.stage
            and p.get("step", 0) >= self.p("warmup_steps")
        }
        groups = snap.exchange.groups
        compared = {rank}.union(*groups.values())
        if rank not in stage or len(compared) < 2 or not compared <= set(stage):
            return None  # every peer's fingerprint first: with some missing, a 1-1 split blames a clean rank
        topo = snap.topology
        if len(stage) >= topo.world_size // max(topo.pp, 1):  # every rank of the stage read (up to 8 ranks)
            shown, verdicts = stage, {"stage": sig.culprits_of(stage)}
        else:
            shown = {r: stage[r] for r in compared}
            verdicts = {
                dim: sig.culprits_of({r: stage[r] for r in (rank, *group)})
                for dim, group in sorted(groups.items())
            }
        culprits: set[int] = set()
        unknown: list[str] = []
        splits: dict[str, list[list[int]]] = {}
        odd = False
        for dim, verdict in verdicts.items():
            culprits.update(verdict["culprits"])
            odd = odd or rank in verdict["culprits"]
            if "split" in verdict:
                odd = True  # a split with no majority on this rank's own dim: reported, culprit unknown
                unknown.append(f"{dim}: {verdict['culprit_unknown']}")
                splits[dim] = verdict["split"]
        differ = sum(1 for v in shown.values() if v != stage[rank])
        details: dict[str, Any] = {
            "fingerprints": {str(r): v for r, v in sorted(shown.items())},
            "culprits": sorted(culprits),
        }
        if unknown:
            details["culprit_unknown"] = "; ".join(unknown)
            details["split"] = splits
        return Verdict(odd, float(differ), details, threshold=0.0)  # fires on any differing fingerprint


class ChecksumSampler:
    """A fixed strided sample of every parameter, copied off the device without synchronizing.

    Training thread (every ``every`` steps, after the optimizer step): slice ``per_param`` elements of
    each parameter, ``cat`` them, and on CUDA start a non_blocking copy into pinned memory plus an event.
    Agent thread: once the event completes, sum and abs-sum each parameter's sample in float64.
    """

    def __init__(self, per_param: int = 16, max_params: int = 1024) -> None:
        self.per_param = per_param
        self.max_params = max_params
        self.plan: list[tuple[str, Any, str]] | None = None  # (name, param, shard key)
        self.buffer: BoundedBuffer[tuple[int, list[str], list[int], Any, Any]] = BoundedBuffer("checksums", 8)
        self.pending: list[tuple[int, list[str], list[int], Any, Any]] = []
        self.param_bits = 32

    def _make_plan(self, model: Any) -> list[tuple[str, Any, str]]:
        bits = []
        plan = []
        for name, p in list(model.named_parameters())[: self.max_params]:
            plan.append((name, p, shard_key(p)))
            if p.is_floating_point():
                bits.append(p.element_size() * 8)
        self.param_bits = max(bits, default=32)
        return plan

    def capture(self, model: Any, step: int) -> None:
        import torch

        if self.plan is None:
            self.plan = self._make_plan(model)
        if not self.plan:
            return
        parts, names, sizes = [], [], []
        with torch.no_grad():  # no detach: views made under no_grad track nothing (a DTensor's cost ~30 µs)
            for name, p, _ in self.plan:
                part = strided(p.to_local() if hasattr(p, "to_local") else p, self.per_param)
                parts.append(part)
                names.append(name)
                sizes.append(part.numel())
            cat, event = copy_to_host(sample_cat(parts))
        self.buffer.put((step, names, sizes, cat, event))

    def resolve(self) -> list[tuple[int, dict[str, list[float]]]]:
        """Agent thread: checksums of every capture whose copy completed (never waits)."""
        out = []
        items, self.pending = self.pending + self.buffer.drain(), []
        for item in items:
            step, names, sizes, host, event = item
            if event is not None and not event.query():
                self.pending.append(item)
                continue
            out.append((step, dict(zip(names, segment_sums(host, sizes, with_abs=True), strict=True))))
        return out

    def replicated(self) -> list[str]:
        """Parameters held whole (plain tensors, or DTensors Replicate on every mesh dim)."""
        return [n for n, _, key in self.plan or () if not key]

    def shard_keys(self) -> dict[str, str]:
        """name -> shard key, for the sharded parameters only."""
        return {n: key for n, _, key in self.plan or () if key}


def shard_key(p: Any) -> str:
    """Which piece of the parameter this rank holds: ``dim=coordinate`` for every mesh dim its DTensor
    placement is not Replicate on (TP ``Shard``, FSDP ``Shard(0)`` on dp_shard), "" for a whole one.
    Two ranks hold copies of the same values exactly when their keys are equal (and both sync)."""
    placements = getattr(p, "placements", None)
    mesh = getattr(p, "device_mesh", None)
    if placements is None or mesh is None:
        return ""
    names = mesh.mesh_dim_names or ()
    parts = []
    for i, pl in enumerate(placements):
        if type(pl).__name__ != "Replicate":
            parts.append(f"{names[i] if i < len(names) else i}={mesh.get_local_rank(i)}")
    return ",".join(parts)


class ReplicaDivergence(Detector):
    """Parameters that must be identical across replicas are not (DDP coverage/nesting errors, TP
    gradients of replicated parameters not reduced, an HSDP replica that missed the replicate all-reduce).

    Compared at the latest step every member checksummed, within the dp group (same tp/pp) and the tp
    group (same dp/pp), and there only among ranks holding the same piece of a parameter: equal shard
    keys (see ``shard_key``). Replicated parameters are compared across the whole group; TP shards across
    dp replicas; FSDP shards (``Shard(0)`` on dp_shard) only with the same shard across dp_replicate (HSDP),
    never shard against shard. The groups are this rank's comparison peers (``crossrank.plan``).

    Each rank publishes a digest of its checksums per shard key in its small ``s`` blob; the checksums by
    name (``ck``, ~0.2 KB a parameter) are fetched from a group only when the group's digests disagree,
    so a run in sync reads none. Value: parameters whose checksum differs from the majority on this rank.
    """

    name = "ReplicaDivergence"
    gpu_culprits = True
    threshold_param = "every_steps"
    cross_rank = True

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.sampler = ChecksumSampler(int(self.p("per_param")))
        self.history: deque[tuple[int, dict[str, list[float]]]] = deque(maxlen=3)
        self._digests: dict[int, dict[str, str]] = {}  # step -> its digests (a step's checksums never change)
        self._judged: dict[str, tuple[Any, ...]] = {}  # group label -> (step, members, offending params)

    def step_hook(self, tick: StepTick) -> None:
        every = int(self.p("every_steps"))
        if tick.world_size > 1 and tick.model is not None and tick.step > 0 and tick.step % every == 0:
            self.sampler.capture(tick.model, tick.step)

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        self.history.extend(self.sampler.resolve())
        if not self.history:
            return {}
        keys = self.sampler.shard_keys()
        self._digests = {s: self._digests.get(s) or sig.checksum_digests(v, keys) for s, v in self.history}
        return {
            "s": {"cd": {str(s): d for s, d in self._digests.items()}},
            "ck": {"cks": {str(s): v for s, v in self.history}, "sk": keys},
        }

    def _compare(
        self, snap: Snapshot, label: str, group: list[int]
    ) -> tuple[int, dict[int, list[str]], list[int]]:
        """(step compared, member -> its offending parameters, the members of a split with no majority)
        at the latest step every member digested; the checksums by name only when the digests disagree
        (once per step and group)."""
        peers = snap.exchange.peers
        steps = set.intersection(*(set(peers[r]["cd"]) for r in group))
        if not steps:
            return -1, {}, []
        step = max(steps, key=int)
        if sig.digests_agree({r: peers[r]["cd"][step] for r in group}):
            return int(step), {}, []
        memo = self._judged.get(label)
        if memo is not None and memo[:2] == (step, group):
            return int(step), memo[2], memo[3]
        full = snap.exchange.fetch("ck", group)
        if any(step not in full.get(r, {}).get("cks", {}) for r in group):
            return -1, {}, []  # a member's checksums moved on (or are missing): the next exchange judges
        sums = {r: full[r]["cks"][step] for r in group}
        keys = {r: full[r].get("sk", {}) for r in group}
        diff = {r: d for r in group if (d := sig.same_shard_offenders(sums, keys, r))}
        split = sorted({m for r in diff for m in sig.unsplittable(sums, keys, r)})
        self._judged[label] = (step, group, diff, split)
        return int(step), diff, split

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        if not snap.exchange.fresh:
            return None
        bad: dict[str, Any] = {}
        culprits: set[int] = set()
        unknown: list[str] = []
        compared = False
        for label, keys in (("dp", sig.DP_KEYS), ("tp", sig.TP_KEYS)):
            group = sig.group_of(snap.exchange.peers, snap.rank, keys, "cd")
            if len(group) < 2:
                continue
            step, by_rank, split = self._compare(snap, label, group)
            compared = compared or step >= 0
            if split:  # holders of one piece split with no clear majority (1-1, 3-2): who is wrong is unknown
                parts = sig.sides({r: str(snap.exchange.peers[r]["cd"].get(str(step))) for r in split})
                unknown.append(
                    f"{label} group {group}: culprit unknown: no majority holds the same values, split "
                    f"{'-'.join(str(len(p)) for p in parts)} among ranks {parts}"
                )
            culprits.update(r for r in by_rank if r not in split)
            diff = by_rank.get(snap.rank, [])
            if diff:
                bad[label] = {"step": step, "ranks": group, "params": diff[:8], "count": len(diff)}
        if not compared:
            return None
        details: dict[str, Any] = {**bad, "culprits": sorted(culprits)}
        if unknown:
            details["culprit_unknown"] = unknown
        return Verdict(bool(bad), float(sum(b["count"] for b in bad.values())), details, threshold=0.0)


def _grad_pgs(snap: Snapshot, entries: Sequence[sig.FrEntry]) -> list[str]:
    """pg uids that carry gradient reductions: the dp groups (the default group when dp is the world)."""
    topo = snap.topology
    out = []
    for uid in {e[0] for e in entries}:
        low = src.pg_label(uid).lower()
        if "dp" in low or "replicate" in low or (low == "default_pg" and topo.tp == 1 and topo.pp == 1):
            out.append(uid)
    return out


def _param_bits(model: Any) -> int | None:
    """Widest floating parameter dtype of the model in bits (metadata only; None without a model)."""
    try:
        bits = [p.element_size() * 8 for p in model.parameters() if p.is_floating_point()]
    except (AttributeError, TypeError):
        return None
    return max(bits, default=None)


_COMPRESS_HOOKS = {
    "bf16_compress_hook": 16,
    "fp16_compress_hook": 16,
    "bf16_compress_wrapper_hook": 16,
    "fp16_compress_wrapper_hook": 16,
}


def intended_reduce_bits(model: Any) -> set[int]:
    """Reduction widths the model declares on purpose: FSDP2's MixedPrecisionPolicy reduce dtype (its
    param dtype when unset) and torch's DDP fp16/bf16 compress hooks. Read once, from metadata only."""
    import torch

    out: set[int] = set()
    try:
        modules = list(model.modules())
    except (AttributeError, TypeError):
        return out
    for m in modules:
        mp = parallel.fsdp_mixed_precision(m)  # FSDPModule
        if mp is not None:
            try:
                dtype = mp.reduce_dtype or mp.param_dtype
                if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                    out.add(torch.finfo(dtype).bits)
            except Exception:
                pass
        for hook in parallel.ddp_comm_hooks(m):  # DistributedDataParallel
            bits = _COMPRESS_HOOKS.get(getattr(hook, "__name__", ""))
            if bits:
                out.add(bits)
    return out


class CollectiveMismatch(Detector):
    """Ranks disagree on op, size or dtype of the same collective (same pg and sequence number), or a
    gradient reduction runs in lower precision than the parameters on this rank while its peers do not
    (e.g. a bf16 compress hook on an fp32 model on one rank).

    Only cross-rank disagreement fires: a low-precision reduction that every rank runs (FSDP
    ``MixedPrecisionPolicy(reduce_dtype=bf16)``, DDP's bf16 compress hook) never counts, and one the model
    declares is skipped outright. A narrow reduction counts when the latest exchange shows a peer
    running the same (pg, op, message bytes) wider: that needs no overlap of the ranks' FR windows, so it
    is judged at the first exchange (a 3 s slot) after the read, one poll later. Attributed
    by majority within the pg; a 1-1 split goes to the rank reducing in a dtype narrower than the
    parameters, if only one does. Value: mismatched collectives + narrower-than-peers reductions seen
    on this rank in the latest window.
    """

    name = "CollectiveMismatch"
    threshold_param = "max_entries"
    cross_rank = True
    evidence = ("fr",)
    clear = 3

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.param_bits: int | None = None
        self.intended: set[int] = set()
        self.cross: list[dict[str, Any]] = []
        self.odd_peers: list[int] = []  # the ranks compared whose entries differ from the majority's
        self.peer_bits: dict[sig.ReductionKey, float] = {}
        self.kinds_judged: sig.OddMemo = {}  # ``signals.collective_mismatches``' memo, from exchange to exchange

    def needs(self) -> FeedNeeds:
        return FeedNeeds(fr_entries=int(self.p("max_entries")))

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        entries = snap.collectives.fr_entries  # the last ``max_entries`` (``DetectorFeed.fr_limit``)
        return {"fr": {"fr": sig.pack_fr(entries)}} if entries else {}

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        if self.param_bits is None:
            self.param_bits = _param_bits(snap.model)
            self.intended = intended_reduce_bits(snap.model) if self.param_bits else set()
        if snap.exchange.fresh:  # pause points between the steps: together they hold the GIL for up to ~5 ms
            fr, sizes = snap.exchange.fr
            gil.pause_point()
            every = (
                sig.collective_mismatches(fr, sizes, self.param_bits, snap.exchange.common, self.kinds_judged)
                if len(fr) >= 2
                else {}
            )
            self.cross = every.get(snap.rank, [])
            self.odd_peers = sorted(every) if len(every) < len(fr) else []  # all odd: a tie, culprit unknown
            gil.pause_point()
            self.peer_bits = sig.peer_reduction_bits(fr, snap.rank)
            gil.pause_point()
        entries = snap.collectives.fr_entries
        if not entries and not self.cross:
            return None
        low = (
            sig.low_precision_reductions(entries, self.param_bits or 32, _grad_pgs(snap, entries))
            if self.param_bits
            else []
        )
        unconfirmed = sig.narrower_than_peers(
            [e for e in low if sig.entry_bits(e) not in self.intended], self.peer_bits
        )
        details = {
            "mismatched": self.cross[:8],
            "low_precision": [{"pg": e[0], "seq": e[1], "op": e[2], "dtypes": e[4]} for e in unconfirmed[:8]],
            "agreed_low_precision": len(low) - len(unconfirmed),
            "param_bits": self.param_bits,
            "culprits": sorted({*self.odd_peers, *([snap.rank] if unconfirmed else [])}),
        }
        return Verdict(
            bool(self.cross or unconfirmed), float(len(self.cross) + len(unconfirmed)), details, threshold=0.0
        )


#: Seconds of clock skew between hosts allowed for in reading a peer as idle (``sig.IDLE_STEPS`` behind).
IDLE_SKEW_S = 1.0


class Straggler(Detector):
    """One rank (or a block of them) persistently slower than its peers, holding everyone at every
    collective.

    Why arrival times: with synchronous collectives every rank's step time equalizes (the fast ranks
    wait), so step time cannot tell who is slow; per-chunk compute time includes the TP all-reduces
    that wait for the slow rank too. The flight recorder's ``time_created_ns`` (enqueue time, on gloo
    and NCCL) shows who arrives late at each collective. Each exchange, the steps of this rank that
    every peer's window covers are measured (``signals.step_delays``): each peer's delay in the step,
    counted once however many collectives (gradient buckets) the step holds, net of the waits it
    suffered (a tp peer waiting for a slow rank is a victim), as a share of the typical rank's step.
    The shares of the last ``window_steps`` measured steps are kept from exchange to exchange (memory:
    a float per peer and step), so a job with hundreds of collectives a step, whose window holds one
    step, is judged too; the score is the median share m as ``m / (1 + m)`` (``signals.delay_score``):
    a 1.5x slower rank scores 0.33, a 1.1x one 0.09, for any number of buckets.

    Culprits are the ranks over ``max_lag_ratio`` whose waits this rank can see: the members of its
    own groups, and of any model-parallel group (tp, cp) it reads whole; a rank of another replica is
    a reference only (its tp peers are not read, so what it waited for is not known). The reference,
    the median of the others, is a slow rank where slow ones are half or more of them: a rank ahead of
    its reference scores below 0 (``signals.pace``), and where one is ahead past ``max_lag_ratio`` the
    compared ranks split into a slower and a faster side (``signals.slow_culprits``). Culprits are
    named only where the faster side is at least as large; else none: the alert is raised on the
    slower side's ranks with ``culprit_unknown`` ("no majority") and ``split``. Confirmed on two
    consecutive exchanges. Value: this rank's score. Clock skew between hosts adds to every lag: keep
    hosts NTP/PTP-synced (typical skew << step time).
    """

    name = "Straggler"
    gpu_culprits = True
    threshold_param = "max_lag_ratio"
    cross_rank = True
    confirm = 2

    def __init__(self, thresholds: dict[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.warm_ns: int | None = None  # when this rank completed warmup_steps steps
        self.ends: deque[int] = deque(maxlen=512)  # this rank's step boundaries, ns since the epoch
        self.shares: dict[int, dict[int, float]] = {}  # rank -> step end ns -> its share that step
        self.slowest: tuple[int, float] | None = None  # (rank, lag ratio) of the job's confirmed slow rank
        self._slow_candidate: int | None = None
        self._slow_streak = 0
        self.work: dict[int, float] = {}  # step end ns -> this rank's own work (p2p waits out), seconds
        #: (since, median work of its first warm steps, the last of those steps' end ns)
        self.work_base: tuple[int, float, int] | None = None

    def step_hook(self, tick: StepTick) -> None:
        if self.warm_ns is None and tick.step + 1 >= self.p("warmup_steps"):
            self.warm_ns = tick.t_ns
        self.ends.append(tick.t_ns)

    def publish(self, snap: Snapshot) -> dict[str, dict[str, Any]]:
        """A pipeline stage's p2p waits, so its peers count them as waits, not its work: at each of its
        flight-recorder entries, the ns waited in p2p by then (``pw``, aligned with ``fr``); and its own
        work a step, baseline and now (``pwork``, seconds)."""
        log = snap.collectives.p2p_waited
        if not log:
            return {}
        out: dict[str, dict[str, Any]] = {}
        entries = snap.collectives.fr_entries
        if entries:
            out["fr"] = {"pw": sig.pack_totals(waited_by(log, [e[5] for e in entries]))}
        topo = snap.topology
        pure = topo.dp <= 1 and topo.tp <= 1 and topo.cp <= 1  # no collective waits in its work
        if pure and (works := self._own_work(snap, log)) is not None:
            out["s"] = {"pwork": [round(w, 6) for w in works]}
        return out

    def _own_work(self, snap: Snapshot, log: Sequence[tuple[int, int]]) -> tuple[float, ...] | None:
        """(baseline, now, step): the median own work a step of this rank's first ``min_window_steps``
        warm steps, of its last ``window_steps`` after those (at least ``min_window_steps``: a
        descheduled moment is a few steps of them), and the median step time of the latter; None until
        both are measured."""
        if self.warm_ns is None:
            return None
        since = max(self.warm_ns, int(snap.warmup.last_ts * 1e9))
        last = max(self.work, default=0)
        ends = [t for t in self.ends if t >= since and t >= last]
        gil.pause_point()
        self.work.update(sig.own_work(ends, waited_by(log, ends)))
        n, keep = int(self.p("min_window_steps")), int(self.p("window_steps"))
        self.work = dict(sorted((t, w) for t, w in self.work.items() if t >= since)[-keep - n :])
        if self.work_base is not None and self.work_base[0] != since:
            self.work_base = None  # compiled again: a new baseline
        if self.work_base is None and len(self.work) >= n:
            first = list(self.work.items())[:n]
            self.work_base = (since, median(w for _, w in first), first[-1][0])
        if self.work_base is None:
            return None
        after = [(t, w) for t, w in self.work.items() if t > self.work_base[2]][-keep:]
        if len(after) < n:
            return None
        steps = [b - a for (a, _), (b, _) in pairwise(after)]
        return self.work_base[1], median(w for _, w in after), median(steps) / 1e9

    def conclusion(self, active: bool, value: float) -> Conclusion:
        """For the step anatomy's slow-rank verdict: this rank's own alert, else the peer it confirmed
        slowest among the ranks' exchanged lags (``slowest``)."""
        if active:
            return Conclusion(True, None, float(value) if value else None)
        slowest = self.slowest
        return Conclusion(False, *slowest) if slowest is not None else Conclusion()

    def evaluate(self, snap: Snapshot) -> Verdict | None:
        if not snap.exchange.fresh or snap.steps_done < self.p("warmup_steps"):
            return None
        if not snap.warmup.warmed_up(int(self.p("quiet_steps")), int(self.p("max_busy_steps"))):
            return None  # ranks compiling at different speeds (a rank that started late still compiles)
        fr, _sizes = snap.exchange.fr
        peers = snap.exchange.peers
        idle = self._idle(snap)
        if snap.rank in idle:
            self.shares.clear()
            return Verdict(False, 0.0)  # it waits for the others, none of which is slow for that
        if idle:
            fr = {r: es for r, es in fr.items() if r not in idle}
            for r in idle:
                self.shares.pop(r, None)
        works = {r: [float(x) for x in p["pwork"]] for r, p in peers.items() if _triple(p.get("pwork"))}
        stage_scores = sig.stage_lags(works) if len(works) >= 2 else {}
        if (snap.rank not in fr or len(fr) < 2) and snap.rank not in stage_scores:
            return None
        paces: dict[int, float] = {}  # rank -> its score, negative for a rank ahead (``signals.pace``)
        seen: set[int] = set()
        if snap.rank in fr and len(fr) >= 2:
            since = max(self.warm_ns or 0, int(snap.warmup.last_ts * 1e9))
            ends = [t for t in self.ends if t >= since]
            gil.pause_point()
            stages = {r: int(p.get("c", {}).get("stage", 0) or 0) for r, p in peers.items()}
            measured = max((t for v in self.shares.values() for t in v), default=0)
            waited = {
                r: dict(zip((e[5] for e in es), pw, strict=True))
                for r, es in fr.items()
                if (pw := sig.unpack_totals(peers.get(r, {}).get("pw"))) is not None and len(pw) == len(es)
            }
            self._keep(sig.step_delays(fr, ends, stages, after=measured, waited=waited), since)
            paces = {
                r: sig.pace(list(v.values()))
                for r, v in self.shares.items()
                if r in fr and len(v) >= self.p("min_window_steps")
            }
            seen = _seen_whole(fr, snap)
        for r, v in stage_scores.items():  # a stage that became slower than its own baseline
            paces[r] = max(paces.get(r, 0.0), v)
            seen.add(r)
        if snap.rank not in paces:
            return None
        scores = {r: max(0.0, v) for r, v in paces.items()}
        limit = self.p("max_lag_ratio")
        verdict = sig.slow_culprits(paces, _units(fr, paces), seen, limit)
        slow = verdict["culprits"]
        self._note_slowest({r: scores[r] for r in slow})
        ratio = scores[snap.rank]
        split = verdict.get("split")
        return Verdict(
            snap.rank in split["slower"] if split else ratio > limit,
            ratio,
            {
                "steps": len(self.shares.get(snap.rank, {})),
                **verdict,
                "victims": sorted(seen - set(slow)) if slow else [],
                "lags": {str(r): round(v, 3) for r, v in sorted(paces.items())},  # < 0: ahead
                **(
                    {"stage_changed": changed}
                    if (changed := [r for r in slow if stage_scores.get(r, 0) > limit])
                    else {}
                ),
            },
        )

    def _idle(self, snap: Snapshot) -> set[int]:
        """Ranks whose step count fell ``sig.IDLE_STEPS`` behind this rank's at the time they published it
        (less ``IDLE_SKEW_S`` for the hosts' clocks), or this rank where a peer is that far ahead: out of
        data under DDP's ``Join``, which shadows the others' collectives at once, such a rank arrives
        first at every collective and waits there for ranks that are not slow but still have batches.
        It is no reference for the others' pace, nor judged by it. Synchronous ranks are within a step
        of each other."""
        counts = {
            r: (p["step"], float(p.get("t", 0)))
            for r, p in snap.exchange.peers.items()
            if r != snap.rank and isinstance(p.get("step"), int)
        }
        if sig.steps_behind(snap.exchange.peers, snap.rank, snap.steps_done) >= sig.IDLE_STEPS:
            return {snap.rank}
        ends, done = self.ends, snap.steps_done
        idle = set()
        for r, (n, t) in counts.items():
            i = bisect.bisect_right(ends, int((t - IDLE_SKEW_S) * 1e9))
            if i and done - (len(ends) - i) - n >= sig.IDLE_STEPS:  # i = 0: before the steps kept
                idle.add(r)
        return idle

    def _keep(self, measured: dict[int, dict[int, float]], since: int) -> None:
        """Add this exchange's measured steps; keep the last ``window_steps`` of each rank (and none from
        before ``since``: compiles)."""
        keep = int(self.p("window_steps"))
        for r, by_step in measured.items():
            held = self.shares.setdefault(r, {})
            held.update(by_step)
            if len(held) > keep or min(held, default=since) < since:
                self.shares[r] = dict(sorted((t, v) for t, v in held.items() if t >= since)[-keep:])

    def _note_slowest(self, lags: dict[int, float]) -> None:
        """The job's slow rank as every rank sees it (the step anatomy names it): the culprit with the
        largest lag, past ``max_lag_ratio`` on ``confirm`` consecutive judgements (none where the
        culprit is unknown, nor a rank of another replica whose waits this rank does not see)."""
        worst = max(lags, key=lags.__getitem__) if lags else None
        if worst is None or lags[worst] <= self.p("max_lag_ratio"):
            self.slowest, self._slow_streak = None, 0
            return
        self._slow_streak = self._slow_streak + 1 if worst == self._slow_candidate else 1
        self._slow_candidate = worst
        self.slowest = (worst, lags[worst]) if self._slow_streak >= self.confirm else None


def _triple(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)


def _units(fr: dict[int, list[sig.FrEntry]], ranks: Iterable[int]) -> list[list[int]]:
    """``ranks`` joined by the model-parallel groups (tp, cp) they entered together: the ranks of one
    replica's piece, which wait for each other, weighed as one against the other replicas."""
    unit = {r: {r} for r in ranks}
    for members in _model_parallel_members(fr).values():
        joined = set().union(*(unit[r] for r in members if r in unit))
        for r in joined:
            unit[r] = joined
    return [sorted(u) for u in {id(u): u for u in unit.values()}.values()]


def _model_parallel_members(fr: dict[int, list[sig.FrEntry]]) -> dict[str, set[int]]:
    """pg uid -> the ranks read that entered it, for the model-parallel groups (tp, cp)."""
    members: dict[str, set[int]] = {}
    for r, entries in fr.items():
        for uid in {e[0] for e in entries}:
            if sig.model_parallel_dim(src.pg_label(uid)):
                members.setdefault(uid, set()).add(r)
    return members


def _seen_whole(fr: dict[int, list[sig.FrEntry]], snap: Snapshot) -> set[int]:
    """The ranks read whose waits this rank can see: every model-parallel group they entered (tp, cp)
    has all its members read. Waits in a gradient group (dp) end for all its members at once."""
    topo = snap.topology
    size = {"tp": topo.tp, "cp": topo.cp}
    short = {
        uid
        for uid, rs in _model_parallel_members(fr).items()
        if len(rs) < size[sig.model_parallel_dim(src.pg_label(uid)) or "tp"]
    }
    return {r for r, entries in fr.items() if not any(e[0] in short for e in entries)}
