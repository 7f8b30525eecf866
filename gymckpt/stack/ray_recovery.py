"""Recovering a Ray stack after a node's loss: place again, restore the last published checkpoint, resume.

:func:`recover` is the controller's side of M3: every server placed again on the nodes alive
(:meth:`~gymckpt.stack.ray.RayStack.replace`), the checkpoint restored through the harness's
coordinator, every participant resumed; a node lost meanwhile fails that restore, and a new
placement and restore follow. Each placement leaves out every node the stack knows lost
(:attr:`~gymckpt.stack.ray.RayStack.lost_nodes`), so it does not wait for Ray's health checks
to declare those nodes dead. Ray is reached only through the :class:`~gymckpt.stack.ray.RayStack`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gymckpt.errors import NodeLost, RayHeadLost

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gymckpt.control.coordination import Coordinator
    from gymckpt.stack.harness import RestoreOutcome, RolloutHarness
    from gymckpt.stack.ray import RayStack

__all__ = ["Recovery", "recover"]

logger = logging.getLogger(__name__)


@dataclass
class Recovery:
    """What :func:`recover` did: the restore, the coordinator of the placed stack, each placement's failure."""

    coordinator: Coordinator
    restored: RestoreOutcome
    placements: list[dict[str, str]]
    failures: list[str]
    seconds: float


async def recover(
    stack: RayStack,
    harness: RolloutHarness,
    checkpoint_id: str,
    directory: str,
    scope: list[str],
    *,
    workers: dict[str, int] | int | None = None,
    attempts: int = 3,
    deadline_seconds: float = 120.0,
    before_restore: Callable[[int], Awaitable[None]] | None = None,
    keep_resources: bool = True,
) -> Recovery:
    """Place every server again on the nodes alive, restore ``checkpoint_id`` from ``directory`` and resume.

    A restore (or the stack's coming up) that fails because another node died meanwhile is
    followed by a new placement and another restore, up to ``attempts`` placements; a failure
    with no node lost is raised as it is. ``before_restore(attempt)`` runs once the placed
    stack answers, before its restore (a test's fault); ``keep_resources`` as for
    :meth:`RayStack.place`. Raises :class:`NodeLost` when every
    attempt lost a node, :class:`RayHeadLost` when the head is gone.
    """
    began = time.perf_counter()
    failures: list[str] = []
    placements: list[dict[str, str]] = []
    for attempt in range(attempts):
        placements.append(await asyncio.to_thread(stack.replace, workers=workers, keep_resources=keep_resources))
        gym: Coordinator | None = None
        try:
            gym = await harness.wait_ready(timeout=deadline_seconds)
            if before_restore is not None:
                await before_restore(attempt)
            restored = await harness.restore(gym, checkpoint_id, directory, scope, deadline_seconds=deadline_seconds)
            await gym.resume(checkpoint_id, time.time() + deadline_seconds)
            await asyncio.to_thread(stack.check)
            return Recovery(gym, restored, placements, failures, time.perf_counter() - began)
        except (RayHeadLost, asyncio.CancelledError):
            if gym is not None:
                await gym.close()
            raise
        except Exception as exc:
            if gym is not None:
                await gym.close()
            dead = await asyncio.to_thread(stack.wait_lost, 5.0)
            if not dead:
                raise
            failures.append(f"placement {attempt + 1}: {', '.join(dead)} lost ({type(exc).__name__}: {exc})")
            logger.warning("recovery: %s; placing the stack again", failures[-1])
    raise NodeLost(f"every one of {attempts} placements lost a node: {'; '.join(failures)}")
