"""Node drains as preemption notices: :class:`~gymckpt.stack.drain_watch.DrainWatcher`, alone and on a real cluster.

The first tests drive the watcher with plain callables (no Ray). The last one drains a real
node of the module's cluster (``ray``'s GCS ``drain_node``, reason preemption, with a
deadline) while a :class:`~gymckpt.control.preemption.PreemptionGuard`'s checkpoint is open:
the launcher's watcher tells the guard, which finishes that checkpoint and takes no other.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.errors import PreemptionGuardInactive
from gymckpt.stack.drain_watch import MIN_GRACE_SECONDS, DrainWatcher, grace_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.testing.raycluster import RayCluster

#: the bound of any one wait in these tests (seconds)
WAIT = 60.0


class Notices:
    """What a guard's ``notice`` was called with."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.calls: list[tuple[str, float | None]] = []
        self.raises = raises
        self.lock = threading.Lock()

    def __call__(self, reason: str, *, grace_seconds: float | None = None) -> None:
        with self.lock:
            self.calls.append((reason, grace_seconds))
        if self.raises is not None:
            raise self.raises


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {WAIT} s"
        time.sleep(0.01)


def test_each_drain_is_one_notice_with_the_seconds_left_to_its_deadline() -> None:
    in_40_s = int((time.time() + 40) * 1000)
    draining: dict[str, int] = {"n1": in_40_s, "n2": 0}
    notices = Notices()
    watcher = DrainWatcher(lambda: dict(draining), notices, poll_seconds=0.01)
    assert sorted(watcher.poll()) == ["n1", "n2"]
    assert watcher.poll() == [] and watcher.poll() == []  # still draining: no second notice
    (first, grace), (second, none) = sorted(notices.calls)
    assert (first, second, none) == ("node drain n1", "node drain n2", None)  # no deadline: the guard's grace
    assert grace is not None and 35 < grace <= 40
    # the drain of n2 is cancelled, then n2 is drained again: a new notice; n1 is never told twice
    del draining["n2"]
    assert watcher.poll() == []
    draining["n2"] = in_40_s
    assert watcher.poll() == ["n2"]
    assert [reason for reason, _ in notices.calls].count("node drain n1") == 1
    assert [reason for reason, _ in notices.calls].count("node drain n2") == 2


def test_a_deadline_already_past_still_gives_a_positive_grace() -> None:
    assert grace_of(0) is None
    assert grace_of(int((time.time() - 5) * 1000)) == MIN_GRACE_SECONDS
    assert grace_of(10_000, now=4.0) == 6.0


def test_the_thread_survives_a_cluster_that_does_not_answer_and_stops_when_the_guard_is_gone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="gymckpt.stack.drain_watch")
    answers: list[Any] = [ConnectionError("GCS unreachable"), ConnectionError("GCS unreachable"), {"n1": 0}]

    def draining() -> dict[str, int]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    notices = Notices(raises=PreemptionGuardInactive("the PreemptionGuard is not entered"))
    watcher = DrainWatcher(draining, notices, poll_seconds=0.01).start()
    try:
        _until(lambda: watcher._thread is not None and not watcher._thread.is_alive(), "the watcher did not end")
    finally:
        watcher.stop()
    # asked again after the failures, told the guard once, ended when the guard refused
    assert notices.calls == [("node drain n1", None)]
    assert watcher.error is not None and watcher.error.startswith("telling the guard: PreemptionGuardInactive")
    messages = [record.getMessage() for record in caplog.records]
    assert messages.count("watching node drains: asking for draining nodes: ConnectionError: GCS unreachable") == 1
    assert messages[-1].startswith("watching node drains: telling the guard: PreemptionGuardInactive")


@pytest.mark.slow
def test_a_drain_of_a_node_holding_servers_finishes_the_open_checkpoint(
    cluster: RayCluster, run_scenario: Callable[..., dict[str, Any]]
) -> None:
    ids = cluster.node_ids()
    seen = run_scenario("drain", drain_seconds=60)
    assert seen["placed"]["environment"] == seen["placed"]["agent"] == seen["drained"] == "node1"
    assert seen["node_id"] == ids["node1"]
    assert seen["drain"]["accepted"], seen["drain"]
    # the drain came while the guard's checkpoint was open, and that one was finished: no other
    assert seen["open_at_drain"] == "ck-drain"
    result, checkpoint = seen["result"], seen["checkpoint"]
    assert result["reason"] == f"node drain {ids['node1']}"
    assert result["finished_open"] and result["ok"], result
    assert checkpoint["id"] == "ck-drain" and checkpoint["published"] and checkpoint["error"] is None
    assert checkpoint["continued"], "no rollout was in flight at the checkpoint"
    assert seen["verified"]
    # the notice's grace is the drain's deadline, less the moments before the watcher saw it
    assert 0 < result["grace_seconds"] <= 60
    assert seen["noticed"] == {ids["node1"]: result["grace_seconds"]}
    # the drain lasted three more polls, and was told once
    assert seen["polls_after"] >= 3 and seen["notices"] == 1 and seen["watch_error"] is None
    assert result["line"].startswith(
        f"preemption (node drain {ids['node1']}): checkpoint ck-drain (open at the notice)"
    )
