"""The iterator every ``torch.utils.data.DataLoader`` returns (verified on torch 2.11 CUDA and 2.13 CPU).

``DataLoader.__iter__`` returns a subclass of the private ``_BaseDataLoaderIter`` (single-process or
multiprocessing), whose ``__next__`` they share: wrapping it on that class times every loader's fetch
however the program iterates. Where torch renames the class, the data-loader phase is not timed.
"""

from __future__ import annotations

from typing import Any


def iterator_class() -> type[Any] | None:
    """``_BaseDataLoaderIter`` (None where this torch has no such class)."""
    try:
        from torch.utils.data.dataloader import _BaseDataLoaderIter
    except ImportError:
        return None
    return _BaseDataLoaderIter
