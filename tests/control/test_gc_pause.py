"""The cyclic GC around checkpoints (gymckpt.gc_pause): paused while one is open, in servers and controllers."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import TYPE_CHECKING

import pytest

from gymckpt import gc_pause
from gymckpt.control.models import CommitRequest, ControlRequest, Phase
from gymckpt.control.plane import ControlPlane
from gymckpt.testing.time import bounded

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gymckpt.testing.participant import FakeParticipant


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    """Each test starts with the collector on and no pause open, and leaves it so."""
    was = gc.isenabled()
    gc.enable()
    assert gc_pause._GC_PAUSE.pauses == 0
    yield
    assert gc_pause._GC_PAUSE.pauses == 0, "a pause was left open"
    if not was:
        gc.disable()


def _request(checkpoint_id: str, deadline_ts: float) -> ControlRequest:
    return ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=deadline_ts)


def test_pauses_nest_and_a_release_counts_once() -> None:
    release = gc_pause.pause_gc()
    assert not gc.isenabled()
    with gc_pause.paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the first pause still holds it
    release()
    assert gc.isenabled()
    release()  # again: nothing (the count would go below zero)
    assert gc.isenabled() and gc_pause._GC_PAUSE.pauses == 0


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    with gc_pause.paused_gc():
        pass
    assert not gc.isenabled()
    gc.enable()


@pytest.mark.parametrize(
    ("text", "thresholds"),
    [
        (None, gc_pause.SERVER_GC_THRESHOLDS),
        ("", gc_pause.SERVER_GC_THRESHOLDS),
        ("python", None),
        ("5, 6,7", (5, 6, 7)),
    ],
)
def test_thresholds_are_read_from_the_variable(text: str | None, thresholds: tuple[int, int, int] | None) -> None:
    assert gc_pause.collector_thresholds(text) == thresholds


@pytest.mark.parametrize("text", ["1,2", "1,2,x", "0,1,1", "-1,2,3", "big"])
def test_a_bad_threshold_setting_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match=r"GYMCKPT_GC_THRESHOLDS=.*three positive integers"):
        gc_pause.collector_thresholds(text)


def test_tune_collector_sets_the_thresholds_and_python_keeps_them(monkeypatch: pytest.MonkeyPatch) -> None:
    before = gc.get_threshold()
    try:
        monkeypatch.setenv(gc_pause.GC_THRESHOLDS_ENV, "900,11,12")
        assert gc_pause.tune_collector() == (900, 11, 12) == gc.get_threshold()
        monkeypatch.setenv(gc_pause.GC_THRESHOLDS_ENV, "python")
        assert gc_pause.tune_collector() == (900, 11, 12)  # left as they were
    finally:
        gc.set_threshold(*before)


async def test_the_collector_is_paused_from_prepare_until_resume(fake: FakeParticipant, ckpt_dir: str) -> None:
    plane = ControlPlane(fake)
    fake.start("a")
    fake.close_gate = asyncio.Event()  # the close waits for the test
    prepare = asyncio.create_task(plane.prepare(_request("c1", time.time() + 60.0)))
    await bounded(fake.started["close"].wait())
    assert not gc.isenabled()  # the prepare is under way, the collector paused
    fake.close_gate.set()
    reply = await bounded(prepare)
    assert reply.phase is Phase.PREPARED and not gc.isenabled()  # the checkpoint is open: still paused
    commit = CommitRequest(checkpoint_id="c1", deadline_ts=time.time() + 60.0, checkpoint_dir=ckpt_dir)
    assert (await bounded(plane.commit(commit))).record_count == 1
    assert not gc.isenabled()
    await bounded(plane.resume(_request("c1", time.time() + 60.0)))
    assert gc.isenabled()
    await plane.close()


async def test_an_expired_lease_and_a_closed_plane_end_the_open_checkpoints_pause(fake: FakeParticipant) -> None:
    plane = ControlPlane(fake)
    await bounded(plane.prepare(_request("c1", time.time() + 60.0)))
    assert not gc.isenabled()
    plane.lease_expires_at = plane.clock() - 1.0  # as if the controller vanished
    assert await bounded(plane.expire_lease())
    assert plane.phase is Phase.IDLE and gc.isenabled()
    await bounded(plane.prepare(_request("c2", time.time() + 60.0)))
    assert not gc.isenabled()
    await plane.close()  # the server shuts down with a checkpoint open
    assert gc.isenabled()


def test_a_bounded_pause_ends_by_itself_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="gymckpt.gc_pause"):
        pause = gc_pause.pause_gc(0.01, "checkpoint 'c9'")
        assert pause.expired.wait(10.0), "the bound never ended the pause"
    assert gc.isenabled() and gc_pause._GC_PAUSE.pauses == 0
    pause.release()  # after its bound: nothing
    assert gc_pause._GC_PAUSE.pauses == 0
    lines = [record.getMessage() for record in caplog.records if record.name == "gymckpt.gc_pause"]
    assert lines == ["the cyclic GC runs again after 0.01 s although checkpoint 'c9' is still open"]


def test_a_released_pause_is_not_ended_again_by_its_bound() -> None:
    pause = gc_pause.pause_gc(30.0, "checkpoint 'c8'")
    other = gc_pause.pause_gc()
    pause.release()
    assert not gc.isenabled()  # the other pause still holds it
    assert pause._timer is not None
    pause._timer.join(10.0)  # cancelled: its thread ends without ending any pause
    assert not pause._timer.is_alive()
    other.release()
    assert gc.isenabled() and not pause.expired.is_set()


async def test_a_failed_prepare_ends_its_pause(fake: FakeParticipant) -> None:
    plane = ControlPlane(fake)
    fake.start("a")
    fake.fail_close = RuntimeError("the participant cannot close")
    with pytest.raises(RuntimeError):
        await bounded(plane.prepare(_request("c2", time.time() + 10.0)))
    assert plane.phase is Phase.IDLE and gc.isenabled()
    await plane.close()


def test_a_long_collection_is_logged_with_its_generation_and_seconds(caplog: pytest.LogCaptureFixture) -> None:
    def ours() -> list[object]:
        return [callback for callback in gc.callbacks if getattr(callback, "_gymckpt_long_collections", False)]

    kept = ours()
    for callback in kept:
        gc.callbacks.remove(callback)
    try:
        gc_pause.log_long_collections(threshold=0.0)  # every collection counts as long
        gc_pause.log_long_collections(threshold=0.0)  # installed once
        assert len(ours()) == 1
        with caplog.at_level("INFO", logger="gymckpt.gc_pause"):
            gc.collect()
        lines = [record.getMessage() for record in caplog.records if record.name == "gymckpt.gc_pause"]
        assert any(line.startswith("the cyclic GC's generation 2 collection took ") for line in lines), lines
    finally:
        for callback in ours():
            gc.callbacks.remove(callback)
        gc.callbacks.extend(kept)


async def test_a_commit_that_stops_the_controller_ends_the_pause_at_once(fake: FakeParticipant, ckpt_dir: str) -> None:
    plane = ControlPlane(fake)
    fake.start("a")
    await bounded(plane.prepare(_request("c1", time.time() + 60.0)))
    assert not gc.isenabled()
    stop = CommitRequest(checkpoint_id="c1", deadline_ts=time.time() + 60.0, checkpoint_dir=ckpt_dir, stop=True)
    assert (await bounded(plane.commit(stop))).record_count == 1
    assert gc.isenabled()  # parked for good: nothing would resume it
    assert plane.phase is Phase.COMMITTED
    await plane.close()
