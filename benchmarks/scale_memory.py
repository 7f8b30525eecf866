"""Resident memory and CPU time of a server's process tree around one operation (a commit, a restore).

A window resets the kernel's high-water mark (``VmHWM``, by writing ``5`` to
``/proc/<pid>/clear_refs``) of every process of each server's tree and notes its resident
set (``VmRSS``); when the operation ends it reads the marks back. A tree's peak is the sum
of its processes' marks: an upper bound when they peak at different moments (one worker
process per server gives the exact figure). Where the mark cannot be reset (not Linux, or
not allowed), the window says so and the peak is the largest RSS a sampler saw.

The same window notes each process's CPU seconds (user + system) spent inside it, so a
coordinator's share of a commit can be told from its workers'.

The bound issue 27 sets: peak ≤ RSS before + 1.5 × the server's records bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

__all__ = ["RSS_BOUND_FACTOR", "MemoryWindow", "PhaseMemory", "tree_pids"]

#: a server's peak during a commit or restore may exceed its RSS before by this many times its records' bytes
RSS_BOUND_FACTOR = 1.5
MIB = 1024 * 1024


@dataclass
class PhaseMemory:
    """One server's memory around one operation, in bytes."""

    rss_before: int = 0
    peak: int = 0
    #: the records this server wrote (commit) or read (restore), when known
    records_bytes: int = 0
    #: "VmHWM" when the kernel's high-water mark was reset for the window, else "sampled"
    method: str = "VmHWM"
    processes: int = 0
    #: each process's RSS before and peak (pid → [before, peak]), to tell a coordinator from its workers
    by_process: dict[int, list[int]] = field(default_factory=dict)
    #: the RSS when the operation ended (0: not read): what the server keeps, against the peak's passing copies
    rss_after: int = 0
    #: each process's CPU seconds inside the window (pid → seconds)
    cpu_by_process: dict[int, float] = field(default_factory=dict)

    @property
    def cpu_seconds(self) -> float:
        """The tree's CPU seconds inside the window."""
        return sum(self.cpu_by_process.values())

    @property
    def bound(self) -> int:
        """The largest peak within issue 27's bound (0: the records' bytes are unknown)."""
        return int(self.rss_before + RSS_BOUND_FACTOR * self.records_bytes) if self.records_bytes else 0

    @property
    def within_bound(self) -> bool | None:
        """Whether the peak stayed within :attr:`bound` (None: unknown)."""
        return None if not self.records_bytes else self.peak <= self.bound

    def describe(self) -> str:
        """``before → peak (+growth ≤ +allowed), after`` in MiB, for a table cell."""
        growth = (self.peak - self.rss_before) / MIB
        text = f"{self.rss_before / MIB:,.0f} → {self.peak / MIB:,.0f} (+{growth:,.1f}"
        if self.records_bytes:
            mark = "✓" if self.within_bound else "✗"
            text += f" ≤ +{RSS_BOUND_FACTOR * self.records_bytes / MIB:,.1f} {mark}"
        text += ")" if self.method == "VmHWM" else ") sampled"
        return text + (f", {self.rss_after / MIB:,.0f} after" if self.rss_after else "")


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every process below it (a server's supervisor, coordinator and workers)."""
    try:
        root = psutil.Process(pid)
        return [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def _status_kib(pid: int, name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _cpu_seconds(pid: int) -> float | None:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def _reset_mark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


@dataclass
class MemoryWindow:
    """Peak RSS of each named server's process tree between :meth:`begin` and :meth:`end`."""

    figures: dict[str, PhaseMemory] = field(default_factory=dict)
    _pids: dict[str, list[int]] = field(default_factory=dict)

    def begin(self, servers: dict[str, int]) -> None:
        """Note each server's RSS and reset its processes' high-water marks (``servers``: name → pid)."""
        self.figures, self._pids = {}, {}
        for name, pid in servers.items():
            pids = tree_pids(pid)
            memory = PhaseMemory(processes=len(pids))
            for each in pids:
                rss = (_status_kib(each, "VmRSS") or 0) * 1024
                memory.rss_before += rss
                memory.by_process[each] = [rss, rss]
                memory.cpu_by_process[each] = -(_cpu_seconds(each) or 0.0)
                if not _reset_mark(each):
                    memory.method = "sampled"
            memory.peak = memory.rss_before
            self.figures[name] = memory
            self._pids[name] = pids

    def sample(self) -> None:
        """Fold the current RSS in (for servers whose mark could not be reset)."""
        for name, pids in self._pids.items():
            memory = self.figures[name]
            if memory.method != "VmHWM":
                rss = sum((_status_kib(pid, "VmRSS") or 0) * 1024 for pid in pids)
                memory.peak = max(memory.peak, rss)

    def end(self) -> dict[str, PhaseMemory]:
        """Read each server's peak since :meth:`begin`; the figures by server name."""
        for name, pids in self._pids.items():
            memory = self.figures[name]
            memory.rss_after = sum((_status_kib(pid, "VmRSS") or 0) * 1024 for pid in pids)
            for pid in pids:
                spent = _cpu_seconds(pid)
                memory.cpu_by_process[pid] = 0.0 if spent is None else round(memory.cpu_by_process[pid] + spent, 3)
            if memory.method == "VmHWM":
                marks = [_status_kib(pid, "VmHWM") for pid in pids]
                for pid, mark in zip(pids, marks, strict=True):
                    if mark is not None:
                        memory.by_process[pid][1] = mark * 1024
                if None in marks:
                    memory.method = "sampled"  # a process ended: its mark is gone
                memory.peak = max(memory.peak, sum(mark or 0 for mark in marks) * 1024)
        self.sample()
        return self.figures
