"""Fixtures of the system tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def gpu() -> Iterator[tuple[Any, Any]]:
    """The real NVML inventory and its first GPU, for the ``gpu``-marked tests (test_gpu_mps*.py)."""
    from isolator.gpu.nvml import Inventory

    inv = Inventory().open()
    inv.read()
    yield inv, inv.records[0].gpu
    inv.close()
