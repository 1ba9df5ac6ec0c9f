"""What every detector reads in one pass: a frozen snapshot, built once per pass.

``feed.DetectorFeed`` fills it from the collectors (through ``sources``) at the start of the pass, and
the cross-rank exchange (``exchange.CrossRankExchange``) adds what its last read of the store brought.
Detectors read nothing else: no component, no module-level cache. What several of them derive from the
same data (the peers' flight-recorder entries by group, the collectives every member reported) is
computed on first use and kept in the snapshot for the rest of the pass. Its contents are shared by
every detector of the pass: read them, never change them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.detectors.waits import GroupState
from hpar_agent.topology import Topology

if TYPE_CHECKING:
    from hpar_agent.affinity import Binding

#: pg labels whose members the coordinates say (a user's own group's do not: judged among its reporters).
KNOWN_PGS = ("dp", "tp", "pp", "default_pg", "dp_replicate", "dp_shard", "cp")

#: ``fetch(purpose, ranks)``: those ranks' blobs of one purpose read from the store now (see ``PeerView``).
Fetch = Callable[[str, Iterable[int]], dict[int, dict[str, Any]]]
#: (pg label, op, seq, enqueue ns, seconds) of a timed collective
TimedOp = tuple[str, str, int, int, float]


def _fetch_nothing(purpose: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    return {}


@dataclass(frozen=True)
class CompileWarmup:
    """Compile activity (a compile started, ended or added a graph) as tracked up to this pass, for the
    detectors that must not judge compile warm-up."""

    last_ts: float = 0.0  # agent-thread time compile activity was last seen (0: never)
    last_step: int = 0  # steps completed then
    quiet_s: float = math.inf  # seconds since (inf: never)
    quiet_steps: int = 0  # steps since
    busy_steps: int = 0  # steps the current stretch of activity has lasted (0 when quiet)

    def warmed_up(self, quiet_steps: int, max_busy_steps: int) -> bool:
        """Past compile warm-up: compiles quiet for ``quiet_steps`` steps, or compiling steadily for more
        than ``max_busy_steps`` steps (that is the job's steady state, not a warm-up: warm-up compiles
        last a few steps, a leak or storm that compiles every step lasts as long as it runs)."""
        return self.quiet_steps >= quiet_steps or self.busy_steps > max_busy_steps


@dataclass(frozen=True)
class CompileState:
    """The compile collector's state (the snapshot holds None without one)."""

    recompiles: float  # recompiles plus recompile-limit hits so far
    limit_hits: float
    cache_lookups: tuple[float, float]  # (hits, misses) over the compile caches so far
    graph_breaks: Mapping[str, int]  # reason key -> breaks so far
    break_info: Mapping[str, Any]  # reason key -> what the collector logged (``sources.break_detail``)
    graph_log: Sequence[tuple[int, str]]  # (step, code location) of every graph compiled (bounded)
    fingerprint: int

    def break_detail(self, reason: str) -> str:
        """The user stack / message logged for graph breaks of ``reason`` (for the alert details)."""
        return src.break_detail(self.break_info.get(reason))

    def break_c10d(self, reason: str) -> str:
        """The c10d function (e.g. broadcast) that caused graph breaks of ``reason``; '' for other breaks."""
        return src.break_c10d(self.break_info.get(reason))


@dataclass(frozen=True)
class MemoryState:
    series: Mapping[str, Sequence[tuple[int, float]]] = field(
        default_factory=dict
    )  # source -> last (step, bytes)
    room: Mapping[str, int] = field(default_factory=dict)  # source -> bytes left (``sources.memory_room``)


@dataclass(frozen=True)
class CollectiveState:
    timed: int = 0  # ops timed so far
    timed_ops: Sequence[TimedOp] = ()  # the most recent ones
    oldest_inflight: Mapping[str, float] = field(default_factory=dict)  # pg -> age of its oldest op in flight
    groups: Mapping[str, GroupState] = field(default_factory=dict)  # pg id -> this rank's last seqs
    pg_timeout_s: float | None = None
    fr_entries: Sequence[sig.FrEntry] = ()  # the last flight-recorder entries (``sources.fr_entries``)


@dataclass(frozen=True)
class GradSyncState:
    coverage: float | None  # dp coverage of the last judged step
    tp_coverage: float | None
    judged: int  # the last step judged
    required: int  # gradient elements a step must reduce
    tp_samples: Mapping[str, Any]  # this rank's tp gradient samples, for its tp peers


@dataclass(frozen=True, eq=False)
class PeerView:
    """What the cross-rank exchange holds in this pass: the comparison peers' payloads of its last read
    (``fresh``: read in this pass), every comparison peer's last ``s`` however old (``seen``: a stopped
    rank's last word), this rank's comparison peers by mesh dim, when a read last succeeded and the
    exchange's interval. ``fetch`` is the one thing read on demand (checksums by name, only when digests
    disagree: the store serves it)."""

    peers: Mapping[int, dict[str, Any]] = field(default_factory=dict)
    fresh: bool = False
    seen: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    read_ok_at: float = 0.0
    interval_s: float = 3.0
    fetch: Fetch = _fetch_nothing

    @cached_property
    def fr(self) -> tuple[dict[int, list[sig.FrEntry]], dict[str, int]]:
        """The peers' published flight-recorder entries, and for each pg the number of ranks read that are
        its members (by their coordinates: a collective is judged once every member read has it, so a
        member that has not published it yet never turns a 3-rank majority into a 1-1 tie)."""
        fr = {
            r: sig.unpack_fr(p["fr"]) for r, p in self.peers.items() if "fr" in p
        }  # unpacked at the read already
        coords = [p["c"] for p in self.peers.values() if isinstance(p.get("c"), dict)]
        uids = {e[0] for entries in fr.values() for e in entries}  # a few groups among ~1,000 entries
        sizes = {uid: sum(1 for c in coords if src.group_key_of(label, c) == uid)
                 for uid in uids if (label := src.pg_label(uid)) in KNOWN_PGS}  # fmt: skip
        return fr, sizes

    @cached_property
    def common(self) -> dict[tuple[str, int], dict[int, sig.FrEntry]]:
        """``signals.common_collectives`` of ``fr``: (pg, seq) -> rank -> entry, every member's."""
        fr, sizes = self.fr
        return sig.common_collectives(fr, sizes)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """One pass's view of this rank (see the module doc). ``steps_done`` is the training thread's own
    count (``sources.step_state``)."""

    now: float
    topology: Topology
    coords: Mapping[str, int]  # ``topology.coords()``
    steps_done: int = 0
    last_step_ts: float = 0.0  # unix time of the last step
    step_durations: Sequence[float] = ()  # recent step durations, seconds
    warmup: CompileWarmup = field(default_factory=CompileWarmup)
    compile: CompileState | None = None
    memory: MemoryState = field(default_factory=MemoryState)
    collectives: CollectiveState = field(default_factory=CollectiveState)
    grad_sync: GradSyncState | None = None
    binding: Binding | None = None  # the CPU binding against the GPU's ideal CPUs (read once at attach)
    model: Any = None  # the user's model: its metadata only (parameter dtypes, wrappers' hooks)
    evidence_on: bool = False  # evidence is collected (``AgentConfig.evidence``)
    stopping: bool = False  # the agent stops: this is its last pass
    exchange: PeerView = field(default_factory=PeerView)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def stage(self) -> int:
        return self.topology.pp_stage
