"""Preemption with notice (M4) against the reference stack as real processes on 127.0.0.1.

One stack per module (:class:`~gymckpt.stack.harness.RolloutHarness`: inference, model,
counter resources, agent, environment, each a ``gymckpt serve`` process), its Gym servers
killed and started again before each test. Their ``allowed_roots`` is one directory: a
checkpoint root outside it is what a participant refuses (``checkpoint_dir_not_allowed``).

Rollouts last seconds (slow tokens, many tool turns), so they are in flight when a notice
comes. Where a notice must come at a given point of a checkpoint, :class:`HookedCoordinator`
(a real :class:`Coordinator`, every call still made) runs the test's hook after prepare
replied or after commit replied; the hook sends the notice and waits until the guard took
it. Nothing sleeps to synchronize; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.control.coordination import Coordinator, ParticipantInfo
from gymckpt.control.preemption import CheckpointResult, PreemptionGuard, PreemptionResult
from gymckpt.errors import CheckpointConflict, PreemptionGuardInactive
from gymckpt.identity import EpisodeId
from gymckpt.stack.harness import RolloutHarness, default_stack_spec, task_for
from gymckpt.store import open_store, verify
from gymckpt.testing.time import until

from ..support import REPO, kill_group

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from pathlib import Path

TOKEN = "preemption-token"
#: the bound of any single wait (seconds)
WAIT = 60.0
#: the grace period the tests give: far longer than a checkpoint of this stack takes
GRACE = 60.0
#: a model call is 8 tokens: 0.4 s; a rollout makes TURNS + 1 of them, several seconds in all
TOKEN_DELAY = 0.05
TURNS = 14
LOGGER = "gymckpt.control.preemption"


class HookedCoordinator(Coordinator):
    """A coordinator that logs its calls and awaits a test's hook after prepare or commit replied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[Any, ...]] = []
        self.hooks: dict[str, Callable[[], Awaitable[None]]] = {}

    async def _hook(self, point: str) -> None:
        hook = self.hooks.pop(point, None)
        if hook is not None:
            await hook()

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> Any:
        self.calls.append(("prepare", checkpoint_id))
        prepared = await super().prepare(checkpoint_id, deadline_ts)
        await self._hook("prepared")
        return prepared

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str, episode_ids: Any, **kw: Any
    ) -> Any:
        self.calls.append(("commit", checkpoint_id, kw.get("stop", False)))
        replies = await super().commit(checkpoint_id, deadline_ts, checkpoint_dir, episode_ids, **kw)
        await self._hook("committed")
        return replies

    async def publish(self, checkpoint_dir: str, commits: Any, **kw: Any) -> Any:
        self.calls.append(("publish", checkpoint_dir))
        return await super().publish(checkpoint_dir, commits, **kw)

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> Any:
        self.calls.append(("resume", checkpoint_id))
        return await super().resume(checkpoint_id, deadline_ts)

    def made(self, operation: str) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] == operation]


@dataclass
class PreemptStack:
    runner: asyncio.Runner
    harness: RolloutHarness
    #: the servers' one allowed root
    allowed: Path
    base: Path
    runs: list[asyncio.Task[Any]] = field(default_factory=list)

    def fresh(self) -> None:
        async def fresh() -> None:
            await asyncio.to_thread(self.harness.crash)
            self.harness.restart()
            await self.harness.reset_model_calls()

        self.runner.run(asyncio.wait_for(fresh(), WAIT))

    async def coordinator(self) -> HookedCoordinator:
        """A discovered coordinator of every Gym server, once they all answer."""
        ready = await self.harness.wait_ready(timeout=WAIT)
        await ready.close()
        gym = HookedCoordinator(
            [self.harness.urls[name] for name in self.harness.gym_servers], token=TOKEN, probe_timeout=WAIT
        )
        (await gym.discover()).raise_for_problems()
        return gym

    def start(self, keys: dict[str, int]) -> dict[str, asyncio.Task[Any]]:
        """One environment ``/run`` per capture key (task index as given)."""
        runs = {key: asyncio.create_task(self.harness.run(key, task_for(index))) for key, index in keys.items()}
        self.runs.extend(runs.values())
        return runs

    async def until_in_flight(self, keys: list[str]) -> None:
        """Until every key made a model call (it runs), bounded."""
        deadline = time.monotonic() + WAIT
        while not set(keys) <= {str(call["call_id"]).rsplit(":", 1)[0] for call in await self.harness.model_calls()}:
            assert time.monotonic() < deadline, f"{keys} never made a model call"

    async def phases(self, gym: Coordinator) -> set[str]:
        return {str((await gym.status(url))["phase"]) for url in gym.kinds}

    def end_test(self) -> None:
        runs, self.runs = self.runs, []

        async def cancel() -> None:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

        self.runner.run(asyncio.wait_for(cancel(), WAIT))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreemptStack]:
    base = tmp_path_factory.mktemp("preempt")
    allowed = base / "allowed"
    allowed.mkdir()
    spec = default_stack_spec(
        token=TOKEN, token_delay_seconds=TOKEN_DELAY, tool_turns=TURNS, allowed_roots=[str(allowed)]
    )
    runner = asyncio.Runner()
    harness: RolloutHarness | None = None
    try:
        harness = RolloutHarness.start(spec, workdir=base / "stack")
        yield PreemptStack(runner, harness, allowed, base)
    finally:
        if harness is not None:
            runner.run(harness.close())
        runner.close()


@pytest.fixture
def preempt(stack: PreemptStack) -> Iterator[PreemptStack]:
    """The module's stack with fresh Gym processes; the test's runs cancelled after."""
    stack.fresh()
    try:
        yield stack
    finally:
        stack.end_test()


def published_ids(root: Path) -> list[str]:
    """The checkpoint directories under ``root`` that hold a ``gym/checkpoint.json``."""
    return sorted(path.parent.parent.name for path in root.glob("*/gym/checkpoint.json"))


def index_extra(root: Path, checkpoint_id: str) -> dict[str, Any]:
    store = open_store(str(root))
    try:
        return dict(store.read_index(checkpoint_id).extra)
    finally:
        store.close()


def preemption_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == LOGGER]


# --------------------------------------------------------------------------- SIGTERM to a controller


def test_sigterm_to_a_controller_with_rollouts_in_flight_publishes_a_checkpoint_and_reports_it(
    preempt: PreemptStack, tmp_path: Path
) -> None:
    harness = preempt.harness
    root = preempt.allowed / "sigterm"
    result_file, out_file, err_file = tmp_path / "result.json", tmp_path / "out.txt", tmp_path / "err.txt"
    command = [
        sys.executable,
        "-m",
        "tests.control.preempt_controller",
        *(harness.urls[name] for name in harness.gym_servers),
        *("--result", str(result_file), "--root", str(root), "--grace", f"{GRACE:g}", "--token", TOKEN),
        *("--inference", harness.urls["inference"], "--environment", harness.urls["environment"]),
        *("--rollouts", "3"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with out_file.open("wb") as out, err_file.open("wb") as err:
        controller = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
    try:
        deadline = time.monotonic() + WAIT
        while b"READY" not in out_file.read_bytes():
            assert controller.poll() is None, f"the controller exited: {err_file.read_text()}"
            assert time.monotonic() < deadline, f"the controller never got ready: {err_file.read_text()}"
            time.sleep(0.05)
        os.kill(controller.pid, signal.SIGTERM)
        assert controller.wait(timeout=WAIT) == 0, err_file.read_text()
    finally:
        kill_group(controller, timeout=10)
    report = json.loads(result_file.read_text())
    checkpoint_id = report["checkpoint_id"]

    # the report: one line with the seconds and the grace, and the result the controller recorded
    line = re.search(
        rf"preemption \(SIGTERM\): checkpoint {re.escape(checkpoint_id)} published in (\d+\.\d\d) s of the 60 s grace",
        err_file.read_text(),
    )
    assert line is not None, err_file.read_text()
    assert report["line"] in err_file.read_text()
    assert report["published"] and report["within_grace"] and not report["finished_open"]
    assert report["grace_seconds"] == GRACE and 0 < report["seconds"] <= GRACE
    assert report["stopped"] and report["notices"] == 1

    # one checkpoint, published and sound, of the rollouts in flight when it was prepared
    assert published_ids(root) == [checkpoint_id] == [path.name for path in root.iterdir()]
    assert verify(str(root / checkpoint_id)).ok
    (told,) = report["told_in_flight"]
    assert report["continued"], "no rollout was in flight at the checkpoint"
    assert sorted(report["continued"]) == sorted(set(told) - set(report["restarts"]))
    extra = index_extra(root, checkpoint_id)
    assert extra["preemption"] == "SIGTERM"
    assert extra["continued"] == [EpisodeId.from_capture_key(key).to_wire() for key in sorted(report["continued"])]

    async def servers_stay_closed_and_the_checkpoint_restores() -> None:
        gym = await preempt.coordinator()
        try:
            assert await preempt.phases(gym) == {"committed"}  # nobody resumed: the controller was ending
        finally:
            await gym.close()
        # the node is gone: fresh processes restore the preemption's checkpoint and every rollout finishes
        await asyncio.to_thread(harness.crash)
        harness.restart()
        gym = await preempt.coordinator()
        try:
            replies = await gym.restore("restore-1", time.time() + WAIT, str(root / checkpoint_id), report["continued"])
            assert all(reply.phase == "restored" for reply in replies.values())
            await gym.resume("restore-1", time.time() + WAIT)
            continued = {EpisodeId.from_capture_key(key).next_attempt().capture_key: key for key in report["continued"]}
            indices = {key: int(key.removeprefix("pre-")) for key in report["continued"]}
            runs = preempt.start({attempt: indices[key] for attempt, key in continued.items()})
            references = preempt.start({f"ref-{index}": index for index in indices.values()})
            bodies = await asyncio.wait_for(asyncio.gather(*runs.values(), *references.values()), WAIT)
        finally:
            await gym.close()
        for attempt, key in continued.items():
            assert "result" in bodies[list(runs).index(attempt)], bodies
            expected = bodies[len(runs) + list(references).index(f"ref-{indices[key]}")]
            assert bodies[list(runs).index(attempt)]["result"] == expected["result"], (attempt, bodies)

    preempt.runner.run(asyncio.wait_for(servers_stay_closed_and_the_checkpoint_restores(), 3 * WAIT))


# --------------------------------------------------------------------------- a notice mid-checkpoint


@pytest.mark.parametrize("point", ["prepared", "committed"])
def test_a_notice_while_a_checkpoint_is_open_finishes_that_one_and_starts_no_other(
    preempt: PreemptStack, point: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node drain's notice, from another thread, after prepare replied (or after commit replied)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = preempt.allowed / f"open-{point}"

    async def scenario() -> tuple[CheckpointResult, PreemptionResult, HookedCoordinator, set[str]]:
        gym = await preempt.coordinator()
        runs = preempt.start({"open-0": 0, "open-1": 1})
        await preempt.until_in_flight(list(runs))
        guard = PreemptionGuard(
            gym,
            grace_seconds=GRACE,
            checkpoint_root=str(root),
            in_flight=lambda: [key for key, run in runs.items() if not run.done()],
            signals=(),
        )

        async def drain_notice() -> None:
            assert guard.open_checkpoint == "ckpt-open"
            with pytest.raises(CheckpointConflict):
                await guard.checkpoint("ckpt-other")
            sender = threading.Thread(target=guard.notice, args=("node drain",))
            sender.start()
            await asyncio.to_thread(sender.join, WAIT)
            await until(lambda: guard.noticed, WAIT, message="the notice never reached the guard")

        gym.hooks[point] = drain_notice
        try:
            async with guard:
                outcome = await guard.checkpoint("ckpt-open")
                result = await guard.wait()
            return outcome, result, gym, await preempt.phases(gym)
        finally:
            await gym.close()

    outcome, result, gym, phases = preempt.runner.run(asyncio.wait_for(scenario(), 2 * WAIT))

    assert outcome.published and outcome.checkpoint_id == "ckpt-open", outcome
    assert outcome.continued, "no rollout was in flight at the checkpoint"
    assert result.checkpoint is outcome and result.finished_open and result.ok
    assert result.reason == "node drain" and result.grace_seconds == GRACE
    # commit after the notice asks the servers to stop; nobody is resumed
    assert outcome.stopped is (point == "prepared")
    assert gym.made("prepare") == [("prepare", "ckpt-open")]
    assert gym.made("commit") == [("commit", "ckpt-open", point == "prepared")]
    assert len(gym.made("publish")) == 1 and gym.made("resume") == []
    assert phases == {"committed"}
    # exactly one checkpoint directory, the open one, published
    assert [path.name for path in root.iterdir()] == published_ids(root) == ["ckpt-open"]
    assert verify(str(root / "ckpt-open")).ok
    assert index_extra(root, "ckpt-open")["preemption"] == "node drain"
    reports = [record for record in preemption_lines(caplog) if record.getMessage().startswith("preemption (")]
    assert [record.getMessage() for record in reports] == [result.line()]
    assert reports[0].levelno == logging.WARNING
    assert re.fullmatch(
        r"preemption \(node drain\): checkpoint ckpt-open \(open at the notice\) published in \d+\.\d\d s "
        r"of the 60 s grace",
        result.line(),
    )


# --------------------------------------------------------------------------- a checkpoint that cannot finish


def test_a_notice_whose_checkpoint_a_participant_refuses_reports_it_not_published(
    preempt: PreemptStack, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint root lies outside the servers' ``allowed_roots``: every commit is refused."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = preempt.base / "not-allowed"

    async def scenario() -> tuple[PreemptionResult, HookedCoordinator]:
        gym = await preempt.coordinator()
        guard = PreemptionGuard(gym, grace_seconds=GRACE, checkpoint_root=str(root), in_flight=list, signals=())
        try:
            async with guard:
                guard.notice("SIGTERM")
                result = await guard.wait()
            return result, gym
        finally:
            await gym.close()

    result, gym = preempt.runner.run(asyncio.wait_for(scenario(), 2 * WAIT))

    assert not result.published and not result.ok and not result.finished_open
    assert result.within_grace  # it failed fast: the outcome came in time, and it says not published
    assert "checkpoint_dir_not_allowed" in (result.checkpoint.error or ""), result.checkpoint.error
    assert "\n" not in (result.checkpoint.error or "")
    assert [call[0] for call in gym.calls] == ["prepare", "commit"]
    assert not list(root.rglob("checkpoint.json"))
    failures = [record for record in preemption_lines(caplog) if record.levelno >= logging.ERROR]
    assert [record.getMessage() for record in failures] == [result.line()]
    assert f"checkpoint {result.checkpoint_id} NOT published after" in result.line()
    assert "restore the last published checkpoint" in result.line()


# --------------------------------------------------------------------------- repeated notices


def test_repeated_notices_take_one_checkpoint(preempt: PreemptStack, caplog: pytest.LogCaptureFixture) -> None:
    """Notices from the loop and from threads while the notice's checkpoint runs, and after it ended."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = preempt.allowed / "repeated"

    async def scenario() -> tuple[PreemptionResult, PreemptionGuard, HookedCoordinator, list[Any]]:
        gym = await preempt.coordinator()
        guard = PreemptionGuard(gym, grace_seconds=GRACE, checkpoint_root=str(root), in_flight=list, signals=())

        async def more_notices() -> None:
            guard.notice("SIGTERM")
            senders = [threading.Thread(target=guard.notice, args=(f"drain {n}",)) for n in range(3)]
            for sender in senders:
                sender.start()
            for sender in senders:
                await asyncio.to_thread(sender.join, WAIT)
            await until(lambda: guard.notices == 5, WAIT, message="the notices never reached the guard")

        gym.hooks["prepared"] = more_notices
        try:
            async with guard:
                with pytest.raises(ValueError):
                    guard.notice("drain", grace_seconds=0)
                guard.notice("SIGTERM", grace_seconds=45)  # a notice's own grace: a drain's deadline
                result = await guard.wait()
                guard.notice("SIGTERM")  # after the result
                later = [await guard.checkpoint(), await guard.checkpoint("ckpt-asked-later"), await guard.wait()]
            return result, guard, gym, later
        finally:
            await gym.close()

    result, guard, gym, later = preempt.runner.run(asyncio.wait_for(scenario(), 2 * WAIT))

    assert result.ok and result.reason == "SIGTERM" and result.grace_seconds == 45 and guard.notices == 6
    assert later == [result.checkpoint, result.checkpoint, result]
    assert gym.made("prepare") == [("prepare", result.checkpoint_id)]
    assert [path.name for path in root.iterdir()] == published_ids(root) == [result.checkpoint_id]
    repeats = [record for record in preemption_lines(caplog) if "no second checkpoint" in record.getMessage()]
    assert len(repeats) == 5
    reports = [record for record in preemption_lines(caplog) if record.getMessage().startswith("preemption (")]
    assert [record.getMessage() for record in reports] == [result.line()]
    with pytest.raises(PreemptionGuardInactive):
        guard.notice("SIGTERM")  # the guard was left


# --------------------------------------------------------------------------- no notice


def test_a_checkpoint_without_a_notice_publishes_and_resumes(
    preempt: PreemptStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = preempt.allowed / "regular"

    async def scenario() -> tuple[CheckpointResult, PreemptionGuard, HookedCoordinator, set[str]]:
        gym = await preempt.coordinator()
        guard = PreemptionGuard(gym, grace_seconds=GRACE, checkpoint_root=str(root), in_flight=list, signals=())
        try:
            with pytest.raises(PreemptionGuardInactive):
                await guard.checkpoint()
            async with guard:
                outcome = await guard.checkpoint("ckpt-regular")
            return outcome, guard, gym, await preempt.phases(gym)
        finally:
            await gym.close()

    outcome, guard, gym, phases = preempt.runner.run(asyncio.wait_for(scenario(), 2 * WAIT))

    assert outcome.published and not outcome.stopped and outcome.error is None
    assert guard.result is None and not guard.noticed
    assert gym.made("resume") == [("resume", "ckpt-regular")]
    assert phases == {"idle"}
    assert published_ids(root) == ["ckpt-regular"]
    assert index_extra(root, "ckpt-regular")["preemption"] is None
    assert not [record for record in preemption_lines(caplog) if record.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- the report's words


def test_the_report_line_says_late_and_failed_loudly() -> None:
    published = CheckpointResult("ckpt-a", "/c/ckpt-a", True, 70.0)
    late = PreemptionResult("SIGTERM", 30.0, 71.5, published, finished_open=False)
    assert late.published and not late.within_grace and not late.ok
    assert late.line() == (
        "preemption (SIGTERM): checkpoint ckpt-a published in 71.50 s, past the 30 s grace: "
        "the platform may have ended the controller first; give it a longer grace period"
    )
    failed = PreemptionResult(
        "node drain", 30.0, 2.0, CheckpointResult("ckpt-b", "/c/ckpt-b", False, 2.0, error="boom"), True
    )
    assert not failed.ok and failed.within_grace
    assert failed.line() == (
        "preemption (node drain): checkpoint ckpt-b (open at the notice) NOT published after 2.00 s of the "
        "30 s grace: boom; restore the last published checkpoint"
    )
    # a coordinator not discovered would checkpoint nobody: refused
    undiscovered = PreemptionGuard(Coordinator([], token="t"), grace_seconds=30, checkpoint_root="/c", in_flight=list)
    with pytest.raises(ValueError, match="discover"):
        asyncio.run(undiscovered.__aenter__())

    # SIGTERM is taken only in the main thread's event loop: elsewhere entering says how to go on
    discovered = Coordinator(["http://127.0.0.1:1"], token="t")
    discovered.kinds = {"http://127.0.0.1:1": ParticipantInfo("http://127.0.0.1:1", "environment", "env-0")}
    guard = PreemptionGuard(discovered, grace_seconds=30, checkpoint_root="/c", in_flight=list)
    failure: list[BaseException] = []

    def enter_in_a_thread() -> None:
        async def enter() -> None:
            async with guard:
                pass

        try:
            asyncio.run(enter())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=enter_in_a_thread)
    thread.start()
    thread.join(WAIT)
    assert len(failure) == 1 and isinstance(failure[0], ValueError), failure
    assert "pass signals=()" in str(failure[0])
    for grace, reserve in ((0, None), (-1, None), (10, 10), (10, -1)):
        with pytest.raises(ValueError):
            PreemptionGuard(
                Coordinator([], token="t"),
                grace_seconds=grace,
                checkpoint_root="/c",
                in_flight=list,
                reserve_seconds=reserve,
            )
