"""The control plane's background tasks: shielded work whose outcome is always retrieved."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gymckpt.store import CheckpointStore

__all__ = ["close_store", "settled", "spawn", "succeeded"]

logger = logging.getLogger("gymckpt.control")


async def close_store(store: CheckpointStore) -> None:
    """Close a commit's or restore's store off the loop (an S3 client's close blocks); never raises."""
    try:
        await asyncio.to_thread(store.close)
    except Exception:
        logger.warning("closing the checkpoint store %s failed", store.url, exc_info=True)


async def settled(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end without cancelling it and without raising its outcome.

    Cancelling the waiter (a deadline) still cancels the wait: ``asyncio.wait`` neither
    swallows that nor passes it on to ``task``.
    """
    await asyncio.wait({task})


def spawn(coroutine: Any, name: str) -> asyncio.Task[Any]:
    """A task whose failure is always retrieved: its callers may have given up waiting."""
    task = asyncio.create_task(coroutine, name=name)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    return task


def succeeded(task: asyncio.Task[Any]) -> bool:
    return not task.cancelled() and task.exception() is None
