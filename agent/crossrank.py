"""Cross-rank exchange of small detector payloads through the job's c10d store, with a bounded
number of peers per rank.

Why the store: an extra collective on the training process groups would queue behind (or block) the
very collectives a stuck rank is missing; the store is a side channel that keeps working when a rank
is stuck in C++. It is also the job's own rendezvous: barriers and group creation wait on it, so the
exchange must cost it O(peers compared) per rank, never O(ranks).

Keys: each rank overwrites one key per purpose, ``hpar/<job>/x/<purpose>/<rank>`` (bounded: never one
key per step), and a reader fetches only the purposes it compares:

| purpose | holds | set | read from |
|---|---|---|---|
| ``s`` | coordinates, step, settled compile fingerprint, parameter-checksum digests, GPU health (~0.4 KB) | every exchange | every comparison peer |
| ``fr`` | the last flight-recorder entries, packed (``signals.pack_fr``: ~10 bytes an entry, 2.7 KB at 256, 9.6 KB at the 1,024 of a window spanning 3 steps of many collectives) | every exchange | every comparison peer |
| ``gs`` | tp gradient samples (``collectors.gradsync``) | when they change | the tp peers |
| ``ck`` | parameter checksums by name (~0.2 KB a parameter over 3 steps) | when they change | the dp/tp peers, only when their digests in ``s`` disagree |

Comparison peers (``plan``): along every mesh dim but ``pp`` (stages hold different graphs and
parameters; a pure pipeline reads the ``s`` of the stages ``select`` picks, with their own work a step),
the members of this rank's group on that dim: all of them in a group of up to
``WHOLE_GROUP`` (8), else the four at +-n/5 and +-2n/5 in the group's order (``select``), moved
to the next offset that is not a multiple of the node size (8, and ``LOCAL_WORLD_SIZE``), so that
peers sit on other local GPU indices (``unaligned``). The choice is
symmetric (a rank is read by the ranks it reads), so a lone odd rank is outvoted 4 to 1 wherever it
is, and far apart: a block of up to n/5 contiguous ranks that is wrong or slow together (a node) holds
none of its members' peers, so every one of its ranks is named, not only its edges. What each detector compares, with whom:

- CompileDivergence: fingerprints (``s``) of all its peers, one stage;
- ReplicaDivergence: checksum digests (``s``) of its dp and tp peers, holders of the same shard; the
  checksums by name (``ck``) of one group only when its digests disagree;
- CollectiveMismatch, Straggler, CollectiveLatencyHigh: the entries (``fr``) of each pg's members
  among its peers (who arrives last at a collective, not step times: those equalize);
- GradSyncIncomplete: tp gradient samples (``gs``) of its tp peers.

No rank reads every rank: what needs the whole job (the distinct fingerprints of a stage, a rank's step
time against the job's median) is left to the Prometheus rules over the per-rank series
(``deploy/prometheus/rules``). Per exchange a rank sets 3-12 KB and gets as much from each of at most
``PEERS_PER_DIM`` peers per dim, whatever the job's size; the store serves 2 requests per rank
(``docs/capacity.md``, section 5, has the figures).

When (``cadence``): every rank captures its payload at the same tick (the flight-recorder windows
compared must be of one instant), then sets it and, a poll later, gets its peers', each at its own
offset into a window of the pass, so the store sees a bounded rate of the exchange's requests
whatever the job's size.

Blobs over ``COMPRESS_ABOVE`` bytes travel zlib-compressed (a fast level): the store's cost follows
the bytes it moves, and the JSON of flight-recorder entries, checksums and gradient samples shrinks
2-7x for tens of µs of the agent thread (``docs/capacity.md``, section 5). Every rank of a job runs one
version, so a reader tells the two forms apart by the first byte (``{`` or zlib's header).

Readers ``check()`` a key before its first read (keys are overwritten, never deleted: one seen stays),
so a rank that never published costs nothing and never blocks the agent thread; payloads carry their publish time, and a stuck rank's stale ``s`` is seen as
stale rather than waited for (its other purposes go with it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hpar_agent import gil
from hpar_agent.torch_compat import parallel

log = logging.getLogger("hpar_agent")

#: Peers read along one mesh dim once its group has more members than ``WHOLE_GROUP``.
PEERS_PER_DIM = 4
#: Ranks a node holds unless ``LOCAL_WORLD_SIZE`` says more: peer offsets avoid its multiples (``unaligned``).
NODE_RANKS = 8
#: Groups of up to this many members are read whole: half of a group of 8 that is slow together (a
#: node) cannot be told from the other half by four of them.
WHOLE_GROUP = 8
#: purpose -> the mesh dims whose comparison peers a rank reads it from at every exchange ("*": all);
#: ``ck`` is fetched on demand (ReplicaDivergence, when digests disagree).
READS: dict[str, str] = {"s": "*", "fr": "*", "gs": "tp"}
#: Purposes set at every exchange (their publish time is their freshness); the others only when changed.
EVERY_EXCHANGE = ("s", "fr")
PURPOSES = ("s", "fr", "gs", "ck")
#: Blobs longer than this many bytes are set zlib-compressed; ``s`` (0.4-0.5 KB, read by every peer
#: and by RankGone's re-reads) stays plain JSON. At its largest a dp x tp rank then gets 3x fewer bytes.
COMPRESS_ABOVE = 1024
#: zlib level 1: 20-40 µs a blob of 4-12 KB, within 10-20 % of level 6's size at a fifth of its time.
COMPRESS_LEVEL = 1


#: Seconds of spreading per rank and phase: the store gets at most 2,048 of the exchange's requests a
#: second, the rate that kept an unrelated store operation's p99 within 2 ms of idle (docs/capacity.md, section 5).
SPREAD_PER_RANK_S = 1 / 2048
#: The share of the agent's interval a pass may wait for its offsets: the rest of the pass must still end
#: before the next tick.
SPREAD_MAX_SHARE = 0.5
#: Below this window the ranks' requests go at once: a few at a time cost the store nothing measurable.
SPREAD_MIN_S = 0.001
#: Offsets of consecutive ranks: frac(rank x golden ratio), evenly spread for any number of ranks.
_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class Cadence:
    """How a job's ranks pace their exchange (``cadence``).

    ``window_s``: seconds of a pass over which the ranks' requests of one phase (publish, or read) are
    spread (0: all at once); ``polls``: the passes one phase spans; ``gap``: the fewest passes from one
    capture to the next (1: a pass may read the last exchange and publish the next, reads in the first
    window, publishes in the second); ``interval_s``: the effective exchange interval."""

    window_s: float
    polls: int
    gap: int
    interval_s: float

    def offset(self, rank: int) -> tuple[int, float]:
        """(pass after the phase's first, seconds after that pass's tick) of ``rank``'s request."""
        u = (rank * _GOLDEN) % 1.0 * self.polls
        k = min(int(u), self.polls - 1)
        return k, (u - k) * self.window_s


def cadence(ranks: int, exchange_s: float, interval_s: float) -> Cadence:
    """The exchange's pace for a job of ``ranks``, given ``detectors.exchange_s`` and the agent's interval.

    Each phase (every rank's publish; one poll later, every rank's read) is spread over
    S = ranks x ``SPREAD_PER_RANK_S`` (its figures: the store's peak rate stays at ~2,048 requests a
    second whatever the job's size). A pass waits at most ``SPREAD_MAX_SHARE`` of the interval, so past
    1,024 ranks (at 1 s) a phase spans p = ceil(S / (interval / 2)) passes of window S / p each, and the
    next capture waits for the reads of the last: the exchange interval grows to 2p passes (8,192 ranks:
    16 s instead of 3). A pass reads the last exchange and publishes the next only when both windows fit
    in its half (up to 512 ranks at 1 s); else an exchange is at its ``exchange_s`` slots only. Below
    ``SPREAD_MIN_S`` (2 ranks) nothing waits."""
    half = SPREAD_MAX_SHARE * interval_s
    spread = max(ranks, 1) * SPREAD_PER_RANK_S
    polls = max(1, math.ceil(spread / half - 1e-9))
    window = spread / polls if spread / polls >= SPREAD_MIN_S else 0.0
    gap = 1 if polls == 1 and 2 * window <= half else 2 * polls
    return Cadence(window, polls, gap, max(exchange_s, gap * interval_s))


def open_store(timeout_s: float = 5.0) -> Any:
    """A store client for the agent thread: our own TCPStore connection to MASTER_ADDR:MASTER_PORT
    (its own socket and timeout, so it neither contends with nor re-times the training thread's
    client), else the default process group's store, else None."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            return dist.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as exc:
            log.debug("hpar_agent: own TCPStore client failed (%s); using the default store", exc)
    return parallel.default_store()


# ------------------------------------------------------------------------------------------ peers
@dataclass(frozen=True)
class Grid:
    """Where every rank sits: mesh dim names, sizes and the ranks in row-major order (a DeviceMesh's
    ``mesh`` tensor flattened)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def row_major(cls, dims: Sequence[tuple[str, int]], base: int = 0) -> Grid:
        """Ranks ``base..`` laid out over ``dims`` (outermost first), as ``init_device_mesh`` does."""
        shape = tuple(size for _, size in dims)
        n = 1
        for s in shape:
            n *= s
        return cls(tuple(name for name, _ in dims), shape, tuple(range(base, base + n)))

    @classmethod
    def from_mesh(cls, mesh: Any, names: Sequence[str]) -> Grid:
        """A DeviceMesh's layout (unnamed dims are called ``dim<i>``)."""
        grid = mesh.mesh
        shape = tuple(int(s) for s in grid.shape)
        dims = tuple(names) if len(names) == len(shape) else tuple(f"dim{i}" for i in range(len(shape)))
        return cls(dims, shape, tuple(int(r) for r in grid.flatten().tolist()))

    def group(self, rank: int, dim: str) -> list[int]:
        """The ranks that differ from ``rank`` only on ``dim``, in that dim's order (``rank`` among them)."""
        axis = self.names.index(dim)
        pos = self.ranks.index(rank)
        stride = 1
        for s in self.shape[axis + 1 :]:
            stride *= s
        start = pos - ((pos // stride) % self.shape[axis]) * stride
        return [self.ranks[start + i * stride] for i in range(self.shape[axis])]


def select(
    members: Sequence[int],
    me: int,
    k: int = PEERS_PER_DIM,
    whole: int = WHOLE_GROUP,
    nodes: Iterable[int] = (NODE_RANKS,),
) -> list[int]:
    """The members of one group that ``me`` compares with: all of them in a group of up to ``whole``;
    else ``k`` spread evenly around the group, at +-n/(k/2+1), +-2n/(k/2+1), ... in the group's order
    (for ``k`` = 4: +-n/5 and +-2n/5), each moved up to the first offset that is not a whole number of
    nodes nor half a node (``unaligned``), the first also to an odd one and the second to an even one
    where they can: a fault on every other rank then splits each rank's five 3-2 (no culprit, a split)
    instead of 4-1 the wrong way, and the four peers sit on four other local indices, so a fault on
    one GPU of every node reaches a healthy rank's five once at most. Symmetric: a rank is read by the ranks it reads. Far apart: a
    block of up to n/5 contiguous ranks that is wrong together (a slow or miscompiled node) holds none
    of a member's peers, so each of its ranks is outvoted 4 to 1 by ranks outside it."""
    n = len(members)
    if n <= whole:
        return [m for m in members if m != me]
    i = members.index(me)
    pairs = max(1, k // 2)
    sizes, steps = tuple(nodes), list[int]()
    stride = _stride(members)
    for j in range(1, pairs + 1):
        base = j * n // (pairs * 2 + 1)
        found = unaligned(members, base, sizes, j % 2, steps, stride)  # odd, then even: see every-other
        steps.append(
            found if found is not None else unaligned(members, base, sizes, None, steps, stride) or base
        )
    offsets = [o for step in steps for o in (step, -step)]
    out: list[int] = []
    for o in offsets:
        peer = members[(i + o) % n]
        if peer != me and peer not in out:
            out.append(peer)
    return out


def unaligned(
    members: Sequence[int],
    offset: int,
    nodes: tuple[int, ...],
    parity: int | None = None,
    taken: Sequence[int] = (),
    stride: int | None = None,
) -> int | None:
    """``offset``, or the first of the next ones (up to two nodes on) by which no member of the group
    reaches a rank of the same local index (``rank % node``) on any node size in ``nodes``, nor of
    the index half a node away (so +offset and -offset reach two different local indices), and (with
    ``parity``) only ranks that far apart in that parity; None where none is. An offset that reaches
    the same peer as one ``taken`` (or itself backwards) is skipped. ``stride``: the members' rank
    step where they are evenly spaced (``_stride``), None where not. Why: at an offset that is a multiple of the node size (n/5 whenever n mod 40 is 0-4 with 8
    ranks a node) every peer uses the same local GPU index as the rank itself, and a fault on that one
    GPU of every node (a bad slot, a driver setting, a rank-dependent code path) would be outvoted by
    no one. A group whose members are all on the same local index (the dp group of dp x tp with tp a
    node) cannot avoid it."""
    n = len(members)
    nodes = tuple(size for size in nodes if size > 1)
    if (not nodes and parity is None) or n < 2:
        return offset
    for o in range(offset, min(offset + 2 * max((*nodes, 2)), n)):
        if 2 * o == n or any(o in (t, n - t) for t in taken):
            continue
        if stride is not None:
            apart = {o * stride, (o - n) * stride}  # without and with wrapping around the group's end
        else:
            apart = {members[(p + o) % n] - members[p] for p in range(n)}
        if all(2 * d % size for d in apart for size in nodes) and (
            parity is None or all(d % 2 == parity for d in apart)
        ):
            return o
    return None


def _stride(members: Sequence[int]) -> int | None:
    """The step between consecutive members where they are evenly spaced (a mesh dim's group), else None."""
    if isinstance(members, range):
        return members.step
    if len(members) < 2:
        return None
    step = members[1] - members[0]
    return step if list(members) == list(range(members[0], members[0] + len(members) * step, step)) else None


@dataclass(frozen=True)
class PeerPlan:
    """One rank's comparison peers by mesh dim (itself never among them), and in a job of up to
    ``WHOLE_GROUP`` ranks every other rank (``world``: their ``s`` is read too, so a hang's culprit on
    another dim or stage is seen); in a pure pipeline of more stages, the stages ``select`` picks (their
    ``s`` holds their own work a step, which a slow stage is judged against)."""

    rank: int
    groups: Mapping[str, tuple[int, ...]]
    world: tuple[int, ...] = ()

    @property
    def peers(self) -> list[int]:
        return sorted({r for g in self.groups.values() for r in g})

    def wants(self, reads: Mapping[str, str] = READS) -> dict[str, list[int]]:
        """purpose -> the ranks to read it from (``READS``: every peer, or one dim's)."""
        out = {}
        for purpose, dim in reads.items():
            ranks = self.peers if dim == "*" else list(self.groups.get(dim, ()))
            if purpose == "s" and self.world:
                ranks = sorted({*ranks, *self.world})
            if ranks:
                out[purpose] = ranks
        return out


def plan(
    grid: Grid,
    rank: int,
    k: int = PEERS_PER_DIM,
    skip: Iterable[str] = ("pp",),
    nodes: Iterable[int] = (NODE_RANKS,),
) -> PeerPlan:
    """``rank``'s comparison peers along every dim of ``grid`` but ``skip`` (see the module doc), none
    of them a whole number of ``nodes`` (sizes of a node in ranks) away where the group allows."""
    if rank not in grid.ranks:
        return PeerPlan(rank, {})
    skipped = set(skip)
    sizes = tuple(nodes)
    groups = {
        dim: tuple(select(grid.group(rank, dim), rank, k, nodes=sizes))
        for dim, size in zip(grid.names, grid.shape, strict=True)
        if size > 1 and dim not in skipped
    }
    world = tuple(r for r in grid.ranks if r != rank) if len(grid.ranks) <= WHOLE_GROUP else ()
    if not world and not groups and "pp" in grid.names:
        # a pure pipeline past WHOLE_GROUP stages: the stages ``select`` picks, for their ``s`` (each
        # stage's own work a step, against which Straggler judges a stage that became slower)
        world = tuple(select(grid.group(rank, "pp"), rank, k, nodes=sizes))
    return PeerPlan(rank, groups, world)


def node_sizes(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The node sizes peer offsets avoid: ``NODE_RANKS`` and the launcher's ``LOCAL_WORLD_SIZE``."""
    env = os.environ if environ is None else environ
    try:
        local = int(env.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        local = 0
    return tuple(sorted({NODE_RANKS, *((local,) if local > 1 else ())}))


# ------------------------------------------------------------------------------------------ store
class Exchange:
    """One rank's view of the exchange: ``publish`` its parts, ``read`` the peers'.

    ``bytes_out`` / ``bytes_in`` count the payload bytes this rank set and got (keys not counted),
    ``largest_out`` the most one publish set."""

    def __init__(self, store: Any, job: str, rank: int) -> None:
        self.store = store
        self.prefix = f"hpar/{job}/x/"
        self.rank = rank
        self.published = 0
        self.max_bytes = 1 << 20  # a blob's most bytes, uncompressed
        self.bytes_out = 0
        self.bytes_in = 0
        self.largest_out = 0  # the most bytes one publish set
        self.own: dict[str, dict[str, Any]] = {}  # purpose -> what this rank last set, as a reader decodes it
        self._sent: dict[str, str] = {}  # purpose -> its last body as set (without the publish time)
        self._seen: set[str] = set()  # peers' keys known to exist

    def key(self, purpose: str, rank: int) -> str:
        return f"{self.prefix}{purpose}/{rank}"

    def publish(self, parts: Mapping[str, Mapping[str, Any]], always: Iterable[str] = EVERY_EXCHANGE) -> int:
        """Set each purpose's blob in one round trip: those in ``always`` every time, the others only
        when their content changed. Returns the bytes set. After a failed set, the next publish sets
        every purpose again (those set only when changed would be lost until they change)."""
        try:
            return self.send(self.encode(parts, always))
        except Exception:
            self._sent.clear()
            raise

    def encode(
        self, parts: Mapping[str, Mapping[str, Any]], always: Iterable[str] = EVERY_EXCHANGE
    ) -> list[tuple[str, bytes]]:
        """``publish``'s (key, blob) pairs, stamped with the time now, compressed over ``COMPRESS_ABOVE``
        bytes; what is encoded counts as sent."""
        every = set(always)
        now = time.time()
        out = []
        for purpose, part in parts.items():
            body = json.dumps(part, separators=(",", ":"))
            if purpose not in every and self._sent.get(purpose) == body:
                continue
            data = f'{{"t":{now!r}' + ("}" if body == "{}" else "," + body[1:])
            if len(data) > self.max_bytes:
                raise ValueError(
                    f"exchange payload {purpose!r} of {len(data)} bytes exceeds {self.max_bytes}"
                )
            blob = data.encode()
            if len(blob) > COMPRESS_ABOVE:
                blob = zlib.compress(blob, COMPRESS_LEVEL)
            out.append((self.key(purpose, self.rank), blob))
            self._sent[purpose] = body
            self.own[purpose] = json.loads(data)
        return out

    def send(self, items: Sequence[tuple[str, str | bytes]]) -> int:
        """Set encoded blobs in one round trip; the bytes set."""
        if not items:
            return 0
        keys, values = [k for k, _ in items], [v for _, v in items]
        if hasattr(self.store, "multi_set"):
            self.store.multi_set(keys, values)
        else:  # pragma: no cover - stores without multi_set
            for k, v in items:
                self.store.set(k, v)
        self.published += 1
        sent = sum(len(v) for v in values)
        self.bytes_out += sent
        self.largest_out = max(self.largest_out, sent)
        return sent

    def read(
        self, wants: Mapping[str, Iterable[int]], max_age_s: Mapping[str, float] | None = None
    ) -> dict[str, dict[int, dict[str, Any]]]:
        """purpose -> rank -> blob, for the wanted blobs that exist (and are younger than
        ``max_age_s[purpose]`` where given); this rank's own are left out. Never waits for a key."""
        return self.decode(self.fetch(wants), max_age_s)

    def fetch(self, wants: Mapping[str, Iterable[int]]) -> list[tuple[tuple[str, int], bytes]]:
        """((purpose, rank), blob) of the wanted blobs that exist, in one ``multi_get``. Keys not seen
        yet are ``check``ed first (one round trip when all exist, else one per key); a key seen once
        stays (keys are overwritten, never deleted), so a steady exchange is one round trip."""
        pairs = [(p, r) for p, ranks in wants.items() for r in dict.fromkeys(ranks) if r != self.rank]
        keys = [self.key(p, r) for p, r in pairs]
        new = [k for k in keys if k not in self._seen]
        if new and self.store.check(new):
            self._seen.update(new)
        elif new:
            self._seen.update(k for k in new if self.store.check([k]))
        present = [(pr, k) for pr, k in zip(pairs, keys, strict=True) if k in self._seen]
        if not present:
            return []
        if hasattr(self.store, "multi_get"):
            raw = self.store.multi_get([k for _, k in present])
        else:  # pragma: no cover - stores without multi_get
            raw = [self.store.get(k) for _, k in present]
        out = [(pr, bytes(blob)) for (pr, _), blob in zip(present, raw, strict=True)]
        self.bytes_in += sum(len(b) for _, b in out)
        return out

    def decode(
        self, raw: Iterable[tuple[tuple[str, int], bytes]], max_age_s: Mapping[str, float] | None = None
    ) -> dict[str, dict[int, dict[str, Any]]]:
        """``fetch``'s blobs decoded, those older than ``max_age_s[purpose]`` (where given) and malformed
        ones left out."""
        now = time.time()
        ages = max_age_s or {}
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for (purpose, r), data in raw:
            gil.pause_point()  # a peer's fr blob is a few hundred µs of decoding
            payload = unpack(data, self.max_bytes)
            if not isinstance(payload, dict):
                continue
            limit = ages.get(purpose)
            if limit is None or now - float(payload.get("t", 0)) <= limit:
                out.setdefault(purpose, {})[r] = payload
        return out


def unpack(data: bytes, limit: int) -> Any:
    """A blob's JSON value, from plain JSON or zlib-compressed JSON (``Exchange.encode``); None where it
    is malformed or inflates past ``limit`` bytes (a corrupt or foreign value never costs more)."""
    if data[:1] != b"{":
        inflate = zlib.decompressobj()
        try:
            data = inflate.decompress(data, limit + 1)
        except zlib.error:
            return None
        if not inflate.eof or len(data) > limit:
            return None
    try:
        return json.loads(data)
    except ValueError:
        return None
