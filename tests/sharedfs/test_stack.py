"""The reference stack on the shared filesystem: real server processes checkpoint rollouts in flight
into a directory of mount A; every Gym server is SIGKILLed; fresh processes restore from the same
checkpoint read through mount B, and each continued rollout makes exactly the model calls its
uninterrupted run made after the checkpoint (tests/e2e's scenario, across two clients)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gymckpt.store import verify
from tests.e2e.conftest import E2EStack, e2e_stack, fresh

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .conftest import Hosts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EStack]:
    with e2e_stack(tmp_path_factory.mktemp("sharedfs-stack"), references=range(4)) as running:
        yield running


def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_servers_write_through_a_and_the_restored_servers_read_through_b(stack: E2EStack, hosts: Hosts) -> None:
    written, read = hosts.a / "ckpt", hosts.b / "ckpt"

    async def scenario(e2e: E2EStack) -> None:
        gym = await e2e.coordinator()
        runs = e2e.start({"sfs-0": 0, "sfs-1": 1, "sfs-2": 2, "sfs-3": 3})
        await e2e.wait_for_calls({"sfs-0": 1, "sfs-1": 2, "sfs-2": 1, "sfs-3": 2}, runs)
        cut = await e2e.checkpoint(gym, "sharedfs-1", written, runs)
        assert cut.committed, "no rollout was in flight at the checkpoint"
        assert _files(read) == _files(written)
        report = await asyncio.to_thread(verify, str(read))
        assert report.ok and report.errors == [], report.to_dict()
        await e2e.crash(runs, cut.committed)
        through_b = dataclasses.replace(cut, outcome=dataclasses.replace(cut.outcome, directory=str(read)))
        await e2e.restore(through_b)
        await e2e.continue_committed(through_b)

    with fresh(stack) as e2e:
        e2e.run(scenario(e2e))
