"""What the benchmarks say about the machine they ran on: its filesystem, and how busy others kept it."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import TYPE_CHECKING

from benchmarks import primitives

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

__all__ = ["cpu_snapshot", "filesystem", "others_share", "positive", "warn_if_disturbed", "write_fsync_seconds"]

#: above this share of the CPUs kept busy by other processes, a run's figures are called disturbed
DISTURBED_SHARE = 0.10


def filesystem(path: str | Path) -> str:
    """``fstype on device`` of the mount holding ``path`` (Linux), for the report."""
    real = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                device, mount_point, fstype = line.split()[:3]
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best[0]):
                    best = (mount_point, fstype, device)
    except OSError:
        return "?"
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


def write_fsync_seconds(directory: str | Path, size: int) -> float:
    """Seconds to write ``size`` bytes to a new file in ``directory`` and fsync it
    (:func:`benchmarks.primitives.write_fsync`), the file removed after.

    What this machine's page cache and disk take for the bytes a commit wrote, measured right
    after it: on a virtual machine, memory the guest never touched before is several times
    slower to fill than memory it reuses, so one figure alone does not say which it was.
    """
    block = os.urandom(min(primitives.WRITE_BUFFER, size))
    whole, rest = divmod(size, len(block)) if block else (0, 0)
    pieces = [block] * whole + ([block[:rest]] if rest else [])  # one block, named again and again
    path = os.path.join(os.fspath(directory), f".write-fsync-{os.getpid()}-{time.monotonic_ns()}")
    began = time.perf_counter()
    try:
        primitives.write_fsync(path, pieces)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return time.perf_counter() - began


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, this process's CPU s, the whole machine's busy CPU s), to tell how much others ran."""
    own = os.times()
    busy = float("nan")
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), own.user + own.system, busy


def others_share(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Fraction of all CPUs that other processes kept busy between two snapshots (NaN if unknown)."""
    wall = end[0] - start[0]
    others = (end[2] - start[2]) - (end[1] - start[1])
    return max(0.0, others / (wall * (os.cpu_count() or 1))) if wall > 0 else float("nan")


def warn_if_disturbed(console: Console, share: float, cpus: object, *, up_to: bool = False) -> None:
    """Say so when other processes kept more than :data:`DISTURBED_SHARE` of the CPUs busy (NaN: unknown)."""
    if share == share and share > DISTURBED_SHARE:  # not NaN
        console.print(
            f"[bold yellow]other processes kept {'up to ' if up_to else ''}{share:.0%} of the {cpus} CPUs busy — "
            "figures are disturbed; rerun on a quiet machine[/]"
        )


def positive(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative(text: str) -> int:
    """An ``argparse`` type: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value
