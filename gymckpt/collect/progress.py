"""What a collection shows while it runs: a progress bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["CollectProgress"]

#: how often a plain (non-terminal) progress line is written, in seconds
PLAIN_EVERY_SECONDS = 10.0


class CollectProgress:
    """Rows done of the total, in flight, failed, rate and ETA; events (checkpoints, restores) as lines."""

    def __init__(self, console: Console, total: int, *, done: int = 0) -> None:
        self.console = console
        self.total = total
        self.done = done
        self.in_flight = 0
        self.failed = 0
        self._started = time.monotonic()
        self._counted_from = done
        self._last_plain = 0.0
        self._bar: Progress | None = None
        self._task = None
        if console.is_terminal:
            self._bar = Progress(
                TextColumn("collect"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[in_flight]} in flight · {task.fields[failed]} failed · {task.fields[rate]}"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
            self._task = self._bar.add_task("collect", total=total, completed=done, in_flight=0, failed=0, rate="–")

    def __enter__(self) -> CollectProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    @property
    def rate(self) -> float:
        """Rows per second since the start of this run."""
        elapsed = time.monotonic() - self._started
        return (self.done - self._counted_from) / elapsed if elapsed > 0 else 0.0

    def update(self, *, in_flight: int | None = None) -> None:
        if in_flight is not None:
            self.in_flight = in_flight
        if self._bar is not None and self._task is not None:
            self._bar.update(
                self._task,
                completed=self.done,
                in_flight=self.in_flight,
                failed=self.failed,
                rate=f"{self.rate:.1f} rows/s",
            )
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_EVERY_SECONDS or self.done == self.total:
            self._last_plain = now
            self.console.print(self.line(), markup=False, highlight=False)

    def line(self) -> str:
        """``collect: 120/200 done, 16 in flight, 0 failed, 35.2 rows/s, ETA 2 s``."""
        rate = self.rate
        left = self.total - self.done
        eta = f", ETA {left / rate:.0f} s" if rate > 0 and left else ""
        return (
            f"collect: {self.done}/{self.total} done, {self.in_flight} in flight, {self.failed} failed, "
            f"{rate:.1f} rows/s{eta}"
        )

    def row_ended(self, *, failed: bool, in_flight: int) -> None:
        self.done += 1
        self.failed += failed
        self.update(in_flight=in_flight)

    def event(self, message: str) -> None:
        """One line about a checkpoint, a restore, a fence (printed above the bar)."""
        self.console.print(escape(message), highlight=False)
