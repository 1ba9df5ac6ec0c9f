"""DetectorsComponent: evaluates every detector on the agent thread and turns verdicts into alerts.

One state machine for all alerts: ``confirm`` consecutive active verdicts fire, ``clear`` inactive ones
resolve. Firing increments ``hpar_alerts_total``, collects evidence, writes a JSONL ``alert`` event
naming the evidence, logs one rate-limited line and puts an event on the next completed step's span
(marking it anomalous so its trace is kept). ``hpar_alert_active`` is exported for every catalogued
alert from the first scrape, so rules see 0 rather than absence.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client.core import Metric

from hpar_agent import catalogue as cat
from hpar_agent import gil
from hpar_agent.alert_callbacks import Alert
from hpar_agent.component import Component
from hpar_agent.crossrank import (
    EVERY_EXCHANGE,
    PURPOSES,
    Cadence,
    Exchange,
    Grid,
    PeerPlan,
    cadence,
    open_store,
    plan,
)
from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.base import Detector
from hpar_agent.detectors.cluster import CollectiveMismatch, CompileDivergence, ReplicaDivergence, Straggler
from hpar_agent.detectors.gradsync import GradSyncIncomplete
from hpar_agent.detectors.host import NumaMisbinding
from hpar_agent.detectors.liveness import Hang, RankGone
from hpar_agent.detectors.local import (
    CollectiveLatencyHigh,
    CompiledGraphsGrowing,
    GraphBreaks,
    MemoryLeak,
    RecompileStorm,
)
from hpar_agent.detectors.sources import step_state
from hpar_agent.evidence import Evidence, main_stack
from hpar_agent.spans import StepRecord
from hpar_agent.thresholds import COMPONENT_DEFAULTS
from hpar_agent.topology import mesh_dim_names, mesh_from_model

if TYPE_CHECKING:
    from hpar_agent.context import AgentContext
    from hpar_agent.topology import Topology

log = logging.getLogger("hpar_agent")
D = TypeVar("D", bound=Detector)

ALL_DETECTORS: tuple[type[Detector], ...] = (
    RecompileStorm, GraphBreaks, CompileDivergence, ReplicaDivergence, CollectiveMismatch, MemoryLeak,
    CompiledGraphsGrowing, CollectiveLatencyHigh, Straggler, Hang, GradSyncIncomplete, NumaMisbinding, RankGone,
)  # fmt: skip
#: Culprits of one alert exported as ``hpar_alert_culprit`` series (the event lists them all).
MAX_CULPRIT_SERIES = 16
#: Seconds without an exchange after the store failed: torch logs every failed store call with its C++
#: stack on stderr, and a store whose host exited fails every call.
STORE_BACKOFF_S = 30.0


@dataclass
class AlertState:
    active: bool = False
    value: float = 0.0
    fired: int = 0
    streak: int = 0  # consecutive verdicts disagreeing with ``active``
    last_fired_step: int | None = None
    last_log: float = -1e18
    logged: bool = False
    evidence: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


class DetectorsComponent(Component):
    """Runs last in poll order, after the collectors whose state it reads.

    Parameters of the component itself (``AgentConfig.thresholds``, ``detectors.<param>``): see
    ``thresholds.COMPONENT_DEFAULTS`` (``exchange_min_s``: an exchange comes this soon after the last one
    when something changed, see ``_due``). The exchange is paced by ``crossrank.cadence`` (``_exchange``).

    Compile activity (any compile started, ended or added a graph) is tracked here once for the
    detectors that must not judge compile warm-up: ``compile_quiet_s`` / ``compile_quiet_steps`` say
    how long it has been quiet, ``compile_busy_steps`` how many steps the current busy stretch lasted.
    """

    name = "detectors"

    def __init__(self, exchange: Exchange | None = None, evidence: Evidence | None = None) -> None:
        super().__init__()
        self.detectors: list[Detector] = []
        self._step_detectors: tuple[ReplicaDivergence | None, Straggler | None] = (None, None)
        self.states: dict[str, AlertState] = {a: AlertState() for a in cat.ALERT_NAMES}
        self.exchange = exchange
        self.evidence = evidence
        self.now = 0.0
        self.rank = 0
        self.stage = 0
        self.steps_done = 0
        self.last_step_ts = 0.0
        self.step_durations: list[float] = []
        self.peers: dict[int, dict[str, Any]] = {}
        self.peers_fresh = False
        self.seen: dict[int, dict[str, Any]] = {}  # every comparison peer's last ``s``, however old
        self.read_ok_at = 0.0  # time of the last read of the store that succeeded
        self._store_down_until = 0.0  # no exchange before then: the store failed (its host may be gone)
        self._last_exchange = -1e18
        self._span_events: list[tuple[str, int, dict[str, Any]]] = []
        self._store_tried = exchange is not None
        self._own_store = False
        self._plan_of: tuple[tuple[int, ...], PeerPlan] | None = None  # (mesh, model ids, rank, world) -> plan
        self.exchange_s = COMPONENT_DEFAULTS["exchange_s"]
        self.exchange_min_s = COMPONENT_DEFAULTS["exchange_min_s"]
        self.log_interval_s = COMPONENT_DEFAULTS["log_interval_s"]
        self.stale_s = COMPONENT_DEFAULTS["stale_s"]
        self._token: tuple[Any, ...] = ()  # what the last publish was built from (see _change_token)
        self._passes = 0  # passes of this component (the exchange's phases are counted in them)
        self._pending: tuple[dict[str, dict[str, Any]], int] | None = None  # payload captured, pass to set it
        self._read_at: int | None = None  # the pass to read the peers' payloads of the last publish
        self._slot = -1.0  # the exchange slot last published in (see _due)
        self._cadence_of: tuple[tuple[int, float, float], Cadence] | None = None
        self._compile_token: tuple[float, ...] | None = None
        self.compile_last_ts = 0.0  # agent-thread time compile activity was last seen (0: never)
        self.compile_last_step = 0
        self.compile_busy_since = 0  # first step of the current stretch of polls that saw compile work
        self._compile_busy = False

    # ------------------------------------------------------------------------------------ lifecycle
    def install(self, ctx: AgentContext) -> None:
        super().install(ctx)
        th = dict(ctx.config.thresholds)
        d = COMPONENT_DEFAULTS
        self.exchange_s = float(th.get("detectors.exchange_s", d["exchange_s"]))
        self.exchange_min_s = min(self.exchange_s, float(th.get("detectors.exchange_min_s", d["exchange_min_s"])))
        self.log_interval_s = float(th.get("detectors.log_interval_s", d["log_interval_s"]))
        self.stale_s = float(th.get("detectors.stale_s", d["stale_s"]))
        self.detectors = [cls(th) for cls in ALL_DETECTORS]
        self._step_detectors = (self.detector(ReplicaDivergence), self.detector(Straggler))  # looked up once
        self.rank = ctx.topology.rank
        self.stage = ctx.topology.pp_stage
        if self.evidence is None:
            self.evidence = ctx.evidence

    def on_topology(self, old: Topology, new: Topology) -> None:
        """A rank that attached before its process group existed learns its rank (and may now have
        peers to exchange with through the store)."""
        self.rank, self.stage = new.rank, new.pp_stage
        if self.evidence is not None:
            self.evidence.rank, self.evidence.device = new.rank, self.require_ctx().device
        if new.world_size > 1 and old.world_size <= 1 and self.exchange is None:
            self._store_tried = False

    @property
    def context(self) -> AgentContext:
        """The agent context (``Evaluation.context``: what detectors read the collectors through)."""
        return self.require_ctx()

    def detector(self, cls: type[D]) -> D | None:
        for d in self.detectors:
            if isinstance(d, cls):
                return d
        return None

    # ------------------------------------------------------------------------------------ training thread
    def step_hook(self, step: int, t_ns: int) -> None:
        rep, straggler = self._step_detectors
        if rep is not None and self.ctx is not None and self.ctx.topology.world_size > 1:
            try:
                rep.step_hook(self.ctx.model, step)
            except Exception as exc:
                self.ctx.record_error(self.name, exc)
        if straggler is not None:
            straggler.step_hook(step, t_ns)

    # ------------------------------------------------------------------------------------ agent thread
    def uninstall(self) -> None:
        """Say goodbye to the peers, then drop the store client the agent opened itself (its socket
        closes with it; a caller's exchange stays the caller's) and stop any allocator history recording."""
        try:
            self._goodbye()
        except Exception as exc:
            self.record_error(exc)
        if self._store_tried and self._own_store:
            self.exchange = None
        if self.evidence is not None:
            self.evidence.stop_memory_history()
        super().uninstall()

    def _goodbye(self) -> None:
        """This rank's last ``s`` once more with ``bye``: how it ended (``AgentContext.exit_reason``, "exit"
        for a clean one), so its peers' RankGone tells a rank that finished from one that died. The
        store gets a second at most: its host may be exiting too."""
        ex, ctx = self.exchange, self.ctx
        if ex is None or ctx is None or "s" not in ex.own or self.now < self._store_down_until:
            return  # never published (no peer waits for this rank's payloads), or the store is failing
        last = {k: v for k, v in ex.own["s"].items() if k != "t"}
        last["bye"] = ctx.exit_reason or "exit"
        last["step"] = step_state(ctx)[0]
        set_timeout = getattr(ex.store, "set_timeout", None)
        if set_timeout is not None and self._own_store:
            set_timeout(timedelta(seconds=1))
        ex.send(ex.encode({"s": last}))

    def _exchange(self) -> None:
        """Capture this rank's payload when an exchange is due (``_due``), then read what the comparison
        peers published at the last exchange, then publish, each at this rank's offset (``crossrank.
        cadence``). The payload is built at the tick, the same on every rank, whenever it is set: the
        flight-recorder windows compared are then of one instant. A phase's requests are spread over
        ``window_s`` of ``polls`` passes, the read ``polls`` passes after the publish; in a pass that
        does both, reads fill the first window and publishes the second, so no rank reads a payload of
        the exchange after the one it judges. Reading right after publishing raced the peers' publishes
        of the same pass."""
        ctx = self.ctx
        assert ctx is not None
        self.peers_fresh = False
        self._passes += 1
        cad = self._cadence()
        k, offset = cad.offset(self.rank)
        token = self._change_token()
        if self._due(token, cad):
            self._token = token
            self._last_exchange = self.now
            if self.exchange is None and not self._store_tried:
                self._store_tried = True
                if ctx.topology.world_size > 1:
                    store = open_store()
                    if store is not None:
                        self.exchange = Exchange(store, ctx.topology.job_id, self.rank)
                        self._own_store = True
            if self.exchange is not None:
                self._pending = (self._parts(), self._passes + k)
        if self.exchange is None:
            return
        tick = min(self.now, round(self.now / ctx.config.interval) * ctx.config.interval)  # a pass off a tick: now
        read = self._read_at is not None and self._passes >= self._read_at
        if read:
            self._read_at = None
            self._wait_until(tick + offset, cad)
            self.peers = self._read(self.exchange, cad)
            self.peers_fresh = True
        if self._pending is not None and self._passes >= self._pending[1]:
            parts, at = self._pending
            self._pending = None
            self._wait_until(tick + offset + (cad.window_s if read else 0.0), cad)
            gil.pause_point()
            self.exchange.publish(parts)
            self._read_at = at + cad.polls

    def _wait_until(self, t: float, cad: Cadence) -> None:
        """Until wall-clock time ``t`` where the cadence spreads the ranks (``AgentContext.wait``: the GIL
        released, at once when the agent stops, not on a final pass); never more than the two windows of a
        pass, whatever the wall clock did."""
        delay = min(t - time.time(), 2 * cad.window_s)
        if delay > 0:
            self.require_ctx().wait(delay)

    def _cadence(self) -> Cadence:
        """``crossrank.cadence`` of this job (worked out once per world size)."""
        ctx = self.require_ctx()
        key = (ctx.topology.world_size, self.exchange_s, ctx.config.interval)
        if self._cadence_of is None or self._cadence_of[0] != key:
            self._cadence_of = (key, cadence(*key))
        return self._cadence_of[1]

    def _parts(self) -> dict[str, dict[str, Any]]:
        """This rank's payload by purpose (``crossrank``'s table): its coordinates and step in ``s``,
        and what each cross-rank detector publishes."""
        topo = self.context.topology
        parts: dict[str, dict[str, Any]] = {p: {} for p in PURPOSES}
        parts["s"] = {"c": {**topo.coords(), "dp": topo.dp_rank, "stage": topo.pp_stage}, "step": self.steps_done}
        for d in self.detectors:
            if d.cross_rank:
                gil.pause_point()  # each publish is up to a few ms (FR entries packed, checksums summed)
                for purpose, fields in d.publish(self).items():
                    parts[purpose].update(fields)
        return parts

    def _read(self, exchange: Exchange, cad: Cadence) -> dict[int, dict[str, Any]]:
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
                if blob is not None and (purpose not in EVERY_EXCHANGE or now - float(blob.get("t", 0)) <= fresh):
                    merged.update(blob)
            peers[r] = merged
        own: dict[str, Any] = {}
        for purpose in mine:
            own.update(exchange.own.get(purpose, ()))
        if own:
            peers[self.rank] = own
        for p in peers.values():  # tuples of atomic values leave the collector's books (gcpause)
            if "fr" in p:
                gil.pause_point()
                p["fr"] = sig.unpack_fr(p["fr"])
        return peers

    @property
    def exchange_interval_s(self) -> float:
        """Seconds between this job's exchanges (``crossrank.cadence``)."""
        return self._cadence().interval_s

    def fetch(self, purpose: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
        """``purpose``'s blobs of ``ranks`` now (this rank's own as it published it), whatever their
        age; ranks that have none are left out. Never waits for a key."""
        ranks = list(ranks)
        out: dict[int, dict[str, Any]] = {}
        if self.exchange is None:
            return out
        if self.rank in ranks and purpose in self.exchange.own:
            out[self.rank] = self.exchange.own[purpose]
        out.update(self.exchange.read({purpose: ranks}).get(purpose, {}))
        return out

    def _change_token(self) -> tuple[Any, ...]:
        """What a publish would carry that peers act on at once: a settled graph fingerprint, and this
        rank reaching the detectors' warm-up step (3). New flight-recorder entries do not count: they
        change at every read of a running job, and exchanging them every poll made the exchange and
        the cross-rank detectors over half of the agent thread's work (4 CPU ranks, py-spy)."""
        ctx = self.ctx
        assert ctx is not None
        cd = self.detector(CompileDivergence)
        fp = cd.settled_fingerprint(self) if cd is not None else None
        return (fp, min(self.steps_done, 3))

    def _due(self, token: tuple[Any, ...], cad: Cadence) -> bool:
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
        confirming = any(
            d.cross_rank and self.states[d.name].streak > 0 and not self.states[d.name].active for d in self.detectors
        )
        return confirming or token != self._token

    def _slot_of(self, now: float, every: float) -> float:
        """The exchange slot of a pass: its tick (the pass's time rounded to the agent's interval, as a
        pass starts a little after its tick) over the exchange interval ``every``."""
        ctx = self.ctx
        iv = ctx.config.interval if ctx is not None else 1.0
        return (round(now / iv) * iv) // every

    def _track_compiles(self) -> None:
        token = src.compile_activity(self.context)
        if token is None:
            self._compile_busy = False
            return
        prev = self._compile_token
        busy = token[-1] > 0 or (token != prev if prev is not None else any(token))
        self._compile_token = token
        if busy:
            if not self._compile_busy:
                self.compile_busy_since = self.steps_done
            self.compile_last_ts = self.now
            self.compile_last_step = self.steps_done
        self._compile_busy = busy

    @property
    def compile_quiet_s(self) -> float:
        """Seconds since compile activity was last seen (inf when never)."""
        return self.now - self.compile_last_ts if self.compile_last_ts else float("inf")

    @property
    def compile_quiet_steps(self) -> int:
        return self.steps_done - self.compile_last_step

    @property
    def compile_busy_steps(self) -> int:
        """Steps the current stretch of compile activity has lasted (0 when quiet): warm-up compiles
        last a few steps, a leak or storm that compiles every step lasts as long as it runs."""
        return self.steps_done - self.compile_busy_since if self._compile_busy else 0

    def warmed_up(self, quiet_steps: int, max_busy_steps: int) -> bool:
        """Past compile warm-up: compiles quiet for ``quiet_steps`` steps, or compiling steadily for more
        than ``max_busy_steps`` steps (that is the job's steady state, not a warm-up)."""
        return self.compile_quiet_steps >= quiet_steps or self.compile_busy_steps > max_busy_steps

    @property
    def peer_groups(self) -> Mapping[str, tuple[int, ...]]:
        """This rank's comparison peers by mesh dim (``crossrank.plan``)."""
        return self._plan().groups

    def _plan(self) -> PeerPlan:
        """Worked out once per mesh (``DeviceMesh.mesh`` builds a tensor each time it is read)."""
        ctx = self.ctx
        assert ctx is not None
        key = (id(ctx.mesh), id(ctx.model), ctx.topology.rank, ctx.topology.world_size)
        if self._plan_of is None or self._plan_of[0] != key:
            mesh = ctx.mesh if ctx.mesh is not None else mesh_from_model(ctx.model)
            self._plan_of = (key, plan(self._grid(mesh), ctx.topology.rank))
            self.seen = {r: p for r, p in self.seen.items() if r in self._plan_of[1].peers}
        return self._plan_of[1]

    def _grid(self, mesh: Any) -> Grid:
        """The mesh's layout when it holds every rank; else ranks laid out over (pp, dp, tp) row-major
        as torchtitan and ``init_device_mesh`` do, or all ranks in one dim when the degrees do not
        cover the world."""
        ctx = self.ctx
        assert ctx is not None
        topo = ctx.topology
        if mesh is not None:
            try:
                grid = Grid.from_mesh(mesh, mesh_dim_names(mesh, ctx.model))
                if len(grid.ranks) == topo.world_size:
                    return grid
            except Exception as exc:
                log.debug("hpar_agent: mesh layout unreadable (%s); using the topology's degrees", exc)
        dims = [(d, n) for d, n in (("pp", topo.pp), ("dp", topo.dp), ("tp", topo.tp)) if n > 1]
        if math.prod(n for _, n in dims) != topo.world_size:
            dims = [("world", topo.world_size)]
        return Grid.row_major(dims)

    def poll(self, now: float) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not ctx.config.detectors:
            return
        self.now = now
        self.steps_done, self.last_step_ts, self.step_durations = step_state(ctx)
        try:
            self._track_compiles()
        except Exception as exc:
            ctx.record_error(self.name, exc)
        if now >= self._store_down_until:
            try:
                self._exchange()
            except Exception as exc:
                self._store_down_until = now + STORE_BACKOFF_S  # torch prints each failed store call
                ctx.record_error(self.name, exc)
        for d in self.detectors:
            gil.pause_point()
            try:
                verdict = d.evaluate(self)
            except Exception as exc:
                ctx.record_error(self.name, exc)
                continue
            if verdict is not None:
                self._update(d, verdict.active, verdict.value, verdict.details)
        self._publish_slow_rank(ctx)

    def _publish_slow_rank(self, ctx: AgentContext) -> None:
        """What the Straggler detector concluded, for the step anatomy (``AgentContext.slow_rank``):
        this rank's own alert, else the peer it confirmed slowest among the ranks' exchanged lags."""
        st = self.states.get("Straggler")
        d = self.detector(Straggler)
        out = ctx.slow_rank
        out.here = st is not None and st.active
        slowest = d.slowest if d is not None and st is not None and not out.here else None
        out.peer = slowest[0] if slowest is not None else None
        if out.here:
            out.lag = float(st.value) if st is not None and st.value else None
        else:
            out.lag = float(slowest[1]) if slowest is not None else None

    def _update(self, d: Detector, active: bool, value: float, details: dict[str, Any]) -> None:
        st = self.states[d.name]
        st.value = value
        if active == st.active:
            st.streak = 0
            if active:
                named = _culprits(details) != _culprits(st.details) and bool(_culprits(details))
                st.details = {**details, **{k: st.details[k] for k in ("stack",) if k in st.details}}
                if named:
                    self._announce(d, st, "updated", logging.INFO)
            return
        st.streak += 1
        if st.streak < (d.confirm if active else d.clear):
            return
        st.streak = 0
        st.active = active
        st.details = details
        if active:
            st.fired += 1
            st.last_fired_step = self.steps_done
            self._fire(d, st)
        else:
            self._resolve(d, st)

    def _fire(self, d: Detector, st: AlertState) -> None:
        ctx = self.ctx
        assert ctx is not None
        paths: list[str] = []
        if d.evidence and ctx.config.evidence and self.evidence is not None:
            try:
                paths = self.evidence.collect(f"{d.name}-{st.fired}", d.evidence)
            except Exception as exc:
                ctx.record_error(self.name, exc)
        st.evidence = paths
        stack = next((main_stack(p) for p in paths if p.endswith(".pyspy.json")), [])
        if stack:
            st.details["stack"] = stack  # what this rank was doing (the culprit of a hang: why)
        self._announce(d, st, "firing", logging.WARNING)

    def _resolve(self, d: Detector, st: AlertState) -> None:
        self._announce(d, st, "resolved", logging.INFO)

    def _announce(self, d: Detector, st: AlertState, state: str, level: int) -> None:
        ctx = self.ctx
        assert ctx is not None
        ctx.events.emit(
            "alert",
            alert=d.name,
            state=state,
            rank=self.rank,
            pp_stage=self.stage,
            step=self.steps_done,
            value=st.value,
            threshold=d.threshold,
            evidence=st.evidence if state == "firing" else [],
            details=st.details,
        )
        culprits = _culprits(st.details)
        if state == "updated":
            log.info("hpar_agent: alert %s on rank %d: culprit rank(s) %s", d.name, self.rank, _ranks_text(culprits))
            return
        ctx.dispatch_alert(self._alert(d, st, state))
        attrs = {cat.ATTR_ALERT: d.name, "state": state, "value": st.value}
        self._span_events.append((cat.EVENT_ALERT, time.time_ns(), attrs))
        del self._span_events[:-64]
        if state == "firing":  # rate limit: a resolution is logged only if its firing was
            st.logged = self.now - st.last_log >= self.log_interval_s
            if st.logged:
                st.last_log = self.now
        if st.logged:
            log.log(
                level,
                "hpar_agent: alert %s %s on rank %d stage %d (value %.4g, threshold %.4g)%s%s",
                d.name, state, self.rank, self.stage, st.value, d.threshold,
                f"; culprit rank(s) {_ranks_text(culprits)}" if state == "firing" and culprits else "",
                f"; evidence: {', '.join(st.evidence)}" if state == "firing" and st.evidence else "",
            )  # fmt: skip

    def _alert(self, d: Detector, st: AlertState, state: str) -> Alert:
        return Alert(name=d.name, state=state, value=st.value, threshold=d.threshold, step=self.steps_done,
                     rank=self.rank, details=dict(st.details),
                     evidence=tuple(st.evidence) if state == "firing" else ())  # fmt: skip

    def active_alerts(self) -> list[Alert]:
        """Alerts active now (any thread: reads a snapshot of the states)."""
        return [self._alert(d, self.states[d.name], "firing") for d in list(self.detectors)
                if self.states[d.name].active]  # fmt: skip

    def on_step(self, rec: StepRecord) -> None:
        if self._span_events:
            rec.events.extend(self._span_events)
            rec.anomalous = True
            self._span_events = []

    # ------------------------------------------------------------------------------------ outputs
    def collect(self) -> Iterable[Metric]:
        f = self.require_ctx().families
        active = f.gauge("hpar_alert_active")
        total = f.counter("hpar_alerts_total")
        value = f.gauge("hpar_detector_value")
        culprit = f.gauge("hpar_alert_culprit")
        for name in cat.ALERT_NAMES:
            st = self.states[name]
            f.add(active, [name], 1.0 if st.active else 0.0)
            f.add(total, [name], st.fired)
            f.add(value, [name], st.value)
            if st.active:
                for r in _culprits(st.details)[:MAX_CULPRIT_SERIES]:
                    f.add(culprit, [name, str(r)], 1.0)
        return [active, total, value, culprit]

    def summary(self) -> dict[str, Any]:
        out = {}
        for d in self.detectors:
            st = self.states[d.name]
            out[d.name] = {
                "active": st.active,
                "value": st.value,
                "threshold": d.threshold,
                "params": d.params,
                "fired": st.fired,
                "last_fired_step": st.last_fired_step,
                "evidence": st.evidence,
            }
        return out


def _culprits(details: Mapping[str, Any]) -> list[int]:
    """The ranks a verdict names as the cause (``details.culprits``), [] when it names none."""
    got = details.get("culprits")
    return [int(r) for r in got if isinstance(r, int)] if isinstance(got, list) else []


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:32])) + (f" and {len(ranks) - 32} more" if len(ranks) > 32 else "")
