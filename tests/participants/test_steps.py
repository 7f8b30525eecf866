"""Episode steps (E1–E3): admission, wait/replay steps, readiness, restarts, retiring, cancellation.

Async tests run their own loop with ``asyncio.run``. Nothing here waits on wall-clock time:
tests wait on events, and ``_until`` only yields to the loop (``sleep(0)``) until a condition
holds, bounded by a timeout that only fires on a bug.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gymckpt.participants.steps import Episode, EpisodeEnded, EpisodeRegistry, EpisodeState, StepMode
from gymckpt.testing.time import FakeClock, drain, run_bounded, until

if TYPE_CHECKING:
    pass

WAIT = StepMode.WAIT
REPLAY = StepMode.REPLAY


# ---------------------------------------------------------------- helpers


#: run one test coroutine on a fresh loop, failing instead of hanging on a bug
arun = functools.partial(run_bounded, timeout=30)
#: yield to the loop (``sleep(0)``) until ``condition()`` holds (the timeout only catches bugs)
_until = functools.partial(until, timeout=5.0)
#: let every task that can make progress do so (no time passes)
_settle = functools.partial(drain, rounds=20)


def manual_clock() -> FakeClock:
    """A manual monotonic clock: it stands at 1000 s and moves only when the test moves it."""
    return FakeClock(1000.0, source=None)


class Gate:
    """A step body the test finishes explicitly."""

    def __init__(self, result: object = "result", registry: EpisodeRegistry | None = None) -> None:
        self.result = result
        self.registry = registry
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.calls = 0
        self.started_while_closed = False

    async def __call__(self) -> object:
        self.calls += 1
        if self.registry is not None and self.registry.closed:
            self.started_while_closed = True
        self.started.set()
        await self.release.wait()
        return self.result


def boundary_of(result: object) -> object:
    return {"after": result}


def start(episode: Episode, mode: StepMode, gate: Gate) -> asyncio.Task[object]:
    return asyncio.ensure_future(episode.step(mode, gate, boundary=boundary_of))


# ---------------------------------------------------------------- E1: boundaries and modes


def test_step_records_boundary_after_each_completed_step() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r")
        assert episode.boundary is None

        async def seed() -> int:
            return 1

        assert await episode.step(REPLAY, seed, boundary=lambda n: {"n": n}) == 1
        assert episode.boundary == {"n": 1}

        async def act() -> int:
            return 2

        assert await episode.step("wait", act, boundary=lambda n: {"n": n}) == 2
        assert episode.boundary == {"n": 2}
        assert registry.export(["r"]) == {"r": {"n": 2}}
        assert episode.state is EpisodeState.IDLE

    arun(main())


def test_failed_step_keeps_the_boundary_before() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r", restored_boundary="b0", restored=True)

        async def boom() -> None:
            raise RuntimeError("tool failed")

        for mode in StepMode:
            with pytest.raises(RuntimeError, match="tool failed"):
                await episode.step(mode, boom, boundary=boundary_of)
            assert episode.boundary == "b0"
            assert episode.state is EpisodeState.IDLE
            assert registry.counts()["idle"] == 1

    arun(main())


def test_step_parks_while_closed_and_parked_time_is_not_charged() -> None:
    async def main() -> None:
        clock = manual_clock()
        registry = EpisodeRegistry(now=clock)
        episode = registry.begin("r")
        deadline = clock() + 60
        registry.close()
        gate = Gate(registry=registry)
        task = start(episode, WAIT, gate)
        await _until(lambda: episode.state is EpisodeState.PARKED)
        assert gate.calls == 0
        assert registry.ready()
        assert registry.blocker_count() == 0
        assert registry.counts()["parked"] == 1
        clock.advance(25)
        assert episode.parked_seconds == 25  # a park in progress counts
        assert episode.remaining(deadline) == 60
        registry.open()
        await asyncio.wait_for(gate.started.wait(), 5)
        assert not gate.started_while_closed
        clock.advance(10)
        gate.release.set()
        assert await task == "result"
        assert episode.parked_seconds == 25
        assert episode.remaining(deadline) == 60 - 10

    arun(main())


def test_wait_step_in_flight_blocks_then_parks_at_the_boundary_after_it() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r", restored_boundary="before", restored=True)
        gate = Gate("out")
        task = start(episode, WAIT, gate)
        await asyncio.wait_for(gate.started.wait(), 5)
        registry.close()
        assert not registry.ready()
        assert registry.blocker_count() == 1
        assert registry.blockers() == ["r"]
        assert registry.counts()["running_wait"] == 1

        gate.release.set()
        await _until(lambda: episode.state is EpisodeState.PARKED)
        assert registry.ready()
        assert registry.blockers() == []
        assert episode.boundary == {"after": "out"}
        assert registry.export(["r"]) == {"r": {"after": "out"}}
        await _settle()
        assert not task.done(), "a wait step must not return while admission is closed"

        registry.open()
        assert await asyncio.wait_for(task, 5) == "out"
        assert episode.state is EpisodeState.IDLE

    arun(main())


def test_replay_step_in_flight_does_not_block_and_exports_the_boundary_before() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r", restored_boundary="before", restored=True)
        gate = Gate("out")
        task = start(episode, REPLAY, gate)
        await asyncio.wait_for(gate.started.wait(), 5)
        registry.close()
        assert registry.ready()
        assert registry.blocker_count() == 0
        assert registry.counts()["running_replay"] == 1
        assert registry.export(["r"]) == {"r": "before"}

        # the replay step ends while the checkpoint is still open: nothing the export saw changes
        gate.release.set()
        await _until(lambda: episode.state is EpisodeState.PARKED)
        await _settle()
        assert not task.done()
        assert registry.ready()
        assert episode.boundary == "before"
        assert registry.export(["r"]) == {"r": "before"}

        registry.open()
        assert await asyncio.wait_for(task, 5) == "out"
        assert episode.boundary == {"after": "out"}

    arun(main())


def test_replay_step_ending_while_open_records_at_once() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r")
        gate = Gate("out")
        gate.release.set()
        assert await start(episode, REPLAY, gate) == "out"
        assert episode.boundary == {"after": "out"}

    arun(main())


def test_park_waits_at_the_current_boundary() -> None:
    async def main() -> None:
        clock = manual_clock()
        registry = EpisodeRegistry(now=clock)
        episode = registry.begin("r")
        await episode.park()  # open: returns at once
        registry.close()
        parked = asyncio.ensure_future(episode.park())
        await _until(lambda: episode.state is EpisodeState.PARKED)
        clock.advance(3)
        registry.open()
        await asyncio.wait_for(parked, 5)
        assert episode.parked_seconds == 3

    arun(main())


# ---------------------------------------------------------------- E2: export, restore, resume races


def test_export_without_boundary_is_start_over_and_restored_starts_at_its_boundary() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        fresh = registry.begin("fresh")
        restored = registry.begin("old-a1", restored_boundary={"turn": 3}, restored=True)
        restored_empty = registry.begin("other-a1", restored=True)
        assert restored.restored
        assert not fresh.restored
        registry.close()
        scope = ["fresh", "old-a1", "other-a1", "not-live"]
        assert registry.export(scope) == {"fresh": None, "old-a1": {"turn": 3}, "other-a1": None}
        assert registry.export(["old-a1"]) == {"old-a1": {"turn": 3}}
        assert registry.export([]) == {}
        registry.open()
        gate = Gate(4)
        gate.release.set()
        await start(restored, WAIT, gate)
        assert registry.export(scope) == {"fresh": None, "old-a1": {"after": 4}, "other-a1": None}
        assert restored_empty.boundary is None

    arun(main())


@pytest.mark.parametrize("where", ["before", "after_wait", "holding_replay"])
def test_woken_episode_stays_parked_if_admission_closed_again_before_it_ran(where: str) -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r", restored_boundary="before", restored=True)
        gate = Gate("out", registry=registry)
        if where == "before":
            registry.close()
            task = start(episode, WAIT, gate)
        else:
            task = start(episode, WAIT if where == "after_wait" else REPLAY, gate)
            await asyncio.wait_for(gate.started.wait(), 5)
            registry.close()
            gate.release.set()
        await _until(lambda: episode.state is EpisodeState.PARKED)
        expected_boundary = episode.boundary

        registry.open()
        registry.close()  # before the woken episode got to run
        await _settle()
        assert episode.state is EpisodeState.PARKED
        assert not task.done()
        assert episode.boundary == expected_boundary
        assert gate.started_while_closed is False
        assert gate.calls == (0 if where == "before" else 1)

        registry.open()
        if where == "before":
            await asyncio.wait_for(gate.started.wait(), 5)
            gate.release.set()
        assert await asyncio.wait_for(task, 5) == "out"
        assert not gate.started_while_closed
        assert episode.boundary == {"after": "out"}

    arun(main())


# ---------------------------------------------------------------- retiring


def test_retiring_episode_blocks_whatever_its_state_and_is_never_exported() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        idle = registry.begin("idle", restored_boundary="b", restored=True)
        replaying = registry.begin("replaying")
        restart = registry.begin("restart")
        await restart.mark_restart()
        gate = Gate()
        task = start(replaying, REPLAY, gate)
        await asyncio.wait_for(gate.started.wait(), 5)

        with registry.retiring("idle") as got:
            assert got is idle
            assert idle.retiring
            assert registry.blocker_count() == 1
        with registry.retiring("replaying"), registry.retiring("restart"), registry.retiring("not-live") as none:
            assert none is None
        assert registry.restarts() == []  # a retiring restart is listed as a blocker only

        # the mark outlives the block (a retire cut short): the next checkpoint is blocked
        registry.close()
        calls: list[int] = []
        registry.add_listener(lambda: calls.append(registry.blocker_count()))
        assert not registry.ready()
        assert sorted(registry.blockers()) == ["idle", "replaying", "restart"]
        assert registry.counts()["retiring"] == 3
        assert registry.export(["idle", "replaying", "restart"]) == {}

        idle.end()
        restart.end()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not registry.ready()
        replaying.end()
        assert registry.ready()
        assert calls == [2, 1, 0]
        assert registry.counts()["retiring"] == 0
        assert registry.counts()["live"] == 0

    arun(main())


# ---------------------------------------------------------------- E3: restarts


def test_restart_never_blocks_is_never_exported_and_is_listed() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r")
        other = registry.begin("s")
        gate = Gate()
        task = start(episode, WAIT, gate)
        await asyncio.wait_for(gate.started.wait(), 5)
        await episode.mark_restart()
        await episode.mark_restart()  # idempotent
        assert episode.restart
        registry.close()
        assert registry.ready()
        assert registry.restarts() == ["r"]
        assert registry.counts()["restarts"] == 1
        assert registry.export(["r", "s"]) == {"s": None}
        assert other.boundary is None
        registry.open()
        gate.release.set()
        await task

    arun(main())


def test_marking_a_restart_waits_while_closed() -> None:
    async def main() -> None:
        clock = manual_clock()
        registry = EpisodeRegistry(now=clock)
        episode = registry.begin("r")
        registry.close()
        marking = asyncio.ensure_future(episode.mark_restart())
        await _settle()
        assert not marking.done()
        assert not episode.restart
        assert registry.restarts() == []
        assert registry.export(["r"]) == {"r": None}
        clock.advance(7)
        # the same close, open, close race as for steps: the mark still waits
        registry.open()
        registry.close()
        await _settle()
        assert not marking.done()
        assert registry.restarts() == []
        registry.open()
        await asyncio.wait_for(marking, 5)
        assert registry.restarts() == ["r"]
        assert episode.parked_seconds == 7

    arun(main())


def test_restarts_are_never_capped() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        for i in range(250):
            await registry.begin(f"r{i}").mark_restart()
        assert len(registry.restarts()) == 250

    arun(main())


# ---------------------------------------------------------------- readiness and listeners


def test_blockers_are_capped_and_ready_matches_the_count() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        for i in range(150):
            registry.mark_retiring(registry.begin(f"r{i}").key)
        assert registry.blocker_count() == 150
        assert not registry.ready()
        assert len(registry.blockers()) == 100
        assert registry.blockers(limit=3) == ["r0", "r1", "r2"]
        assert registry.blockers(limit=0) == []
        for key in registry.live_keys():
            registry.get(key).end()  # type: ignore[union-attr]
        assert registry.ready()
        assert registry.blocker_count() == 0

    arun(main())


def test_listeners_fire_only_while_closed(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        calls: list[tuple[bool, bool]] = []
        registry.add_listener(lambda: calls.append((registry.closed, registry.ready())))

        def broken() -> None:
            raise ValueError("listener bug")

        registry.add_listener(broken)
        episode = registry.begin("r")

        # open: a wait step starting and ending notifies nobody
        gate = Gate()
        gate.release.set()
        await start(episode, WAIT, gate)
        assert calls == []

        gate = Gate()
        task = start(episode, WAIT, gate)
        await asyncio.wait_for(gate.started.wait(), 5)
        registry.close()
        assert calls == []
        gate.release.set()
        await _until(lambda: episode.state is EpisodeState.PARKED)
        assert calls == [(True, True)]
        registry.open()
        await asyncio.wait_for(task, 5)
        assert calls == [(True, True)]
        registry.remove_listener(broken)
        registry.remove_listener(broken)  # no error

    with caplog.at_level(logging.ERROR, logger="gymckpt.participants.steps"):
        arun(main())
    assert "listener" in caplog.text


class CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts how often a large one is iterated."""

    iterations = 0

    def _count(self) -> None:
        if len(self) > 100:
            CountingDict.iterations += 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        self._count()
        return super().__iter__()

    def keys(self):  # type: ignore[no-untyped-def]
        self._count()
        return super().keys()

    def values(self):  # type: ignore[no-untyped-def]
        self._count()
        return super().values()

    def items(self):  # type: ignore[no-untyped-def]
        self._count()
        return super().items()


def test_readiness_is_a_running_count_with_ten_thousand_episodes() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episodes = [registry.begin(f"r{i}") for i in range(10_000)]
        gates = [Gate(i) for i in range(2_000)]
        tasks = [start(episodes[i], WAIT, gates[i]) for i in range(2_000)]
        await asyncio.wait_for(asyncio.gather(*(gate.started.wait() for gate in gates)), 10)

        # from here on, no large collection of the registry may be iterated by readiness or steps
        for name, value in list(vars(registry).items()):
            if isinstance(value, dict):
                setattr(registry, name, CountingDict(value))
        CountingDict.iterations = 0
        ready_changes: list[bool] = []
        registry.add_listener(lambda: ready_changes.append(registry.ready()))

        registry.close()
        assert registry.blocker_count() == 2_000
        for gate in gates[:1_999]:
            gate.release.set()
        await _until(lambda: registry.blocker_count() == 1)
        assert not registry.ready()
        gates[1_999].release.set()
        await _until(registry.ready)
        assert registry.blocker_count() == 0
        assert registry.counts()["parked"] == 2_000
        assert len(ready_changes) == 2_000
        assert ready_changes[-1] is True
        assert not any(ready_changes[:-1])
        assert CountingDict.iterations == 0, "readiness or a step iterated over every episode"

        assert registry.blockers(limit=10) == []
        registry.open()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert CountingDict.iterations == 0

    arun(main())


# ---------------------------------------------------------------- cancellation and lifecycle


def test_cancel_while_parked_or_running_keeps_counts_consistent() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        parked = registry.begin("parked")
        waiting = registry.begin("waiting", restored_boundary="w0", restored=True)
        holding = registry.begin("holding", restored_boundary="h0", restored=True)
        wait_gate, hold_gate = Gate(), Gate()
        wait_task = start(waiting, WAIT, wait_gate)
        hold_task = start(holding, REPLAY, hold_gate)
        await asyncio.wait_for(asyncio.gather(wait_gate.started.wait(), hold_gate.started.wait()), 5)
        registry.close()
        parked_gate = Gate()
        parked_task = start(parked, WAIT, parked_gate)
        hold_gate.release.set()
        await _until(lambda: parked.state is EpisodeState.PARKED and holding.state is EpisodeState.PARKED)
        notified: list[int] = []
        registry.add_listener(lambda: notified.append(registry.blocker_count()))
        assert registry.blocker_count() == 1
        assert registry.counts()["parked"] == 2

        for task in (parked_task, hold_task, wait_task):
            task.cancel()
        for task in (parked_task, hold_task, wait_task):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert registry.ready()
        assert notified == [0]
        counts = registry.counts()
        assert counts["idle"] == 3
        assert counts["parked"] == counts["running_wait"] == counts["running_replay"] == 0
        assert parked_gate.calls == 0
        assert (waiting.boundary, holding.boundary) == ("w0", "h0")
        assert registry.export(registry.live_keys()) == {"parked": None, "waiting": "w0", "holding": "h0"}

        # the episodes can step again after a cancelled step
        registry.open()
        gate = Gate("again")
        gate.release.set()
        assert await start(holding, REPLAY, gate) == "again"

    arun(main())


def test_end_during_a_parked_wait() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r")
        registry.close()
        gate = Gate()
        task = start(episode, WAIT, gate)
        await _until(lambda: episode.state is EpisodeState.PARKED)
        episode.end()
        episode.end()  # idempotent
        assert episode.ended
        assert registry.get("r") is None
        assert registry.counts() == dict.fromkeys(registry.counts(), 0)
        # the key can start a new episode; the old one's late transitions do not touch it
        again = registry.begin("r")
        registry.open()
        with pytest.raises(EpisodeEnded):
            await asyncio.wait_for(task, 5)
        assert gate.calls == 0
        assert registry.get("r") is again
        assert registry.counts()["live"] == registry.counts()["idle"] == 1

    arun(main())


def test_end_while_running_and_after() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        with registry.begin("r") as episode:
            gate = Gate("out")
            task = start(episode, WAIT, gate)
            await asyncio.wait_for(gate.started.wait(), 5)
            registry.close()
            assert registry.blocker_count() == 1
        assert episode.ended
        assert registry.ready()
        gate.release.set()
        assert await asyncio.wait_for(task, 5) == "out"  # an ended episode does not park
        assert registry.counts()["live"] == 0
        with pytest.raises(EpisodeEnded):
            await episode.step(WAIT, gate, boundary=boundary_of)
        await episode.mark_restart()  # no effect once ended
        assert registry.restarts() == []

    arun(main())


def test_one_step_at_a_time_and_unique_keys() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        episode = registry.begin("r")
        with pytest.raises(ValueError, match="already live"):
            registry.begin("r")
        gate = Gate()
        task = start(episode, REPLAY, gate)
        await asyncio.wait_for(gate.started.wait(), 5)
        with pytest.raises(RuntimeError, match="already in a step"):
            await episode.step(REPLAY, gate, boundary=boundary_of)
        with pytest.raises(RuntimeError, match="in a step"):
            await episode.park()
        gate.release.set()
        await task
        with pytest.raises(ValueError):
            await episode.step("sometimes", gate, boundary=boundary_of)

    arun(main())


def test_close_and_open_are_idempotent_and_begin_while_closed_parks() -> None:
    async def main() -> None:
        registry = EpisodeRegistry()
        registry.open()
        registry.close()
        registry.close()
        assert registry.closed
        episode = registry.begin("late")
        gate = Gate(registry=registry)
        task = start(episode, REPLAY, gate)
        await _until(lambda: episode.state is EpisodeState.PARKED)
        registry.open()
        registry.open()
        gate.release.set()
        await asyncio.wait_for(task, 5)
        assert not gate.started_while_closed

    arun(main())


# ---------------------------------------------------------------- random sequences

KEYS = [f"e{i}" for i in range(5)]


@dataclass(eq=False)
class Model:
    """What the machine expects of one episode, kept without asking the registry."""

    key: str
    episode: Episode
    boundary: object
    restart: bool = False
    retiring: bool = False
    ended: bool = False
    task: asyncio.Task[object] | None = None
    mode: StepMode | None = None
    result: object = None
    release: asyncio.Event | None = None
    in_run: bool = False
    run_returned: bool = False
    mark: asyncio.Task[None] | None = None
    mark_epoch: int | None = None  # opens seen when the mark was asked while closed


class StepsMachine(RuleBasedStateMachine):
    """Random begin/step/finish/cancel/close/open/restart/retire/end sequences on one loop."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.registry = EpisodeRegistry()
        self.live: dict[str, Model] = {}
        self.models: list[Model] = []
        self.violations: list[str] = []
        self.notified = 0
        self.opens = 0
        self.results = itertools.count()
        self.registry.add_listener(self._listener)
        self.seen: tuple[bool, int, int, int] = (False, 0, 0, 0)

    def _listener(self) -> None:
        if not self.registry.closed:
            self.violations.append("listener called while open")
        self.notified += 1

    def _settle(self) -> None:
        self.loop.run_until_complete(_settle())
        for model in self.models:
            self._reap(model)

    def _reap(self, model: Model) -> None:
        task = model.task
        if task is not None and task.done():
            model.task = None
            if task.cancelled():
                pass
            elif task.exception() is not None:
                if not (isinstance(task.exception(), EpisodeEnded) and model.ended):
                    self.violations.append(f"{model.key}: step raised {task.exception()!r}")
            else:
                if self.registry.closed and not model.ended:
                    self.violations.append(f"{model.key}: step returned while admission was closed")
                if model.mode is REPLAY and not model.ended:
                    model.boundary = ("B", model.result)
        mark = model.mark
        if mark is not None and mark.done():
            model.mark = None
            if not mark.cancelled() and not model.ended:
                if model.mark_epoch is not None and model.mark_epoch == self.opens:
                    self.violations.append(f"{model.key}: restart marked while admission was closed")
                model.restart = True

    def teardown(self) -> None:
        for model in self.models:
            for task in (model.task, model.mark):
                if task is not None:
                    task.cancel()
        self.loop.run_until_complete(_settle())
        self.loop.close()

    # ------------------------------------------------------------- rules

    @initialize()
    def start_with_one(self) -> None:
        self._begin("e0", restored=False)

    def _begin(self, key: str, restored: bool) -> None:
        boundary = f"restored-{key}" if restored else None
        episode = self.registry.begin(key, restored_boundary=boundary, restored=restored)
        model = Model(key, episode, boundary)
        self.live[key] = model
        self.models.append(model)

    @rule(key=st.sampled_from(KEYS), restored=st.booleans())
    def begin(self, key: str, restored: bool) -> None:
        if key not in self.live:
            self._begin(key, restored)

    @precondition(lambda self: any(m.task is None for m in self.live.values()))
    @rule(data=st.data(), mode=st.sampled_from(StepMode))
    def start_step(self, data: st.DataObject, mode: StepMode) -> None:
        model = data.draw(st.sampled_from([m for m in self.live.values() if m.task is None]))
        model.mode = mode
        model.result = next(self.results)
        model.release = asyncio.Event()
        model.run_returned = False
        release, result, registry = model.release, model.result, self.registry

        async def run() -> object:
            if registry.closed:
                self.violations.append(f"{model.key}: a step started while admission was closed")
            model.in_run = True
            try:
                await release.wait()
            finally:
                model.in_run = False
            model.run_returned = True
            return result

        model.task = self.loop.create_task(model.episode.step(mode, run, boundary=lambda r: ("B", r)))
        self._settle()

    @precondition(lambda self: any(m.in_run for m in self.models))
    @rule(data=st.data())
    def finish_run(self, data: st.DataObject) -> None:
        model = data.draw(st.sampled_from([m for m in self.models if m.in_run]))
        assert model.release is not None
        model.release.set()
        self._settle()
        if not model.run_returned:
            self.violations.append(f"{model.key}: run did not return once released")
        if model.mode is WAIT and not model.ended:
            model.boundary = ("B", model.result)

    @precondition(lambda self: any(m.task is not None for m in self.models))
    @rule(data=st.data())
    def cancel_step(self, data: st.DataObject) -> None:
        model = data.draw(st.sampled_from([m for m in self.models if m.task is not None]))
        assert model.task is not None
        model.task.cancel()
        self._settle()

    @rule()
    def close(self) -> None:
        self.registry.close()
        self._settle()

    @rule()
    def open(self) -> None:
        was_closed = self.registry.closed
        self.registry.open()
        if was_closed:
            self.opens += 1
        self._settle()
        for model in self.live.values():
            if model.mark is not None:
                self.violations.append(f"{model.key}: restart still waiting after open")

    @precondition(lambda self: self.registry.closed)
    @rule()
    def reopen_and_close_at_once(self) -> None:
        self.registry.open()
        self.opens += 1
        self.registry.close()
        self._settle()

    @precondition(lambda self: any(m.mark is None and not m.restart for m in self.live.values()))
    @rule(data=st.data())
    def mark_restart(self, data: st.DataObject) -> None:
        model = data.draw(st.sampled_from([m for m in self.live.values() if m.mark is None and not m.restart]))
        model.mark_epoch = self.opens if self.registry.closed else None
        model.mark = self.loop.create_task(model.episode.mark_restart())
        self._settle()

    @rule(key=st.sampled_from([*KEYS, "not-live"]))
    def retire(self, key: str) -> None:
        with self.registry.retiring(key) as episode:
            model = self.live.get(key)
            assert episode is (model.episode if model is not None else None)
            if model is not None:
                model.retiring = True

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), cancel_first=st.booleans())
    def end(self, data: st.DataObject, cancel_first: bool) -> None:
        model = data.draw(st.sampled_from(list(self.live.values())))
        if cancel_first:
            for task in (model.task, model.mark):
                if task is not None:
                    task.cancel()
            self._settle()
        model.episode.end()
        model.ended = True
        del self.live[model.key]
        self._settle()

    # ------------------------------------------------------------- invariants

    @invariant()
    def readiness_is_a_correct_running_count(self) -> None:
        registry = self.registry
        blockers = {k for k, m in self.live.items() if m.retiring or (not m.restart and m.in_run and m.mode is WAIT)}
        assert registry.blocker_count() == len(blockers)
        assert set(registry.blockers(limit=1000)) == blockers
        assert registry.ready() == (not blockers)

    @invariant()
    def restarts_and_retiring_are_never_exported(self) -> None:
        registry = self.registry
        assert set(registry.restarts()) == {k for k, m in self.live.items() if m.restart and not m.retiring}
        expected = {k: m.boundary for k, m in self.live.items() if not m.restart and not m.retiring}
        assert registry.export([*KEYS, "not-live"]) == expected

    @invariant()
    def counts_match_the_model(self) -> None:
        counts = self.registry.counts()
        live = self.live.values()
        running_wait = sum(1 for m in live if m.in_run and m.mode is WAIT)
        running_replay = sum(1 for m in live if m.in_run and m.mode is REPLAY)
        parked = sum(1 for m in live if m.task is not None and not m.in_run)
        if not self.registry.closed:
            assert parked == 0, "a step is stuck although admission is open"
        assert counts["live"] == len(self.live)
        assert counts["running_wait"] == running_wait
        assert counts["running_replay"] == running_replay
        assert counts["parked"] == parked
        assert counts["idle"] == len(self.live) - running_wait - running_replay - parked
        assert counts["retiring"] == sum(1 for m in live if m.retiring)
        assert sorted(self.registry.live_keys()) == sorted(self.live)

    @invariant()
    def listeners_fire_on_every_change_while_closed(self) -> None:
        was_closed, opens, blockers, notified = self.seen
        now = (self.registry.closed, self.opens, self.registry.blocker_count(), self.notified)
        if was_closed and now[0] and opens == now[1] and blockers != now[2]:
            assert self.notified > notified, "the blocker count changed while closed without a notification"
        self.seen = now

    @invariant()
    def no_violations(self) -> None:
        assert self.violations == []


StepsMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_steps_state_machine = StepsMachine.TestCase
