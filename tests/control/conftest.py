"""Control-plane test fixtures: a fake participant, and a checkpoint directory in ``storage``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gymckpt.testing.participant import FakeParticipant

if TYPE_CHECKING:
    from tests.support import Storage


@pytest.fixture
def fake() -> FakeParticipant:
    """A fresh fake participant (kind environment, instance env-0)."""
    return FakeParticipant()


@pytest.fixture
def ckpt_dir(storage: Storage) -> str:
    """A checkpoint directory (not created yet) in ``storage``: ``tmp_path/ckpt`` by default."""
    return storage.url("ckpt")
