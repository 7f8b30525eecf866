"""What the benchmarks say about the machine they ran on: its filesystem, and how busy others kept it."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["cpu_snapshot", "filesystem", "others_share"]


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
