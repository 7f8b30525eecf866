"""Fixtures of the store tests."""

from __future__ import annotations

import tracemalloc
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def tracing() -> Iterator[None]:
    """tracemalloc on for the test: what it measures is what the code under test allocated."""
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
