"""Flight-recorder decoding on entry dicts shaped like torch's (``torch_compat.fr_decode``)."""

from __future__ import annotations

import time

import pytest

from hpar_agent.torch_compat import fr_decode as d

MIB4 = 1 << 20  # float32 elements in 4 MiB


def _entry(rid: int, name: str, **kw) -> dict:
    """One FR entry with the keys ``_dump_nccl_trace`` returns (stack traces never requested)."""
    e = {
        "record_id": rid,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": 0,
        "p2p_seq_id": 0,
        "op_id": rid,
        "profiling_name": name,
        "time_created_ns": time.time_ns(),
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "input_sizes": [],
        "input_dtypes": [],
        "output_sizes": [],
        "output_dtypes": [],
        "state": "completed",
        "duration_ms": None,
        "is_p2p": False,
        "retired": True,
        "timeout_ms": 600000,
    }
    e.update(kw)
    return e


def test_op_and_pg_labels():
    assert d.op_label("gloo:all_reduce") == "all_reduce"
    assert d.op_label("nccl:_allgather_base") == "all_gather"
    assert d.op_label("nccl:reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert d.op_label("nccl:send 0->1") == "send"  # NCCL p2p names carry group ranks
    assert d.op_label("nccl:recv 1<-0") == "recv"
    assert d.p2p_peer("nccl:send 0->1") == 1 and d.p2p_peer("nccl:recv 1<-0") == 0
    assert d.op_label("nccl:something new") == "other"  # free text never becomes a label
    assert d.op_label("nccl:reduce_scatter_single") == "reduce_scatter"  # torch >= 2.13 (FSDP2)
    assert d.p2p_peer("gloo:all_reduce") is None
    assert d.pg_label("1", "mesh_dp") == "dp"
    assert d.pg_label("3", "mesh_tp") == "tp"
    assert (d.pg_label("4", "mesh_data"), d.pg_label("5", "mesh_model")) == (
        "dp",
        "tp",
    )  # Megatron-style names
    assert d.pg_label("0", "default_pg") == "default_pg"
    assert d.pg_label("7", "undefined") == "pg7"
    assert d.pg_label("8", "my group/1") == "my_group_1"
    assert d.pg_label("", "") == d.UNKNOWN_PG


def test_bytes_and_busbw_factors():
    assert d.entry_bytes([[4, 2], [3]], ["Float", "BFloat16"]) == 8 * 4 + 3 * 2
    assert d.entry_bytes([[5]], ["SomeNewType"]) == 0  # unknown dtype: no guess
    assert d.entry_numel([[4, 2], [3]]) == 11  # dtype-free (bf16-compressed buckets count elements)
    assert d.busbw_factor("all_reduce", 4) == pytest.approx(1.5)
    assert d.busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert d.busbw_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert d.busbw_factor("broadcast", 8) == 1.0
    assert d.busbw_factor("send", None) == 1.0
    assert d.busbw_factor("barrier", 4) is None
    assert d.busbw_factor("all_reduce", None) is None  # group size unknown: no number
    assert d.busbw("all_reduce", 1000, 0.001, 2) == pytest.approx(1e6)
    assert d.busbw("all_reduce", 1000, 0.0, 2) is None


def test_nccl_p2p_batch_as_the_raw_recorder_holds_it():
    """As two H200s recorded it: a ``batch_isend_irecv`` is ``nccl:send 0->1`` and
    ``nccl:recv 0<-1`` (``is_p2p``, 4 MiB each, ``scheduled``, no duration) then one ``nccl:coalesced``
    entry (0 bytes, ``completed``, ``duration_ms`` 0.09)."""
    f32 = {"input_dtypes": ["Float"], "output_dtypes": ["Float"]}
    send = _entry(
        0,
        "nccl:send 0->1",
        is_p2p=True,
        p2p_seq_id=1,
        state="scheduled",
        input_sizes=[[MIB4]],
        output_sizes=[[MIB4]],
        **f32,
    )
    recv = _entry(
        1,
        "nccl:recv 0<-1",
        is_p2p=True,
        p2p_seq_id=2,
        state="scheduled",
        input_sizes=[[MIB4]],
        output_sizes=[[MIB4]],
        **f32,
    )
    coalesced = _entry(2, "nccl:coalesced", collective_seq_id=1, duration_ms=0.09)
    got = [
        (
            d.op_label(e["profiling_name"]),
            d.p2p_peer(e["profiling_name"]),
            d.entry_seq(e, e["is_p2p"]),
            d.entry_bytes(e["input_sizes"], e["input_dtypes"]),
            d.duration_s(e),
        )
        for e in (send, recv, coalesced)
    ]
    assert got == [
        ("send", 1, 1, 4 << 20, None),
        ("recv", 1, 2, 4 << 20, None),
        ("coalesced", None, 1, 0, pytest.approx(0.09e-3)),
    ]
    assert d.busbw("send", 4 << 20, 0.09e-3, None) == pytest.approx((4 << 20) / 0.09e-3)
    assert {d.entry_group(e) for e in (send, recv, coalesced)} == {("0", "default_pg")}
    assert (
        d.entry_backend("nccl:send 0->1", "gloo") == "nccl" and d.entry_backend("gloo:send", "gloo") == "gloo"
    )


def test_entry_fields_tolerate_what_older_recorders_leave_out():
    e = {"record_id": 3, "profiling_name": "gloo:all_reduce"}  # gloo: no timing, no p2p seq
    assert d.entry_group(e) == ("", "")
    assert d.entry_group({"process_group": ("4",)}) == ("4", "")
    assert d.entry_seq(e, False) == 0 and d.entry_seq({"collective_seq_id": None}, False) == 0
    assert d.duration_s(e) is None and d.duration_s({"duration_ms": 2}) == pytest.approx(0.002)
    assert d.is_epoch_ns(time.time_ns()) and not d.is_epoch_ns(time.monotonic_ns() % 10**15)


def test_pg_status_stuck():
    before = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 4}}
    still = {"0": {"last_enqueued_collective": 7, "last_completed_collective": 4}}
    moved = {"0": {"last_enqueued_collective": 7, "last_completed_collective": 6}}
    assert d.stuck(still, before)  # seq 5 in flight at both probes, nothing completed between
    assert not d.stuck(moved, before)
    assert not d.stuck(still, None) and not d.stuck({"1": still["0"]}, before)  # no earlier probe of it
