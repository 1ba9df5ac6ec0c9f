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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from hpar_agent.detectors import signals as sig
from hpar_agent.detectors import sources as src
from hpar_agent.topology import Topology

if TYPE_CHECKING:
    from hpar_agent.affinity import Binding

#: pg labels whose members the coordinates say (a user's own group's do not: judged among its reporters).
KNOWN_PGS = ("dp", "tp", "pp", "default_pg", "dp_replicate", "dp_shard", "cp")

#: ``fetch(purpose, ranks)``: those ranks' blobs of one purpose read from the store now (see ``PeerView``).
Fetch = Callable[[str, Iterable[int]], dict[int, dict[str, Any]]]


def _fetch_nothing(purpose: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    return {}


class CompileWarmup(NamedTuple):
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


NO_WARMUP = CompileWarmup()


@dataclass(frozen=True, eq=False)
class PeerView:
    """What the cross-rank exchange holds in this pass: the comparison peers' payloads of its last read
    (``fresh``: read in this pass), every comparison peer's last ``s`` however old (``seen``: a stopped
    rank's last word), this rank's comparison peers by mesh dim, when a read last succeeded and the
    exchange's interval. ``fetch`` is the one thing read on demand (checksums by name, only when digests
    disagree; a silent peer's ``s``, once past RankGone's bound; the ``s`` of the ranks a hang's chain
    of p2p waits goes through beyond the peers: the store serves it; a failed read leaves the rank
    out). ``clock`` tells the wall-clock time of a ``fetch`` made now (the pass has waited for its
    offsets since its start: a read's age is judged from when it is made); ``pass_s`` is the agent's
    interval (a late pass is up to that late)."""

    peers: Mapping[int, dict[str, Any]] = field(default_factory=dict)
    fresh: bool = False
    seen: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    read_ok_at: float = 0.0
    interval_s: float = 3.0
    fetch: Fetch = _fetch_nothing
    clock: Callable[[], float] = time.time
    pass_s: float = 1.0

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
        sizes = {
            uid: sum(1 for c in coords if src.group_key_of(label, c) == uid)
            for uid in uids
            if (label := src.pg_label(uid)) in KNOWN_PGS
        }
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
    last_progress_ts: float = 0.0  # unix time of the last step, or since it of work or a compile
    thread_cpu_share: float | None = None  # the training thread's share of a CPU over the last pass
    warmup: CompileWarmup = NO_WARMUP
    compile: src.CompileState | None = None  # None without a compile collector
    memory: src.MemoryState = src.NO_MEMORY
    collectives: src.CollectiveState = src.NO_COLLECTIVES
    grad_sync: src.GradSyncState | None = None
    binding: Binding | None = None  # the CPU binding against the GPU's ideal CPUs (read once at attach)
    gpu: src.GpuHealth | None = None  # this rank's GPU health (None: no GPU, or not read)
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
