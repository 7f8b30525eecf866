"""Waiting in participants: until a condition holds (ChangeSignal), or until admission reopens (AdmissionGate)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["AdmissionGate", "ChangeSignal"]


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


class AdmissionGate:
    """Admission of new work: closed by a checkpoint (or a restore), reopened by resume.

    Each close makes a fresh event, so work woken by the last open that has not run yet
    waits again when a new checkpoint closed admission before it ran.
    """

    def __init__(self) -> None:
        self._closed = False
        self._opened: asyncio.Event | None = None

    @property
    def closed(self) -> bool:
        """True while admission is closed."""
        return self._closed

    def close(self) -> bool:
        """Close admission; False when it was closed already (idempotent)."""
        if self._closed:
            return False
        self._closed = True
        self._opened = asyncio.Event()
        return True

    def open(self) -> bool:
        """Reopen admission and wake every waiter; False when it was open already (idempotent)."""
        if not self._closed:
            return False
        self._closed = False
        if self._opened is not None:
            self._opened.set()
        return True

    async def reopened(self) -> None:
        """Wait for the next reopening (at once when admission is open)."""
        if self._closed:
            assert self._opened is not None
            await self._opened.wait()

    async def until_open(self) -> None:
        """Wait until admission is open, again after any close that came before the waiter ran."""
        while self._closed:
            await self.reopened()
