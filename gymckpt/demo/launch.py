"""When the full demo checkpoints: every rollout started over a window, then a trigger by count or by turn.

- By count (the default): once a share of the rollouts have finished.
- By turn (:class:`TurnTrigger`): once a share of the rollouts are still in flight and have
  started turn ``turn`` or a later one (turn 1 is a rollout's first model call, turn 2 its
  second, after its first tool call), as the inference backend's ``GET /turns`` counts them.
  So most in-flight rollouts at the checkpoint are past their first turn and carry a
  conversation, ledger rows and a cut each. Once that share is out of reach (fewer rollouts
  left in flight than it asks, or every one left at the turn already), the checkpoint is
  taken then, when nearly all of those left in flight are past the turn. The trigger is
  watched from the start: reached before every rollout started, the rest start after the
  restore.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping

    from gymckpt.stack.harness import RolloutHarness

__all__ = [
    "LAUNCH_WINDOW_BOUNDS",
    "Launch",
    "TurnTrigger",
    "in_flight_at_turn",
    "launch_rollouts",
    "past_first_turn",
    "trigger_target",
]

#: the bounds of the launch window (seconds), whatever the uninterrupted run measured
LAUNCH_WINDOW_BOUNDS = (0.2, 5.0)
#: how often the turn trigger asks the inference backend where the rollouts stand (seconds)
TURN_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class TurnTrigger:
    """Checkpoint once ``share`` of all rollouts are in flight at turn ``turn`` or later."""

    turn: int = 2
    share: float = 0.6

    @classmethod
    def of(cls, value: TurnTrigger | int | Mapping[str, Any] | None) -> TurnTrigger | None:
        """A trigger from itself, its turn (the default share), or its fields (``{"turn", "share"}``)."""
        if value is None or isinstance(value, TurnTrigger):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(turn=value)
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"a checkpoint turn is a TurnTrigger, an int or a dict, not {type(value).__name__}")

    def __post_init__(self) -> None:
        if self.turn < 1:
            raise ValueError("the checkpoint turn counts from 1 (a rollout's first model call)")
        if not 0 < self.share < 1:
            raise ValueError("the share of rollouts in flight at the checkpoint turn is between 0 and 1")


@dataclass
class Launch:
    """What launching did: the ``/run`` tasks by rollout id, and when the checkpoint was triggered."""

    runs: dict[str, asyncio.Task[dict[str, Any]]]
    launch_seconds: float
    peak_in_flight: int
    #: in-flight rollouts at the trigger's turn or later when it fired (by-turn trigger only; else 0)
    at_turn: int = 0
    #: the most there were while the trigger waited
    peak_at_turn: int = 0
    #: rollouts not started when the trigger was reached during the launch: they start after the restore
    unlaunched: list[str] = field(default_factory=list)


def in_flight_at_turn(rollouts_by_turn: Mapping[str, int], turn: int, finished: int) -> int:
    """How many rollouts still in flight have started ``turn`` or a later one.

    ``rollouts_by_turn`` is the backend's count of rollouts by the latest turn they started;
    ``finished`` rollouts reached their last turn (at least ``turn`` when it is reachable) and
    are taken off.
    """
    reached = sum(count for name, count in rollouts_by_turn.items() if int(name) >= turn)
    return max(reached - finished, 0)


def past_first_turn(stages: Mapping[str, int]) -> int:
    """Exported rollouts past their first turn, from the demo's stage labels (``agent turn 2``, ``verifying``…)."""
    total = 0
    for label, count in stages.items():
        if label in ("verifying", "verified"):
            total += count
        elif label.startswith("agent turn ") and label[len("agent turn ") :].isdigit():
            total += count if int(label[len("agent turn ") :]) >= 2 else 0
    return total


async def launch_rollouts(
    stack: RolloutHarness,
    tasks: Mapping[str, dict[str, Any]],
    *,
    spawn: Callable[[Coroutine[Any, Any, dict[str, Any]]], asyncio.Task[dict[str, Any]]],
    median_rollout: float,
    checkpoint_after: float,
    trigger: TurnTrigger | None,
) -> Launch:
    """Start every rollout, then wait for the checkpoint's moment (the caller bounds the time).

    The first half starts at once; the second half one by one over the uninterrupted run's
    median rollout, and whatever is left when the first rollout finishes starts then. So
    every rollout is running just before the first ones finish. Then: ``checkpoint_after``
    of them finished (no ``trigger``), or the ``trigger``'s share in flight at its turn.

    A ``trigger`` is also watched during the launch: once its share is in flight at its
    turn, no more start and the checkpoint is taken then; the rest start after the restore
    (:attr:`Launch.unlaunched`). Rollouts started together end together, and the trainer
    sees them end late when the machine is loaded: a trigger asked only after the launch
    could fire when most of them had ended at the servers.
    """
    low, high = LAUNCH_WINDOW_BOUNDS
    window = min(max(median_rollout, low), high)
    at_once = (len(tasks) + 1) // 2
    interval = window / max(len(tasks) - at_once, 1)
    runs: dict[str, asyncio.Task[dict[str, Any]]] = {}
    running = peak = 0
    #: set when the first rollout finishes (the rest start at once) or the trigger is reached (none more start)
    go_on = asyncio.Event()
    reached = asyncio.Event()

    def finished(_: object) -> None:
        nonlocal running
        running -= 1
        go_on.set()

    watch = (
        asyncio.create_task(_until_reached(stack, runs, trigger, len(tasks), reached, go_on))
        if trigger is not None
        else None
    )
    began = time.perf_counter()
    try:
        for index, (key, task) in enumerate(tasks.items()):
            # paced against the clock, so a slow loop does not stretch the window
            delay = began + max(index - at_once + 1, 0) * interval - time.perf_counter()
            if delay > 0 and not go_on.is_set():
                try:
                    await asyncio.wait_for(go_on.wait(), delay)
                except TimeoutError:
                    pass
            if reached.is_set():
                break
            runs[key] = spawn(stack.run(key, task))
            running += 1
            runs[key].add_done_callback(finished)
            peak = max(peak, running)
    finally:
        if watch is not None:
            watch.cancel()
            # a failed poll is raised by the trigger's own loop below, asking again
            await asyncio.gather(watch, return_exceptions=True)
    launch = Launch(runs, time.perf_counter() - began, peak, unlaunched=[key for key in tasks if key not in runs])
    if trigger is None:
        target = min(max(int(len(tasks) * checkpoint_after), 1), len(tasks) - 1) if len(tasks) > 1 else 1
        while sum(task.done() for task in runs.values()) < target:
            pending = [task for task in runs.values() if not task.done()]
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return launch
    target = trigger_target(trigger, len(tasks))
    while True:
        at_turn, done = await _at_turn_now(stack, runs, trigger.turn)
        launch.at_turn = at_turn
        launch.peak_at_turn = max(launch.peak_at_turn, at_turn)
        in_flight = len(runs) - done
        if reached.is_set() or at_turn >= target or in_flight < target or in_flight <= at_turn:
            return launch  # reached, or out of reach (too few left in flight, or all of them at the turn)
        pending = [task for task in runs.values() if not task.done()]
        await asyncio.wait(pending, timeout=TURN_POLL_SECONDS)


def trigger_target(trigger: TurnTrigger, rollouts: int) -> int:
    """How many of ``rollouts`` must be in flight at the trigger's turn or later."""
    return max(int(rollouts * trigger.share), 1)


async def _at_turn_now(stack: RolloutHarness, runs: Mapping[str, asyncio.Task[Any]], turn: int) -> tuple[int, int]:
    """The rollouts in flight at ``turn`` or later as the inference backend counts them now, and those finished."""
    done = sum(task.done() for task in runs.values())
    return in_flight_at_turn(await stack.rollouts_by_turn(), turn, done), done


async def _until_reached(
    stack: RolloutHarness,
    runs: Mapping[str, asyncio.Task[Any]],
    trigger: TurnTrigger,
    rollouts: int,
    reached: asyncio.Event,
    go_on: asyncio.Event,
) -> None:
    """Set ``reached`` and ``go_on`` once the trigger's share of ``rollouts`` is in flight at its turn.

    Polled every :data:`TURN_POLL_SECONDS`; the launch cancels it when it ends first.
    """
    target = trigger_target(trigger, rollouts)
    while True:
        if (await _at_turn_now(stack, runs, trigger.turn))[0] >= target:
            reached.set()
            go_on.set()
            return
        await asyncio.sleep(TURN_POLL_SECONDS)
