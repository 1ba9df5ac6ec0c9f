"""Stream label values are bounded (``streams.StreamCap``)."""

from __future__ import annotations


def test_stream_label_values_are_capped():
    from hpar_agent.streams import MAX_STREAMS, OTHER, StreamCap

    cap = StreamCap()
    names = [cap(f"cuda:{i}") for i in range(3 * MAX_STREAMS)]
    assert names[:MAX_STREAMS] == [f"cuda:{i}" for i in range(MAX_STREAMS)]
    assert set(names[MAX_STREAMS:]) == {OTHER}
    assert cap("cuda:0") == "cuda:0"  # a name seen before keeps its label
