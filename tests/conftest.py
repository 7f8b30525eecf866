"""Shared fixtures and hooks.

- ``async def test_…`` functions run under :func:`asyncio.run` (pytest-asyncio is not a
  dependency): each in a fresh event loop of its own, bounded by :data:`TEST_TIMEOUT`
  seconds, so a hang fails the test.
- ``storage``: where a test's checkpoints go, on the backend named by ``request.param``
  (``local``, ``memory`` or ``s3``; local by default): mark a test
  :data:`tests.support.each_backend` to run it on each. ``store``: a store there.
- ``moto_endpoint``: one moto S3 server for the session (started when a test first needs it).
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING

import pytest

from gymckpt.testing.time import run_bounded

from .support import Storage, storage_on

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from gymckpt.store import CheckpointStore
    from gymckpt.testing.moto import MotoEndpoint

TEST_TIMEOUT = 30.0


#: the files that take minutes, longest first: ``make test``'s two processes each take whole files
#: in collection order, so these start first instead of leaving one process alone at the end
LONG_FILES_FIRST = (
    "tests/test_demo.py",
    "tests/e2e/test_counter_stack.py",
    "tests/collect/test_collect_process.py",
    "tests/collect/test_collect_loud.py",
    "tests/servers/test_serve_app.py",
    "tests/servers/test_slow_clients.py",
    "tests/e2e/",
    "tests/test_docs.py",
    "tests/conformance/",
    "tests/telemetry/test_telemetry_process.py",
    "tests/sharedfs/",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the long files first (a stable sort: the order within a file is kept)."""

    def rank(item: pytest.Item) -> int:
        return next(
            (index for index, prefix in enumerate(LONG_FILES_FIRST) if item.nodeid.startswith(prefix)),
            len(LONG_FILES_FIRST),
        )

    items.sort(key=rank)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run coroutine tests with ``asyncio.run``; plain tests are left to pytest."""
    function = pyfuncitem.obj
    if not inspect.iscoroutinefunction(function):
        return None
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_bounded(function(**arguments), TEST_TIMEOUT)
    return True


@pytest.fixture(autouse=True)
def gymckpt_environment() -> Iterator[None]:
    """Each test leaves ``GYMCKPT_*`` as it found it.

    An in-process command sets some for the servers it starts (``--log-level`` sets
    ``GYMCKPT_LOG_LEVEL``); left behind, they would reach every later test's servers.
    """
    before = {key: value for key, value in os.environ.items() if key.startswith("GYMCKPT_")}
    yield
    for key in [key for key in os.environ if key.startswith("GYMCKPT_") and key not in before]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[MotoEndpoint]:
    """moto's ThreadedMotoServer for the whole session, on 127.0.0.1, port 0."""
    from gymckpt.testing.moto import MotoEndpoint

    endpoint = MotoEndpoint("127.0.0.1", 0).start()
    try:
        yield endpoint
    finally:
        endpoint.stop()


@pytest.fixture
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    """A fresh :class:`~tests.support.Storage` on the backend ``request.param`` names (local by default)."""
    kind = getattr(request, "param", "local")
    endpoint = request.getfixturevalue("moto_endpoint") if kind == "s3" else None
    yield from storage_on(kind, tmp_path, endpoint)


@pytest.fixture
def store(storage: Storage) -> Iterator[CheckpointStore]:
    """A store at ``store`` in :func:`storage` (a directory under ``tmp_path`` by default)."""
    opened = storage.open("store")
    try:
        yield opened
    finally:
        opened.close()
