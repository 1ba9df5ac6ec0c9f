"""Where this rank sits: rank, world, host, job id and its dp/tp/pp coordinates.

Read from, in order: the ``mesh`` argument, the model (DTensor parameters' mesh, a PipelineStage or its
submodule, a DDP/replicate process group), the pipeline stages this rank built or runs (``stages``), then
``HPAR_*`` overrides. Works without torch.distributed.

A pipeline without a mesh says pp (its group's size), this rank's pp coordinate (its rank in that group)
and its stages; ``pp_stage`` is the rank's first stage (with several stages a rank, as interleaved and V
schedules place them, its rank in the pipeline group). Without a mesh or a data-parallel wrapper the
ranks outside one pipeline are its replicas: dp = world / pp, and the rank's dp coordinate is its
pipeline's place among them.

Mesh dimensions use torchtitan's names: ``dp_replicate`` (DDP/replicate, HSDP's outer dim), ``dp_shard``
(FSDP), ``cp``, ``tp``, ``pp``, and flattened ones (``dp`` = dp_replicate x dp_shard, ``dp_shard_cp``,
``dp_cp``). A dim named plain ``dp`` is read as dp_shard when parameters are ``Shard`` on it (FSDP over a
``dp`` mesh) and as dp_replicate otherwise; an unnamed FSDP mesh is named by its parameters' placements.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import socket
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpar_agent.config import AgentConfig
from hpar_agent.torch_compat import flight_recorder, parallel, pipelining
from hpar_agent.torch_compat.fr_decode import DIM_ALIASES

_MESH_DIMS = ("dp", "tp", "pp")
#: Atomic data/context/model-parallel dims (torchtitan's names), outermost first.
ATOMIC_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
#: Flattened dims -> the atomic dims they span.
FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}

#: Every dim name the topology reads; a mesh dim of another name is warned about once.
KNOWN_DIMS = frozenset({*ATOMIC_DIMS, *FLATTENED_DIMS, "dp"})
_warned_dims: set[str] = set()

log = logging.getLogger("hpar_agent")
JOB_ID_KEY = "hpar/job_id"
#: A job id decided without any peer (no process group yet): a re-detection decides it again.
LOCAL_JOB_PREFIX = "local-"


@dataclass(frozen=True)
class Topology:
    """Static identity of this rank; what ``hpar_rank_info`` and the OTel Resource carry."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host: str = ""
    job_id: str = ""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    pp_stage: int = 0
    backend: str = "none"
    device: str = "cpu"
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    dp_replicate_rank: int = 0
    dp_shard_rank: int = 0
    cp_rank: int = 0
    mesh_dims: str = ""
    """The mesh as read, ``name=size`` comma-separated in mesh order (empty without a named mesh)."""
    pp_stages: str = ""
    """The pipeline stages this rank runs, comma-separated (empty where no stage was seen)."""

    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every atomic dim (dp_replicate, dp_shard, cp, tp, pp)."""
        out = {d: getattr(self, f"{d}_rank") for d in ATOMIC_DIMS}
        if self.dp_rank and not (
            self.dp_replicate_rank or self.dp_shard_rank
        ):  # dp set alone (HPAR_*, tests)
            out["dp_replicate"] = self.dp_rank
        return out

    def info_labels(self) -> dict[str, str]:
        d = asdict(self)
        d.pop("rank")
        d.pop("pp_stage")
        return {k: str(v) for k, v in d.items()}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def mesh_from_model(model: Any) -> Any:
    """The DeviceMesh of the first DTensor parameter, if any."""
    if model is None or not hasattr(model, "parameters"):
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def _shard_dim_names(model: Any) -> set[str]:
    """Names of the mesh dims some DTensor parameter is ``Shard`` on (its placements)."""
    sharded: set[str] = set()
    if model is None or not hasattr(model, "parameters"):
        return sharded
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return sharded
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        for i, pl in enumerate(p.placements):
            if parallel.is_shard(pl):
                sharded.add(DIM_ALIASES.get(names[i], names[i]) if i < len(names) else f"#{i}")
    return sharded


def mesh_dim_names(mesh: Any, model: Any = None) -> tuple[str, ...]:
    """The mesh's dim names (``DIM_ALIASES`` read as the dims they are); an unnamed mesh of an FSDP
    model is named by placement: 1-D -> dp_shard, 2-D (HSDP) -> (dp_replicate, dp_shard), of a
    ``replicate`` model 1-D -> dp_replicate; other unnamed meshes -> ()."""
    names = tuple(DIM_ALIASES.get(n, n) for n in getattr(mesh, "mesh_dim_names", None) or ())
    if names or mesh is None:
        return names
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return ()
    mods = [model, *getattr(model, "modules", list)()]
    replicated = parallel.replicate_module_class()
    if replicated is not None and any(isinstance(m, replicated) for m in mods):  # an FSDPModule too
        return {1: ("dp_replicate",)}.get(mesh.ndim, ())
    if any(isinstance(m, FSDPModule) for m in mods):
        return {1: ("dp_shard",), 2: ("dp_replicate", "dp_shard")}.get(mesh.ndim, ())
    return ()


def _atomic_coords(dims: dict[str, tuple[int, int]], sharded: set[str]) -> dict[str, tuple[int, int]]:
    """(size, coordinate) of every atomic dim from the named dims read (flattened ones fill the atomic
    dims they span when those are not named themselves)."""
    out = {d: dims[d] for d in ATOMIC_DIMS if d in dims}
    if "dp" in dims and "dp_replicate" not in out and "dp_shard" not in out:
        out["dp_shard" if "dp" in sharded else "dp_replicate"] = dims["dp"]
    for flat, parts in FLATTENED_DIMS.items():
        if flat in dims and flat != "dp" and not any(p in out for p in parts):
            out[parts[0] if parts[0] != "dp_replicate" else "dp_shard"] = dims[flat]
    return {d: out.get(d, (1, 0)) for d in ATOMIC_DIMS}


def _stage_index(model: Any) -> int | None:
    """Stage index from a PipelineStage, or a submodule a PipelineStage was built from."""
    idx = getattr(model, "stage_index", None)
    if isinstance(idx, int):
        return idx
    return None


def _dp_group(model: Any) -> tuple[int, int] | None:
    """(size, this rank's place) of a DistributedDataParallel's process group."""
    pg = getattr(model, "process_group", None)
    if pg is not None and dist.is_initialized():
        try:
            return dist.get_world_size(pg), dist.get_rank(pg)
        except Exception:
            return None
    return None


@dataclass(frozen=True)
class _Pipeline:
    size: int
    rank: int  # this rank's place in the pipeline group
    stages: tuple[int, ...]
    replica: int | None  # the pipeline's place among the job's pipelines (None: unknown)


def _pipeline(stages: Sequence[Any], world: int) -> _Pipeline | None:
    """What this rank's stages say: all on one group (``topology_watch.stages``)."""
    infos = [i for i in (pipelining.stage_info(s) for s in stages) if i is not None]
    if not infos:
        return None
    first = infos[0]
    size = first.group_size
    return _Pipeline(
        size,
        first.group_rank,
        tuple(sorted({i.index for i in infos})),
        replica(first.group_ranks, size, world),
    )


def replica(ranks: Sequence[int], pp: int, world: int) -> int | None:
    """The place of the pipeline whose members are ``ranks`` among the job's ``world / pp`` pipelines,
    the members of each an arithmetic progression (``rank = replica * pp + stage``: [2, 3] of 4 ranks
    is pipeline 1; ``rank = stage * dp + replica``: [1, 3] is pipeline 1); None for another layout."""
    r = sorted(ranks)
    if len(r) != pp or pp < 1 or world % pp or r[-1] >= world:
        return None
    stride = r[1] - r[0] if pp > 1 else 1
    if stride < 1 or any(b - a != stride for a, b in itertools.pairwise(r)):
        return None
    out = (r[0] // (stride * pp)) * stride + r[0] % stride
    return out if out < world // pp else None


def _job_id(config: AgentConfig) -> str:
    """The same id on every rank, without waiting on any peer.

    ``job_id`` / ``HPAR_JOB_ID`` first, then torchrun's run id. Else one ``compare_set`` on the job's
    store: the first rank to arrive writes its candidate, every later rank gets that value back in the
    same round trip. Unlike ``store.get`` (which blocks until rank 0 has written, up to the store
    timeout), nothing here waits for a peer that attaches late. Without a store: a local id.
    """
    if config.job_id:
        return config.job_id
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return _safe_id(run_id)
    if dist.is_available() and dist.is_initialized():
        try:
            store = parallel.default_store()
            got = store.compare_set(JOB_ID_KEY, "", uuid.uuid4().hex[:12])
            return _safe_id(got.decode() if isinstance(got, bytes) else str(got))
        except Exception as exc:  # a store without compare_set: ids derived from the rendezvous
            log.debug("hpar_agent: job id from the store failed (%s)", exc)
            addr = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            if addr != ":":
                return "job-" + hashlib.sha256(addr.encode()).hexdigest()[:12]
    return f"{LOCAL_JOB_PREFIX}{uuid.uuid4().hex[:8]}"


def _safe_id(raw: str) -> str:
    """Ids name the run directory: anything but ``[A-Za-z0-9._-]`` becomes ``_``, no leading dot."""
    out = re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:128].lstrip(".") or "job"
    return out


def _warn_stage(stage: int, pp: int) -> None:
    log.warning("hpar_agent: ignoring pp_stage=%d (must be < %d); using the detected stage", stage, pp)


def detect(
    model: Any = None,
    mesh: Any = None,
    config: AgentConfig | None = None,
    *,
    job_id: str | None = None,
    stages: Sequence[Any] = (),
) -> Topology:
    """Build this rank's Topology; never raises for a missing source, falls back to env and 1s.
    ``job_id``: keep this one (a re-detection) instead of deciding it again. ``stages``: the pipeline
    stages this rank built or runs."""
    config = config or AgentConfig()
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else _env_int("RANK", 0)
    world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
    coords = {d: (1, 0) for d in _MESH_DIMS}  # dim -> (degree, coordinate)
    mesh = mesh if mesh is not None else mesh_from_model(model)
    names = mesh_dim_names(mesh, model)
    for name in set(names) - KNOWN_DIMS - _warned_dims:
        _warned_dims.add(name)
        log.warning(
            "hpar_agent: mesh dim %r is none of %s (nor %s): its degree counts in no label; name the "
            "dims so, or set HPAR_DP / HPAR_TP / HPAR_PP",
            name,
            ", ".join(sorted(KNOWN_DIMS)),
            ", ".join(sorted(DIM_ALIASES)),
        )
    dims: dict[str, tuple[int, int]] = {}
    try:
        dims = {name: (mesh.size(i), mesh.get_local_rank(i)) for i, name in enumerate(names)}
    except Exception:  # a mesh this rank is not part of
        dims = {}
    atomic = {d: (1, 0) for d in ATOMIC_DIMS}
    if dims:
        sharded = _shard_dim_names(model)
        if not getattr(mesh, "mesh_dim_names", None):  # named by placement above
            sharded |= {n for n in names if n == "dp_shard"}
        atomic = _atomic_coords(dims, sharded)
        (rs, rr), (ss, sr) = atomic["dp_replicate"], atomic["dp_shard"]
        coords["dp"] = dims.get("dp", (rs * ss, rr * ss + sr))
        coords["tp"], coords["pp"] = atomic["tp"], atomic["pp"]
    elif (dp := _dp_group(model)) is not None:
        coords["dp"] = atomic["dp_replicate"] = dp
    pipe = _pipeline([*stages, model] if _stage_index(model) is not None else stages, world)
    if pipe is not None and coords["pp"][0] == 1 and pipe.size > 1:
        coords["pp"] = atomic["pp"] = (pipe.size, pipe.rank)
        tp = config.tp or coords["tp"][0]
        if coords["dp"][0] == 1 and tp == 1 and pipe.replica is not None and world > pipe.size:
            coords["dp"] = atomic["dp_replicate"] = (world // pipe.size, pipe.replica)  # its replicas
    degree = {d: getattr(config, d) or coords[d][0] for d in _MESH_DIMS}
    stage = config.pp_stage
    if stage is None and pipe is not None:
        stage = pipe.stages[0] if pipe.stages[0] < pipe.size else pipe.rank
    if stage is None:
        stage = _stage_index(model)
    pp_known = config.pp is not None or coords["pp"][0] > 1
    limit = degree["pp"] if pp_known else world  # a stage beyond the pipeline (or the job) is a typo
    if stage is not None and stage >= limit:
        _warn_stage(stage, limit)
        stage = None
    if stage is None:
        stage = coords["pp"][1]
    backend = flight_recorder.group_backend(None) if initialized else "none"
    return Topology(
        rank=rank,
        world_size=world,
        local_rank=_env_int("LOCAL_RANK", 0),
        host=socket.gethostname(),
        job_id=job_id or _job_id(config),
        dp=degree["dp"],
        tp=degree["tp"],
        pp=degree["pp"],
        dp_rank=coords["dp"][1],
        tp_rank=coords["tp"][1],
        pp_rank=coords["pp"][1],
        pp_stage=stage,
        backend=str(backend),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dp_replicate=atomic["dp_replicate"][0],
        dp_shard=atomic["dp_shard"][0],
        cp=atomic["cp"][0],
        dp_replicate_rank=atomic["dp_replicate"][1],
        dp_shard_rank=atomic["dp_shard"][1],
        cp_rank=atomic["cp"][1],
        mesh_dims=",".join(f"{n}={dims[n][0]}" for n in names if n in dims),
        pp_stages=",".join(map(str, pipe.stages)) if pipe is not None else "",
    )
