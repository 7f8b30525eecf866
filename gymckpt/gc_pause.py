"""Python's cyclic garbage collector around checkpoints: paused while one runs, and less often in servers.

A server holding thousands of requests in flight keeps 0.3 to 0.8 million objects the
collector tracks (each request's coroutines, closures and connection state). A full
collection traverses all of them: 0.4 to 1.2 s on a busy two-core machine, measured at
6,333 rollouts inside the agent, and up to 20% of the model server's time. A control call
that arrives during one waits that long, once per server of the prepare's chain.

- :func:`paused_gc` pauses the collector for a block (the store's decode, a coordinator's
  fan-out); :func:`pause_gc` pauses it until the returned pause is released, or at the
  latest after a bound kept by a timer thread (a control plane's open checkpoint, from
  prepare to resume; a worker's closed admission). Pauses nest and count across threads.
- :func:`tune_collector` raises the collection thresholds of a server process
  (``GYMCKPT_GC_THRESHOLDS``: three integers, or ``python`` for Python's own): the young
  generations are still collected often, a full collection only every few million
  allocations, as the heap's growth also allows (Python's 25% rule). It also has every
  collection that takes :data:`LONG_COLLECTION_SECONDS` or more logged (INFO, logger
  ``gymckpt.gc_pause``): a control call that waited behind one shows up next to it in the
  server's log.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "GC_THRESHOLDS_ENV",
    "LONG_COLLECTION_SECONDS",
    "GCPause",
    "SERVER_GC_THRESHOLDS",
    "log_long_collections",
    "pause_gc",
    "paused_gc",
    "tune_collector",
]

logger = logging.getLogger(__name__)

#: a collection that takes this long, in seconds, is logged
LONG_COLLECTION_SECONDS = 0.1

#: the variable that sets a server's collection thresholds: ``"t0,t1,t2"``, or ``python`` for Python's defaults
GC_THRESHOLDS_ENV = "GYMCKPT_GC_THRESHOLDS"
#: a server's thresholds: a young collection every 10,000 net allocations, a middle one every 20 of those,
#: a full one at most every 20 middle ones (4 million net allocations), instead of Python's 700, 10, 10
SERVER_GC_THRESHOLDS = (10_000, 20, 20)
#: objects the GC tracks, made during a pause, from which they are moved to the oldest generation at its end
_PROMOTE_AFTER = 10_000


class _GCPause:
    """Counts the open pauses of the cyclic GC across threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pauses = 0
        self.was_enabled = False

    def enter(self) -> None:
        with self.lock:
            if self.pauses == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.pauses += 1

    def exit(self) -> None:
        with self.lock:
            self.pauses -= 1
            if self.pauses == 0 and self.was_enabled:
                _promote_young_objects()
                gc.enable()


def _promote_young_objects() -> None:
    """After a pause that made many objects, move every tracked object to the oldest generation, uncollected.

    Restored records are many and long-lived. The collection that runs as soon as the GC
    is enabled again would traverse all of them only to find them alive, and the next
    generation's collection again (0.2-0.4 s for 16,000 records of a few KB). ``gc.freeze``
    then ``gc.unfreeze`` moves them to the oldest generation at once. Not done when the
    application holds frozen objects (unfreezing would release them). Cyclic garbage made
    meanwhile is left for the next full collection.
    """
    if gc.get_count()[0] >= _PROMOTE_AFTER and gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


_GC_PAUSE = _GCPause()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic GC for the block; nested and concurrent pauses count.

    Decoded records hold no reference cycles, and collecting a heap of fresh containers
    over and over as it grows is what makes naive restores slow (about 1.5x the decode).
    When the last pause ends after many objects were made, they are moved to the oldest
    generation without a collection (:func:`_promote_young_objects`).
    """
    _GC_PAUSE.enter()
    try:
        yield
    finally:
        _GC_PAUSE.exit()


class GCPause:
    """One pause of Python's cyclic GC, ended by :meth:`release` or, at the latest, after its bound.

    The bound runs on a timer thread of its own, so a pause whose release never comes (a
    checkpoint nobody resumes, an event loop that stopped) still ends: :attr:`expired` is set
    and one INFO line names what was paused.
    """

    def __init__(self, max_seconds: float | None = None, what: str = "") -> None:
        self.what = what
        self.max_seconds = max_seconds
        #: set when the bound ended the pause (not a release)
        self.expired = threading.Event()
        self._lock = threading.Lock()
        self._open = True
        _GC_PAUSE.enter()
        self._timer: threading.Timer | None = None
        if max_seconds is not None:
            self._timer = threading.Timer(max_seconds, self._expire)
            self._timer.daemon = True
            self._timer.name = "gymckpt-gc-pause-bound"
            self._timer.start()

    def _end(self) -> bool:
        with self._lock:
            if not self._open:
                return False
            self._open = False
        _GC_PAUSE.exit()
        return True

    def _expire(self) -> None:
        if self._end():
            self.expired.set()
            logger.info(
                "the cyclic GC runs again after %g s although %s is still open",
                self.max_seconds,
                self.what or "its pause",
            )

    def release(self) -> None:
        """End the pause (again: nothing)."""
        if self._timer is not None:
            self._timer.cancel()
        self._end()

    __call__ = release


def pause_gc(max_seconds: float | None = None, what: str = "") -> GCPause:
    """Pause Python's cyclic GC until the returned pause is released (called), or ``max_seconds`` passed.

    ``what`` names the pause in the line logged when the bound ends it.
    """
    return GCPause(max_seconds, what)


def collector_thresholds(text: str | None) -> tuple[int, int, int] | None:
    """The thresholds ``GYMCKPT_GC_THRESHOLDS`` names (None: Python's own, ``python``); a bad value is a ValueError."""
    if text is None or not text.strip():
        return SERVER_GC_THRESHOLDS
    if text.strip().lower() == "python":
        return None
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(
            f"{GC_THRESHOLDS_ENV}={text!r}: three positive integers 't0,t1,t2' (e.g. "
            f"{','.join(map(str, SERVER_GC_THRESHOLDS))}) or 'python' for Python's own thresholds"
        )
    return int(parts[0]), int(parts[1]), int(parts[2])


def tune_collector() -> tuple[int, int, int]:
    """Set this server process's collection thresholds (:data:`GC_THRESHOLDS_ENV`); the thresholds in force."""
    thresholds = collector_thresholds(os.environ.get(GC_THRESHOLDS_ENV))
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    log_long_collections()
    return gc.get_threshold()  # type: ignore[return-value]


def log_long_collections(threshold: float = LONG_COLLECTION_SECONDS) -> None:
    """Log each collection of this process that takes ``threshold`` seconds or more (installed once)."""
    if any(getattr(callback, "_gymckpt_long_collections", False) for callback in gc.callbacks):
        return
    began: list[float] = []

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            took = time.perf_counter() - began.pop()
            if took >= threshold:
                logger.info(
                    "the cyclic GC's generation %d collection took %.3f s (%d objects collected)",
                    info.get("generation", -1),
                    took,
                    info.get("collected", 0),
                )

    timed._gymckpt_long_collections = True  # type: ignore[attr-defined]
    gc.callbacks.append(timed)
