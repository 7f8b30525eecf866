"""When the full demo checkpoints by turn: the trigger is watched while the rollouts start.

A stand-in stack answers ``run`` and ``rollouts_by_turn`` in process (the layer under test is
:func:`~gymckpt.demo.launch.launch_rollouts`, not the servers): the rollouts it was asked to
start are the ones the trainer started, and it reports them at the turns the test gives.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

from rich.console import Console

from gymckpt.demo.launch import TurnTrigger, launch_rollouts
from gymckpt.demo.report import DemoOutcome, render

ROLLOUTS = 10
#: the launch window's upper bound: the second half would start one a second
SLOW_WINDOW = 5.0


class StandInStack:
    """``run`` waits until the test ends it (``quick`` ones end at once); ``rollouts_by_turn`` reports ``at_turn_two``."""

    def __init__(self, *, quick: tuple[str, ...] = (), at_turn_two: Any = None) -> None:
        self.started: list[str] = []
        self.quick = quick
        self.release = asyncio.Event()
        self.at_turn_two = at_turn_two or (lambda started: len(started))

    async def run(self, key: str, task: dict[str, Any]) -> dict[str, Any]:
        self.started.append(key)
        if key not in self.quick:
            await self.release.wait()
        return {"key": key}

    async def rollouts_by_turn(self) -> dict[str, int]:
        return {"1": 0, "2": self.at_turn_two(self.started)}


def _tasks() -> dict[str, dict[str, Any]]:
    return {f"{index}-0": {"index": index} for index in range(ROLLOUTS)}


async def _launch(stack: StandInStack, trigger: TurnTrigger) -> Any:
    spawned: list[asyncio.Task[Any]] = []

    def spawn(coroutine: Any) -> asyncio.Task[Any]:
        spawned.append(asyncio.create_task(coroutine))
        return spawned[-1]

    try:
        async with asyncio.timeout(30):
            return await launch_rollouts(
                stack,  # type: ignore[arg-type]
                _tasks(),
                spawn=spawn,
                median_rollout=SLOW_WINDOW,
                checkpoint_after=0.5,
                trigger=trigger,
            )
    finally:
        stack.release.set()
        await asyncio.gather(*spawned)


def test_a_trigger_reached_while_rollouts_start_stops_the_launch_and_leaves_the_rest_for_after_the_restore() -> None:
    """Half start at once and are all at turn 2: the trigger's share (half) is reached before the
    second half's first one is due, so none of it starts; they are the launch's unlaunched."""
    stack = StandInStack()
    launch = asyncio.run(_launch(stack, TurnTrigger(turn=2, share=0.5)))
    first_half = [f"{index}-0" for index in range(ROLLOUTS // 2)]
    assert stack.started == first_half
    assert sorted(launch.runs) == first_half
    assert launch.unlaunched == [f"{index}-0" for index in range(ROLLOUTS // 2, ROLLOUTS)]
    assert launch.at_turn == ROLLOUTS // 2


def test_a_trigger_not_reached_while_rollouts_start_leaves_none_unlaunched() -> None:
    """Nobody at turn 2 until every rollout started: the first one's finish starts the rest at once, and the
    trigger fires after the launch, on every rollout in flight at the turn."""
    stack = StandInStack(quick=("0-0",), at_turn_two=lambda started: len(started) if len(started) == ROLLOUTS else 0)
    launch = asyncio.run(_launch(stack, TurnTrigger(turn=2, share=0.5)))
    assert stack.started == list(_tasks())
    assert launch.unlaunched == []
    assert launch.at_turn == ROLLOUTS - 1  # the quick one finished


def _table(outcome: DemoOutcome) -> str:
    buffer = io.StringIO()
    render(outcome, Console(file=buffer, width=200, color_system=None))
    return " ".join(buffer.getvalue().split())


def test_the_table_says_how_many_rollouts_started_only_after_the_restore() -> None:
    """Rollouts the launch left for after the restore have a row of their own (none: no row)."""
    outcome = DemoOutcome(rollouts=4, store_url="ckpts", compared=True, exported=["0-0", "1-0"])
    outcome.continued, outcome.started_after_restore = ["0-0", "1-0"], ["2-0", "3-0"]
    assert "started after the restore │ 2 │ not started before the checkpoint" in _table(outcome)
    outcome.started_after_restore = []
    assert "started after the restore" not in _table(outcome)
