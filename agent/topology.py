"""Where this rank sits: rank, world, host, job id and its dp/tp/pp coordinates.

Read from, in order: the ``mesh`` argument, the model (DTensor parameters' mesh, a PipelineStage or its
submodule, a DDP/replicate process group), then ``HPAR_*`` overrides. Works without torch.distributed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpar_agent.config import AgentConfig

_MESH_DIMS = ("dp", "tp", "pp")

log = logging.getLogger("hpar_agent")
JOB_ID_KEY = "hpar/job_id"


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


def _mesh_from_model(model: Any) -> Any:
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


def _stage_index(model: Any) -> int | None:
    """Stage index from a PipelineStage, or a submodule a PipelineStage was built from."""
    idx = getattr(model, "stage_index", None)
    if isinstance(idx, int):
        return idx
    return None


def _dp_group_size(model: Any) -> int | None:
    pg = getattr(model, "process_group", None)  # DistributedDataParallel
    if pg is not None and dist.is_initialized():
        try:
            return dist.get_world_size(pg)
        except Exception:
            return None
    return None


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
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
            got = store.compare_set(JOB_ID_KEY, "", uuid.uuid4().hex[:12])
            return _safe_id(got.decode() if isinstance(got, bytes) else str(got))
        except Exception as exc:  # a store without compare_set: ids derived from the rendezvous
            log.debug("hpar_agent: job id from the store failed (%s)", exc)
            addr = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            if addr != ":":
                return "job-" + hashlib.sha256(addr.encode()).hexdigest()[:12]
    return f"local-{uuid.uuid4().hex[:8]}"


def _safe_id(raw: str) -> str:
    """Ids name the run directory: anything but ``[A-Za-z0-9._-]`` becomes ``_``, no leading dot."""
    out = re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:128].lstrip(".") or "job"
    return out


def _warn_stage(stage: int, pp: int) -> None:
    log.warning("hpar_agent: ignoring pp_stage=%d (must be < %d); using the detected stage", stage, pp)


def detect(model: Any = None, mesh: Any = None, config: AgentConfig | None = None) -> Topology:
    """Build this rank's Topology; never raises for a missing source, falls back to env and 1s."""
    config = config or AgentConfig()
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else _env_int("RANK", 0)
    world = dist.get_world_size() if initialized else _env_int("WORLD_SIZE", 1)
    coords = {d: (1, 0) for d in _MESH_DIMS}  # dim -> (degree, coordinate)
    mesh = mesh if mesh is not None else _mesh_from_model(model)
    if mesh is not None and getattr(mesh, "mesh_dim_names", None):
        for i, name in enumerate(mesh.mesh_dim_names):
            if name in coords:
                coords[name] = (mesh.size(i), mesh.get_local_rank(i))
    elif (dp := _dp_group_size(model)) is not None:
        coords["dp"] = (dp, rank % dp)
    degree = {d: getattr(config, d) or coords[d][0] for d in _MESH_DIMS}
    stage = config.pp_stage
    if stage is None:
        stage = _stage_index(model)
    pp_known = config.pp is not None or coords["pp"][0] > 1
    limit = degree["pp"] if pp_known else world  # a stage beyond the pipeline (or the job) is a typo
    if stage is not None and stage >= limit:
        _warn_stage(stage, limit)
        stage = None
    if stage is None:
        stage = coords["pp"][1]
    backend = dist.get_backend() if initialized else "none"
    return Topology(
        rank=rank,
        world_size=world,
        local_rank=_env_int("LOCAL_RANK", 0),
        host=socket.gethostname(),
        job_id=_job_id(config),
        dp=degree["dp"],
        tp=degree["tp"],
        pp=degree["pp"],
        dp_rank=coords["dp"][1],
        tp_rank=coords["tp"][1],
        pp_rank=coords["pp"][1],
        pp_stage=stage,
        backend=str(backend),
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
