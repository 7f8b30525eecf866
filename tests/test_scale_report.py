"""bench_scale's tables (benchmarks/scale_report.py): what each memory and side-by-side cell says."""

from __future__ import annotations

import hashlib
import os

from rich.console import Console

from benchmarks.scale_demo import ScaleRun
from benchmarks.scale_memory import MemoryWindow, PhaseMemory
from benchmarks.scale_report import render_demo_runs, render_sessions
from benchmarks.scale_sessions import SessionsRun

MIB = 1024 * 1024


def _text(render: object, *args: object) -> str:
    console = Console(record=True, width=250, color_system=None)
    render(*args, console)  # type: ignore[operator]
    return console.export_text()


def test_a_restore_peak_is_set_against_what_the_server_held_live_before_the_crash() -> None:
    run = ScaleRun("a", 1, 16_000, ok=True)
    run.memory = {
        "commit": {
            "agent": PhaseMemory(rss_before=600 * MIB, peak=630 * MIB, records_bytes=20 * MIB),
            "model": PhaseMemory(rss_before=800 * MIB, peak=830 * MIB, records_bytes=30 * MIB),
        },
        "restore": {
            "agent": PhaseMemory(rss_before=60 * MIB, peak=150 * MIB, records_bytes=20 * MIB, rss_after=140 * MIB),
            "model": PhaseMemory(rss_before=60 * MIB, peak=200 * MIB, records_bytes=30 * MIB),
        },
    }
    text = _text(render_demo_runs, [run])
    assert "agent 150 of 600 MiB (25%)" in text
    assert "model 200 of 800 MiB (25%)" in text
    # the bound itself still judges the restore: +90 MiB against +30 allowed
    assert "agent 60 → 150 (+90.0 ≤ +30.0 ✗), 140 after" in text  # what it kept: the state it restored
    model = next(line for line in text.splitlines() if "model 60 → 200" in line)
    assert "after" not in model  # not read: not said


def test_a_restore_without_a_commit_window_says_nothing_of_it() -> None:
    run = ScaleRun("a", 1, 100, ok=True)
    run.memory = {"restore": {"agent": PhaseMemory(rss_before=60 * MIB, peak=70 * MIB)}}
    line = next(line for line in _text(render_demo_runs, [run]).splitlines() if "before the crash" in line)
    assert line.rstrip(" │").endswith("–")


def test_seconds_are_judged_against_each_runs_own_target() -> None:
    one = ScaleRun("a", 1, 16_000, ok=True, commit_seconds=1.1, restore_seconds=0.9)
    two = ScaleRun("a", 2, 16_000, ok=True, commit_seconds=1.1, restore_seconds=1.35)
    s3 = ScaleRun("c", 1, 16_000, store="s3", ok=True, commit_seconds=2.5, restore_seconds=0.9)
    text = _text(render_demo_runs, [one, two, s3])
    commit = next(line for line in text.splitlines() if line.startswith("│ commit s"))
    restore = next(line for line in text.splitlines() if line.startswith("│ restore s"))
    assert "≤ 1.3 with several workers" in commit
    # 1.1 s misses one worker's 1.0 but meets two workers' 1.3; S3's commit is judged by its ratio alone
    assert [cell.strip() for cell in commit.split("│")[2:5]] == ["1.100 ✗", "1.100 ✓", "2.500 (the ratio below)"]
    assert [cell.strip() for cell in restore.split("│")[2:5]] == ["0.900 ✓", "1.350 ✗", "0.900 ✓"]


def test_sessions_runs_stand_side_by_side_each_in_its_column() -> None:
    local = SessionsRun(sessions=1_000, session_bytes=350_000, workers=1, ok=True, commit_seconds=0.7)
    ray = SessionsRun(sessions=1_000, session_bytes=350_000, workers=1, error="the Ray cluster did not start")
    local.restart_seconds, ray.restart_seconds = 1.05, 3.86
    local.write_fsync_seconds = 0.25
    text = _text(render_sessions, {"one machine": local, "three Ray nodes": ray})
    header = next(line for line in text.splitlines() if "one machine" in line)
    assert header.index("one machine") < header.index("three Ray nodes")
    row = next(line for line in text.splitlines() if line.startswith("│ commit s (≤ 1.5)"))
    assert "0.700 ✓" in row and row.rstrip(" │").endswith("–")  # the failed run never committed
    assert "failed: the Ray cluster did not start" in text
    row = next(line for line in text.splitlines() if "fresh server answers" in line)
    assert "1.05" in row and "3.86" in row
    row = next(line for line in text.splitlines() if "written + fsynced alone" in line)
    assert "0.250" in row and row.rstrip(" │").endswith("–")  # the failed run wrote nothing to compare


def test_a_window_counts_the_cpu_seconds_its_processes_spent_inside_it() -> None:
    window = MemoryWindow()
    window.begin({"this": os.getpid()})
    digest = hashlib.sha256()
    for _ in range(20_000):  # some CPU work inside the window, whatever its duration
        digest.update(b"x" * 4096)
    figures = window.end()["this"]
    assert os.getpid() in figures.cpu_by_process
    assert figures.cpu_by_process[os.getpid()] > 0
    assert figures.cpu_seconds == sum(figures.cpu_by_process.values())
