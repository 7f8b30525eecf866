"""Control-plane test fixtures, and ``async def`` tests run under :func:`asyncio.run`.

pytest-asyncio is not a dependency: an ``async def test_…`` here runs in a fresh event
loop of its own, bounded by :data:`TEST_TIMEOUT` seconds, so a hang fails the test.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING

import pytest

from .fake_participant import FakeParticipant

if TYPE_CHECKING:
    from pathlib import Path

TEST_TIMEOUT = 30.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run coroutine tests with ``asyncio.run``; plain tests are left to pytest."""
    function = pyfuncitem.obj
    if not inspect.iscoroutinefunction(function):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(function(**arguments), TEST_TIMEOUT))
    return True


@pytest.fixture
def fake() -> FakeParticipant:
    """A fresh fake participant (kind environment, instance env-0)."""
    return FakeParticipant()


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> str:
    """A local checkpoint directory (not created yet)."""
    return str(tmp_path / "ckpt")
