"""Node drains as preemption notices: watch a cluster's draining nodes, tell a guard once per drain.

A cluster manager drains a node before it takes it away (Ray: ``ray drain-node``, an
autoscaler, a spot instance's preemption, a raylet's own SIGTERM), with a deadline. A
:class:`DrainWatcher` polls ``draining()`` (``{node id: deadline in ms since the epoch, 0:
none}``, e.g. :meth:`gymckpt.stack.ray.RayStack.draining_nodes`, which lists only the nodes
holding the stack's servers) every ``poll_seconds`` in a thread of its own, and calls
``notice(f"node drain {node}", grace_seconds=...)`` (e.g.
:meth:`gymckpt.control.preemption.PreemptionGuard.notice`) once for each drain of a node: with
the seconds left to the drain's deadline, or ``None`` (the guard's own grace) for a drain
without one. A node that stops draining (the drain was cancelled) is forgotten: a later
drain of it is a new notice. No Ray here: the callables carry it.

    with DrainWatcher(stack.draining_nodes, guard.notice):
        ...  # the trainer's loop, its checkpoints through guard.checkpoint()

A ``draining()`` that raises is logged (at ERROR, once per distinct message) and asked again
at the next poll; a ``notice`` that raises (the guard was left) ends the watching, logged.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MIN_GRACE_SECONDS", "DrainWatcher", "grace_of"]

logger = logging.getLogger(__name__)

#: the grace given for a drain whose deadline has already passed (a notice needs a positive one)
MIN_GRACE_SECONDS = 0.5


def grace_of(deadline_ms: int, now: float | None = None) -> float | None:
    """Seconds left to a drain's deadline (ms since the epoch), at least :data:`MIN_GRACE_SECONDS`; None: no deadline."""
    if deadline_ms <= 0:
        return None
    left = deadline_ms / 1000 - (time.time() if now is None else now)
    return max(left, MIN_GRACE_SECONDS)


class DrainWatcher:
    """Polls ``draining()`` and calls ``notice`` once per drain of a node (see the module). A context manager."""

    def __init__(
        self,
        draining: Callable[[], dict[str, int]],
        notice: Callable[..., None],
        *,
        poll_seconds: float = 1.0,
    ) -> None:
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be > 0, not {poll_seconds!r}")
        self._draining = draining
        self._notice = notice
        self.poll_seconds = poll_seconds
        #: node id → the grace each drain's notice gave (None: the guard's), in order
        self.noticed: dict[str, float | None] = {}
        #: polls made so far (a test waits for some to pass)
        self.polls = 0
        #: the last error of ``draining()`` or ``notice``, one line (None: none)
        self.error: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DrainWatcher:
        """Start polling in a daemon thread (once)."""
        if self._thread is not None:
            raise RuntimeError("a DrainWatcher is started once")
        self._thread = threading.Thread(target=self._watch, name="gymckpt-drain-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop polling; wait (bounded) for the thread to end."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> DrainWatcher:
        """Start polling, unless started already (:meth:`~gymckpt.stack.ray.RayStack.watch_drains` starts it)."""
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def poll(self) -> list[str]:
        """One poll: notice each node newly draining; the nodes noticed now. Raises what ``draining`` raises."""
        draining = self._draining()
        for node in [node for node in self.noticed if node not in draining]:
            del self.noticed[node]  # the drain ended (cancelled): a later one is a new notice
        fresh = [node for node in draining if node not in self.noticed]
        for node in fresh:
            grace = grace_of(int(draining[node]))
            self.noticed[node] = grace
            try:
                self._notice(f"node drain {node}", grace_seconds=grace)
            except Exception as exc:
                raise _NoticeFailed(exc) from exc
        return fresh

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                self.poll()
            except _NoticeFailed as failed:  # the guard was left: nobody to tell any more
                self._failed(f"telling the guard: {failed.line}")
                return
            except Exception as exc:  # the cluster did not answer this time: asked again at the next poll
                self._failed(f"asking for draining nodes: {_line(exc)}")
            self.polls += 1
            self._stopping.wait(self.poll_seconds)

    def _failed(self, line: str) -> None:
        if self.error != line:
            logger.error("watching node drains: %s", line)
        self.error = line


def _line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


class _NoticeFailed(Exception):
    def __init__(self, exc: BaseException) -> None:
        super().__init__(_line(exc))
        self.line = _line(exc)
