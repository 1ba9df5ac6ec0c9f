"""The strided samples the checksums and the tp gradient-sync coverage take on the training thread."""

from __future__ import annotations

import pytest
import torch

from hpar_agent.samples import sample_cat, segment_sums, strided


@pytest.mark.parametrize("shape", [(64, 64), (7,), (0,), (5, 3), (1000,), (3,)])
@pytest.mark.parametrize("n", [16, 3, 1])
def test_strided_is_every_kth_flattened_element(shape: tuple[int, ...], n: int) -> None:
    t = torch.randn(*shape)
    for view in (t, t.t() if t.dim() == 2 else t, t.reshape(-1)[1:] if t.numel() > 1 else t):
        want = view.reshape(-1)[:: max(1, view.numel() // n)][:n]
        assert torch.equal(strided(view, n), want)


def test_strided_reads_a_view_from_its_own_offset() -> None:
    base = torch.arange(100.0)
    assert strided(base[10:74], 16).tolist() == [float(x) for x in range(10, 74, 4)]


def test_sample_cat_is_float32_and_sums_per_segment() -> None:
    parts = [
        strided(torch.ones(8, dtype=torch.bfloat16), 4),
        strided(torch.full((6,), -2.0, dtype=torch.float64), 3),
    ]
    cat = sample_cat(parts)
    assert cat.dtype == torch.float32 and cat.numel() == 7
    assert segment_sums(cat, [4, 3], with_abs=True) == [[4.0, 4.0], [-6.0, 6.0]]
