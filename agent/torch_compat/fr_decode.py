"""Decoding of c10d flight-recorder (FR) entries and ``pg_status``: pure functions of what
``flight_recorder.dump`` returns, so they are tested on entry dicts and change with torch's spellings only.

An entry (torch 2.11 CUDA, 2.13 CPU) holds ``record_id``, ``pg_id``, ``process_group`` [name, desc],
``collective_seq_id`` / ``p2p_seq_id`` / ``is_p2p``, ``profiling_name`` (``"nccl:all_reduce"``; NCCL p2p
as ``"nccl:send 0->1"`` / ``"nccl:recv 1<-0"`` in group ranks, a batch closed by ``"nccl:coalesced"``),
``input_sizes``/``input_dtypes``/``output_sizes``/``output_dtypes``, ``time_created_ns``, ``state``,
``duration_ms`` (NCCL with timing) and ``timeout_ms``.
"""

from __future__ import annotations

import re
from typing import Any

#: profiling_name suffixes (c10d spellings across backends/versions) -> the ``op`` label.
_OP_ALIASES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
    "barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "coalesced": "coalesced",
    # torch >= 2.13 spellings FSDP2 calls (reduce_scatter_single / all_gather_single)
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "all_gather_single": "all_gather",
    "allgather_single": "all_gather",
}
#: FR scalar-type names (c10 ScalarType spelling) -> element size in bytes.
DTYPE_BYTES: dict[str, int] = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "ComplexHalf": 4,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "Float8_e4m3fnuz": 1,
    "Float8_e5m2fnuz": 1,
    "UInt16": 2,
    "UInt32": 4,
    "UInt64": 8,
}
#: Timestamps above this are epoch nanoseconds; below, a monotonic clock (not comparable with attach time).
EPOCH_2001_NS = 978_307_200 * 10**9
#: nccl-tests bus-bandwidth factors as functions of the group size n.
_BUSBW: dict[str, Any] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}
#: Ops whose input elements count as gradients reduced (gloo records reduce_scatter_tensor as all_reduce).
REDUCE_OPS = frozenset(("all_reduce", "reduce_scatter"))
_P2P_PEER = re.compile(r"(?:->|<-)\s*(\d+)")
UNKNOWN_PG = "unknown"
OTHER = "other"


def op_label(profiling_name: str) -> str:
    """``"gloo:all_reduce"`` -> ``"all_reduce"``; unknown names -> ``"other"`` (bounded label)."""
    base = str(profiling_name).rsplit(":", 1)[-1].strip().lower()
    base = base.split(" ", 1)[0]  # NCCL p2p: "nccl:send 0->1", "nccl:recv 1<-0" (group ranks)
    return _OP_ALIASES.get(base, OTHER)


def p2p_peer(profiling_name: str) -> int | None:
    """The group-local peer of an NCCL p2p entry: ``"nccl:send 0->1"`` -> 1, ``"nccl:recv 1<-0"`` -> 0."""
    m = _P2P_PEER.search(str(profiling_name))
    return int(m.group(1)) if m else None


#: Mesh dim names torch gives the meshes it makes itself (``replicate``'s default mesh), and the other
#: names programs give them (Megatron's data, tensor, pipeline, context; "model" for tensor parallel)
#: -> the dims they are (torchtitan's names), for the topology and the groups' labels alike.
DIM_ALIASES = {
    "replicate": "dp_replicate",
    "shard": "dp_shard",
    "data": "dp",
    "model": "tp",
    "tensor": "tp",
    "pipeline": "pp",
    "pipe": "pp",
    "context": "cp",
}


def pg_label(name: str, desc: str) -> str:
    """FR ``process_group`` [name, desc] -> ``pg``: mesh_dp -> dp (mesh_data -> dp: ``DIM_ALIASES``),
    default_pg, else a short key."""
    desc = str(desc or "")
    if desc.startswith("mesh_") and len(desc) > 5:
        desc = DIM_ALIASES.get(desc[5:], desc[5:])
    if desc in ("", "undefined"):
        return f"pg{name}" if name != "" else UNKNOWN_PG
    return re.sub(r"[^a-zA-Z0-9_]", "_", desc)[:32]


def entry_group(e: dict[str, Any]) -> tuple[str, str]:
    """(name, desc) of an entry's process group ("" for what the entry lacks)."""
    name, desc = [*(e.get("process_group") or ()), "", ""][:2]
    return str(name), str(desc)


def entry_seq(e: dict[str, Any], is_p2p: bool) -> int:
    """The entry's sequence number in its group: p2p and collectives count separately."""
    return int(e.get("p2p_seq_id" if is_p2p else "collective_seq_id", 0) or 0)


def duration_s(e: dict[str, Any]) -> float | None:
    """The entry's duration in seconds; None when it carries none (gloo, untimed NCCL, not retired yet)."""
    d = e.get("duration_ms")
    return None if d is None else float(d) / 1e3


def is_epoch_ns(t_ns: int) -> bool:
    """Whether an FR timestamp is on the epoch clock (comparable with ``time.time_ns()``)."""
    return t_ns > EPOCH_2001_NS


def entry_backend(profiling_name: str, recorder: str) -> str:
    """``"nccl"`` for entries of the NCCL recorder or with an ``nccl:`` name, else ``"gloo"``."""
    return "nccl" if profiling_name.startswith("nccl:") or recorder == "nccl" else "gloo"


def entry_bytes(sizes: Any, dtypes: Any) -> int:
    """Sum over tensors of numel x element size (FR ``input_sizes``/``input_dtypes``)."""
    total = 0
    for shape, dtype in zip(sizes or (), dtypes or (), strict=False):
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel * DTYPE_BYTES.get(str(dtype), 0)
    return total


def entry_numel(sizes: Any) -> int:
    """Elements over the tensors of an FR ``input_sizes`` (dtype-free: a bf16-compressed bucket counts
    the same elements as its fp32 gradients)."""
    total = 0
    for shape in sizes or ():
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel
    return total


def busbw_factor(op: str, n: int | None) -> float | None:
    """nccl-tests factor: all_reduce 2(n-1)/n, all_gather/reduce_scatter (n-1)/n, p2p 1."""
    f = _BUSBW.get(op)
    if f is None or (op not in ("send", "recv") and (not n or n < 1)):
        return None
    return float(f(n or 1))


def busbw(op: str, data_bytes: int, seconds: float, n: int | None) -> float | None:
    """Bus bandwidth in bytes/s; ``data_bytes`` is nccl-tests' size (the larger of in and out)."""
    factor = busbw_factor(op, n)
    if factor is None or seconds <= 0:
        return None
    return data_bytes / seconds * factor


def stuck(status: dict[str, Any], before: dict[str, Any] | None) -> bool:
    """A group's op that was in flight at the previous probe still is, with no completion in between
    (``pg_status`` of two probes)."""
    for pg_id, st in status.items():
        prev = (before or {}).get(pg_id)
        if prev is None:
            continue
        done = st.get("last_completed_collective", -1)
        if prev.get("last_enqueued_collective", -1) > done == prev.get("last_completed_collective", -1):
            return True
    return False
