"""The one admission gate: closed by a checkpoint, reopened by resume; a waiter woken but not yet run waits again."""

from __future__ import annotations

import asyncio

from gymckpt.participants.signal import AdmissionGate
from gymckpt.testing.time import bounded, drain


async def test_waiters_pass_at_once_while_open_and_wake_on_open() -> None:
    gate = AdmissionGate()
    await bounded(gate.until_open())  # open: returns at once
    assert gate.close() is True and gate.close() is False and gate.closed
    waiter = asyncio.ensure_future(gate.until_open())
    await drain()
    assert not waiter.done()
    assert gate.open() is True and gate.open() is False and not gate.closed
    await bounded(waiter)


async def test_a_waiter_woken_by_an_open_waits_again_when_a_close_came_before_it_ran() -> None:
    gate = AdmissionGate()
    gate.close()
    waiter = asyncio.ensure_future(gate.until_open())
    await drain()
    gate.open()
    gate.close()  # before the woken waiter ran
    await drain()
    assert not waiter.done()
    gate.open()
    await bounded(waiter)


async def test_reopened_waits_for_one_reopening_only() -> None:
    gate = AdmissionGate()
    await bounded(gate.reopened())
    gate.close()
    once = asyncio.ensure_future(gate.reopened())
    await drain()
    assert not once.done()
    gate.open()
    await bounded(once)
