"""Wait until a condition holds, re-checked whenever its owner says something changed."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ChangeSignal"]


class ChangeSignal:
    """``changed()`` wakes every ``wait_until`` so it re-checks its predicate (no polling)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def changed(self) -> None:
        """Something the predicates read has changed."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> None:
        """Return once ``predicate()`` holds; ``TimeoutError`` after ``timeout`` seconds."""

        async def check() -> None:
            while not predicate():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                await waiter

        await asyncio.wait_for(check(), timeout)
