"""Shared fixtures: stores on every backend for tests that take the backend as a parameter."""

from __future__ import annotations

import pytest

from gymckpt.store import CheckpointStore, open_store
from gymckpt.store._memory import clear_memory_stores


@pytest.fixture
def store(request: pytest.FixtureRequest, tmp_path) -> CheckpointStore:
    """A store on the backend named by ``request.param`` (``local`` or ``memory``); local by default."""
    kind = getattr(request, "param", "local")
    if kind == "memory":
        clear_memory_stores()
        return open_store(f"memory://{tmp_path.name}")
    return open_store(str(tmp_path / "store"))
