"""This rank's side of the detectors' cross-rank exchange through the job's c10d store (``crossrank``
says what travels and why the store): when to capture, publish and read, the store client, what the
last read brought, the goodbye at detach, and the pause until the next exchange after a store call
failed."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hpar_agent import gil, topology_watch
from hpar_agent.crossrank import (
    EVERY_EXCHANGE,
    PURPOSES,
    Cadence,
    Exchange,
    Grid,
    PeerPlan,
    cadence,
    node_sizes,
    open_store,
    plan,
)
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.snapshot import PeerView
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from hpar_agent.topology import mesh_dim_names, mesh_from_model
from hpar_agent.torch_compat import pipelining

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext

log = logging.getLogger("hpar_agent")

#: Seconds the store's host waits at exit for its peers' goodbyes (they end within a few passes of it).
BYE_WAIT_S = 1.0

#: Payload by purpose (``crossrank``'s table), built when an exchange is due.
Payload = dict[str, dict[str, Any]]


class CrossRankExchange:
    """Paced by ``crossrank.cadence``: at each slot of ``exchange_s`` (sooner, ``exchange_min_s`` after the
    last, when what a payload carries changed or a cross-rank alert awaits its confirmation), every rank
    captures its payload at the same tick, sets it at its offset into the pass, and reads its comparison
    peers' ``polls`` passes later. ``view()`` is what the detectors read of it in a pass.

    The store client is opened on the first exchange the agent needs (a caller's ``exchange`` is used as
    given) and dropped at ``close`` when the agent opened it."""

    def __init__(self, exchange: Exchange | None = None) -> None:
        self.exchange = exchange
        self.ctx: AgentContext | None = None
        self.exchange_s = COMPONENT_DEFAULTS["exchange_s"]
        self.exchange_min_s = COMPONENT_DEFAULTS["exchange_min_s"]
        self.stale_s = COMPONENT_DEFAULTS["stale_s"]
        self.now = 0.0  # the current pass's time
        self.peers: dict[int, dict[str, Any]] = {}  # the last read: this rank's and fresh peers' payloads
        self.fresh = False  # ``peers`` was read in this pass
        self.seen: dict[int, dict[str, Any]] = {}  # every comparison peer's last ``s``, however old
        self.read_ok_at = 0.0  # time of the last read of the store that succeeded
        self._store_down_until = 0.0  # no store call before then (the next slot): a store call failed
        self._store_tried = exchange is not None
        self._own_store = False
        self._last_exchange = -1e18
        self._token: tuple[Any, ...] = ()  # what the last publish was built from (``run``'s ``token``)
        self._passes = 0  # passes of the exchange (its phases are counted in them)
        self._pending: tuple[Payload, int] | None = None  # payload captured, pass to set it
        self._read_at: int | None = None  # the pass to read the peers' payloads of the last publish
        self._slot = -1.0  # the exchange slot last published in (see ``_due``)
        self._cadence_of: tuple[tuple[int, float, float], Cadence] | None = None
        #: (mesh id, model id, rank, world size) -> plan
        self._plan_of: tuple[tuple[int, ...], PeerPlan] | None = None
        self._reads = 0  # reads of the store so far
        self._view: tuple[tuple[Any, ...], PeerView] | None = None  # (what it was built from, the last view)

    def install(self, ctx: AgentContext, exchange_s: float, exchange_min_s: float, stale_s: float) -> None:
        self.ctx = ctx
        self.exchange_s = exchange_s
        self.exchange_min_s = min(exchange_s, exchange_min_s)
        self.stale_s = stale_s

    def on_topology(self, world_size: int, old_world_size: int) -> None:
        """A rank that attached before its process group existed may now have peers to exchange with."""
        if world_size > 1 and old_world_size <= 1 and self.exchange is None:
            self._store_tried = False

    # ------------------------------------------------------------------------------------ a pass
    def begin(self, now: float) -> None:
        self.now = now
        self.fresh = False

    def up(self) -> bool:
        """Not paused after a failed store call (``back_off``)."""
        return self.now >= self._store_down_until

    def back_off(self) -> None:
        """No store call until the next exchange slot: torch prints a line for each failed store call (a
        store whose host exited fails every one), so a failing store costs a line an exchange; a
        transient failure costs this rank one exchange at most, and a live peer one exchange late is
        never named by RankGone. A longer pause would get a rank whose store call failed once named
        gone by its peers while it trains."""
        every = self.cadence().interval_s
        self._store_down_until = (self._slot_of(self.now, every) + 1) * every

    def run(
        self, token: tuple[Any, ...], confirming: Callable[[], bool], payload: Callable[[], Payload]
    ) -> None:
        """Capture this rank's payload when an exchange is due (``_due``: ``token`` is what a payload
        carries that peers act on at once, ``confirming`` whether a cross-rank alert awaits its
        confirmation), then read what the comparison peers published at the last exchange, then publish,
        each at this rank's offset (``crossrank.cadence``). The payload is built from the snapshot of the
        pass's start, the same instant on every rank: the flight-recorder windows compared are of one
        instant. A phase's requests are spread over ``window_s`` of ``polls`` passes, the read ``polls``
        passes after the publish; in a pass that does both, reads fill the first window and publishes the
        second, so no rank reads a payload of the exchange after the one it judges. Reading right after
        publishing raced the peers' publishes of the same pass."""
        ctx = self._ctx()
        self._passes += 1
        cad = self.cadence()
        rank = ctx.topology.rank
        k, offset = cad.offset(rank)
        if self._due(token, cad, confirming):
            self._token = token
            self._last_exchange = self.now
            if self.exchange is None and not self._store_tried:
                self._store_tried = True
                if ctx.topology.world_size > 1:
                    store = open_store()
                    if store is not None:
                        self.exchange = Exchange(store, ctx.topology.job_id, rank)
                        self._own_store = True
            if self.exchange is not None:
                self._pending = (payload(), self._passes + k)
        if self.exchange is None:
            return
        iv = ctx.config.interval
        tick = min(self.now, round(self.now / iv) * iv)  # a pass off a tick: now
        read = self._read_at is not None and self._passes >= self._read_at
        if read:
            self._read_at = None
            self._wait_until(tick + offset, cad)
            if not ctx.stopping:  # the peers end too, the store's host among them: publish only
                self.peers = self._read(self.exchange, cad, rank)
                self.fresh = True
                self._reads += 1
        if self._pending is not None and self._passes >= self._pending[1]:
            parts, at = self._pending
            self._pending = None
            self._wait_until(tick + offset + (cad.window_s if read else 0.0), cad)
            gil.pause_point()
            self.exchange.publish(parts)
            self._read_at = at + cad.polls

    def view(self) -> PeerView:
        """What the detectors read of the exchange now: the same object until a read, a new plan or
        cadence, the store opened, or the end of the pass that read."""
        cad = self.cadence()
        plan = self._plan() if self._ctx().topology.world_size > 1 else None  # one rank: no peers
        key = (self._reads, self.fresh, plan, cad, self.exchange)  # the objects: an id may be reused
        if self._view is None or self._view[0] != key:
            view = PeerView(
                peers=self.peers,
                fresh=self.fresh,
                seen=dict(self.seen),
                groups=plan.groups if plan is not None else {},
                read_ok_at=self.read_ok_at,
                interval_s=cad.interval_s,
                fetch=self.fetch,
                pass_s=self._ctx().config.interval,
            )
            self._view = (key, view)
        return self._view[1]

    # ------------------------------------------------------------------------------------ pacing
    def cadence(self) -> Cadence:
        """``crossrank.cadence`` of this job (worked out once per world size)."""
        ctx = self._ctx()
        key = (ctx.topology.world_size, self.exchange_s, ctx.config.interval)
        if self._cadence_of is None or self._cadence_of[0] != key:
            self._cadence_of = (key, cadence(*key))
        return self._cadence_of[1]

    def _due(self, token: tuple[Any, ...], cad: Cadence, confirming: Callable[[], bool]) -> bool:
        """At each slot of the exchange interval on the wall clock (the same passes on every rank: a rank
        whose own publishes drifted a pass off its peers' would read their windows a pass old, which no
        longer overlap its own); after ``exchange_min_s`` already when the change token changed or
        while a cross-rank alert waits for its confirmation (those extra publishes move no slot), where
        the cadence lets a pass read one exchange and publish the next (``gap`` 1)."""
        if self.exchange_s <= 0 and cad.gap == 1:
            return True
        slot = self._slot_of(self.now, cad.interval_s)
        if slot != self._slot:
            self._slot = slot
            return True
        if cad.gap > 1 or self.now - self._last_exchange < self.exchange_min_s:
            return False
        return confirming() or token != self._token

    def _slot_of(self, now: float, every: float) -> float:
        """The exchange slot of a pass: its tick (the pass's time rounded to the agent's interval, as a
        pass starts a little after its tick) over the exchange interval ``every``."""
        iv = self.ctx.config.interval if self.ctx is not None else 1.0
        return (round(now / iv) * iv) // every

    def _wait_until(self, t: float, cad: Cadence) -> None:
        """Until wall-clock time ``t`` where the cadence spreads the ranks (``AgentContext.wait``: the GIL
        released, at once when the agent stops, not on a final pass); never more than the two windows of a
        pass, whatever the wall clock did."""
        delay = min(t - time.time(), 2 * cad.window_s)
        if delay > 0:
            self._ctx().wait(delay)

    # ------------------------------------------------------------------------------------ reads
    def _read(self, exchange: Exchange, cad: Cadence, rank: int) -> dict[int, dict[str, Any]]:
        """rank -> its purposes merged into one dict, for this rank (what it published last) and every
        comparison peer whose ``s`` is fresh: younger than ``stale_s``, or two exchange intervals where
        those are longer (a peer's other purposes count only with it). Every peer's last ``s`` however
        old goes to ``seen`` (the liveness detectors read a stopped rank's last word)."""
        fresh = max(self.stale_s, 2 * cad.interval_s)
        got = exchange.read(self._plan().wants())
        self.read_ok_at = now = time.time()
        mine = [p for p in PURPOSES if p != "ck"]
        peers: dict[int, dict[str, Any]] = {}
        for r, s in got.get("s", {}).items():
            self.seen[r] = s
            if now - float(s.get("t", 0)) > fresh:
                continue
            merged: dict[str, Any] = {}
            for purpose in mine:
                blob = got.get(purpose, {}).get(r)
                if blob is not None and (
                    purpose not in EVERY_EXCHANGE or now - float(blob.get("t", 0)) <= fresh
                ):
                    merged.update(blob)
            peers[r] = merged
        own: dict[str, Any] = {}
        for purpose in mine:
            own.update(exchange.own.get(purpose, ()))
        if own:
            peers[rank] = own
        for p in peers.values():  # tuples of atomic values leave the collector's books (gcpause)
            if "fr" in p:
                gil.pause_point()
                p["fr"] = sig.unpack_fr(p["fr"])
        return peers

    def fetch(self, purpose: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
        """``purpose``'s blobs of ``ranks`` now (this rank's own as it published it), whatever their
        age; ranks that have none are left out, and all of them while the store fails (until the next
        exchange slot, as after a failed exchange: ``back_off``). Never waits for a key."""
        ranks = list(ranks)
        out: dict[int, dict[str, Any]] = {}
        if self.exchange is None or not self.up():
            return out
        rank = self._ctx().topology.rank
        if rank in ranks and purpose in self.exchange.own:
            out[rank] = self.exchange.own[purpose]
        try:
            out.update(self.exchange.read({purpose: ranks}).get(purpose, {}))
        except Exception as exc:
            if not _store_failed(exc):
                raise
            self.back_off()
            log.debug("hpar_agent: store read of %s failed (%s)", purpose, exc)
        return out

    # ------------------------------------------------------------------------------------ peers
    @property
    def peer_groups(self) -> Mapping[str, tuple[int, ...]]:
        """This rank's comparison peers by mesh dim (``crossrank.plan``)."""
        return self._plan().groups

    def _plan(self) -> PeerPlan:
        """Worked out once per mesh (``DeviceMesh.mesh`` builds a tensor each time it is read)."""
        ctx = self._ctx()
        topo = ctx.topology
        key = (id(ctx.mesh), id(ctx.model), topo.rank, topo.world_size, topo.pp, topo.dp, topo.tp)
        if self._plan_of is None or self._plan_of[0] != key:
            mesh = ctx.mesh if ctx.mesh is not None else mesh_from_model(ctx.model)
            self._plan_of = (key, plan(self._grid(mesh), ctx.topology.rank, nodes=node_sizes()))
            self.seen = {r: p for r, p in self.seen.items() if r in self._plan_of[1].peers}
        return self._plan_of[1]

    def _grid(self, mesh: Any) -> Grid:
        """The mesh's layout when it holds every rank; else ranks laid out over (pp, dp, tp) row-major
        as torchtitan and ``init_device_mesh`` do (over (dp, pp) where the pipelines' stages say each
        pipeline holds consecutive ranks), or all ranks in one dim when the degrees do not cover the
        world."""
        ctx = self._ctx()
        topo = ctx.topology
        if mesh is not None:
            try:
                grid = Grid.from_mesh(mesh, mesh_dim_names(mesh, ctx.model))
                if len(grid.ranks) == topo.world_size:
                    return grid
            except Exception as exc:
                log.debug("hpar_agent: mesh layout unreadable (%s); using the topology's degrees", exc)
        order = ("pp", "dp", "tp")
        if topo.pp > 1 and topo.dp > 1 and topo.tp == 1 and _consecutive_pipeline():
            order = ("dp", "pp", "tp")  # pipelines of consecutive ranks (``rank = replica * pp + stage``)
        degrees = {"pp": topo.pp, "dp": topo.dp, "tp": topo.tp}
        dims = [(d, degrees[d]) for d in order if degrees[d] > 1]
        if math.prod(n for _, n in dims) != topo.world_size:
            dims = [("world", topo.world_size)]
        return Grid.row_major(dims)

    # ------------------------------------------------------------------------------------ detach
    def goodbye(self) -> None:
        """This rank's last ``s`` once more with ``bye``: how it ended (``AgentContext.exit_reason``, "exit"
        for a clean one), so its peers' RankGone tells a rank that finished from one that died. The
        store gets a second at most: its host may be exiting too (a goodbye it missed loses nothing of
        this rank's, and is no error)."""
        ex, ctx = self.exchange, self.ctx
        if ex is None or ctx is None or "s" not in ex.own or not self.up():
            return  # never published (no peer waits for this rank's payloads), or the store is failing
        last = {k: v for k, v in ex.own["s"].items() if k != "t"}
        last["bye"] = ctx.exit_reason or "exit"
        last["step"] = src.step_state(ctx)[0]
        rank = ctx.topology.rank
        try:
            set_timeout = getattr(ex.store, "set_timeout", None)
            if set_timeout is not None and self._own_store:
                set_timeout(timedelta(seconds=1))
            ex.send([*ex.encode({"s": last}), (ex.key("bye", rank), last["bye"])])
            if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                self._await_goodbyes(ex, rank)
        except Exception as exc:
            if not _store_failed(exc):
                raise
            log.debug("hpar_agent: goodbye not delivered (%s)", exc)

    def _await_goodbyes(self, ex: Exchange, rank: int) -> None:
        """On the rank whose process hosts the job's store (rank 0 unless torchrun's agent does): wait,
        ``BYE_WAIT_S`` at most, for every other rank to say goodbye (a short job's ranks may never have
        read each other). Its exit closes the store, and a rank still reading it would fail its last
        calls, each logged by torch with a C++ stack."""
        world = self._ctx().topology.world_size
        keys = [ex.key("bye", r) for r in range(world) if r != rank]
        deadline = time.monotonic() + BYE_WAIT_S
        while keys and not ex.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        """Drop the store client the agent opened itself (its socket closes with it; a caller's exchange
        stays the caller's)."""
        if self._store_tried and self._own_store:
            self.exchange = None

    def _ctx(self) -> AgentContext:
        if self.ctx is None:
            raise RuntimeError("the cross-rank exchange is not installed")
        return self.ctx


def _consecutive_pipeline() -> bool:
    """Whether this rank's pipeline group holds consecutive ranks (``rank = replica * pp + stage``), as
    its pipelining stages say (each rank's own, the same answer on every rank of a regular layout)."""
    stages = topology_watch.stages()
    info = pipelining.stage_info(stages[0]) if stages else None
    ranks = sorted(info.group_ranks) if info is not None else []
    return len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1


def _store_failed(exc: BaseException) -> bool:
    """A store call failed (connection reset, timeout): torch's ``DistError`` and its kinds."""
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistError", ()))
