"""Time in tests of a server built on gymckpt: an injectable clock, and waits that cannot hang.

- :class:`FakeClock`: the ``clock`` a :class:`~gymckpt.control.plane.ControlPlane` (or an
  episode registry) reads, moved by hand over lease times and deadlines.
- :func:`bounded`, :func:`run_bounded`: await, or run on a fresh event loop, with a time
  bound, so a hang fails the test instead of blocking the run (no pytest-asyncio needed).
- :func:`until`, :func:`drain`: let the event loop run until a condition holds, or until
  every ready task has blocked, without sleeping to synchronize.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

__all__ = ["WAIT", "FakeClock", "bounded", "drain", "run_bounded", "until"]

#: the default bound of one wait, in seconds (only a bug reaches it)
WAIT = 10.0

T = TypeVar("T")


class FakeClock:
    """An injectable clock the test moves by hand: a source clock plus the jumps the test makes.

    By default it reads epoch seconds (``time.time()``) and runs at the real rate from where
    the test put it, so a deadline a few hundredths of a second ahead still passes while the
    test jumps the clock over lease times. ``start`` puts it at that value now; ``source``
    is what it runs with (``time.monotonic`` for a clock wall-clock steps cannot move, or
    ``None`` for one that stands still between the test's moves)::

        clock = FakeClock()
        plane = ControlPlane(participant, clock=clock)
        clock.advance(611.0)  # past the lease
    """

    def __init__(self, start: float | None = None, *, source: Callable[[], float] | None = time.time) -> None:
        self.source = source
        self.offset = 0.0
        if start is not None:
            self.set(start)

    def _base(self) -> float:
        return self.source() if self.source is not None else 0.0

    def __call__(self) -> float:
        return self._base() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead (or back, for a negative number)."""
        self.offset += seconds

    def set(self, value: float) -> None:
        """Put the clock at ``value`` now."""
        self.offset = value - self._base()


async def bounded(awaitable: Awaitable[T], timeout: float = WAIT) -> T:
    """Await ``awaitable`` for at most ``timeout`` seconds (:class:`TimeoutError` after that)."""
    return await asyncio.wait_for(awaitable, timeout)


def run_bounded(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run ``coro`` on a fresh event loop (:func:`asyncio.run`), bounded by ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(
    condition: Callable[[], bool],
    timeout: float | None = WAIT,
    *,
    interval: float = 0.0,
    rounds: int | None = None,
    message: str = "condition never held",
) -> None:
    """Let the event loop run until ``condition()`` holds.

    Between checks it sleeps ``interval`` seconds (0: one turn of the loop, no time passes
    on purpose). It raises :class:`AssertionError` (``message``) once ``timeout`` seconds
    have passed, or after ``rounds`` checks that failed (a bound that needs no clock);
    ``None`` leaves that bound out.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    checks = 0
    while not condition():
        checks += 1
        if rounds is not None and checks >= rounds:
            raise AssertionError(message)
        if deadline is not None and time.monotonic() >= deadline:
            raise AssertionError(message)
        await asyncio.sleep(interval)


async def drain(rounds: int = 50) -> None:
    """Let every ready task run until it blocks (pure event-loop scheduling, no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
