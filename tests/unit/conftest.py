"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def store() -> Any:
    """A real TCPStore on a free port, for the cross-rank exchange between fake ranks of one process."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
