"""bench_scale's tables: the demo runs (scenarios a and c) side by side, the big sessions (b), the S3 ratio.

Targets are issue 27's (:data:`TARGETS`); a figure within its target gets a green mark, one
beyond it a red one. Each server's memory is shown as ``RSS before → peak (+growth ≤ +allowed)`` in
MiB, the allowed growth being 1.5 × the bytes of its records (small runs exceed it by fixed costs:
modules a first commit or restore imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from benchmarks.scale_sampling import REFERENCE_PREFIX, ServerFigures

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from benchmarks.scale_demo import ScaleRun
    from benchmarks.scale_memory import PhaseMemory
    from benchmarks.scale_sessions import SessionsRun

__all__ = ["TARGETS", "render_demo_runs", "render_s3_ratio", "render_sessions", "s3_commit_ratio"]

MIB = 1024 * 1024
#: issue 27's targets, in seconds (scenario a at one worker; two workers may take 1.3x), and ratios
TARGETS = {
    "prepare": 1.0,
    "commit": 1.0,
    "restore": 1.0,
    "two_workers_factor": 1.3,
    "sessions_commit": 1.5,
    "sessions_restore": 1.2,
    "s3_commit_ratio": 3.0,
}


def _mark(seconds: float, target: float) -> str:
    if not seconds:
        return "–"  # not reached
    return f"{seconds:.3f}" + (" [green]✓[/]" if seconds <= target else " [red]✗[/]")


def _several(name: str) -> str:
    """The target of several workers per server, in words (issue 27: 1.3x the one-worker target)."""
    return f"≤ {TARGETS[name] * TARGETS['two_workers_factor']:.1f} with several workers"


def _target(run: ScaleRun, name: str) -> float:
    return TARGETS[name] * (TARGETS["two_workers_factor"] if run.workers > 1 else 1.0)


def _commit_mark(run: ScaleRun) -> str:
    """A local commit against its target; scenario (c)'s S3 commit is judged by its ratio to the local one (below)."""
    if run.store == "local" or not run.commit_seconds:
        return _mark(run.commit_seconds, _target(run, "commit"))
    return f"{run.commit_seconds:.3f} (the ratio below)"


def _per_participant(values: dict[str, int]) -> str:
    return "\n".join(f"{name.partition('/')[0]} {value:,}" for name, value in sorted(values.items())) or "–"


def _lines(run: ScaleRun | SessionsRun, operation: str) -> str:
    lines = run.participant_lines.get(operation, {})
    calls = getattr(run, "call_seconds", {}).get(operation, {})
    return "\n".join(f"{kind} {_of_call(line, calls.get(kind))}" for kind, line in sorted(lines.items())) or "–"


def _of_call(line: str, call: float | None) -> str:
    """``0.47 (steps)`` as ``0.47 of 0.61 (steps)``: the server's own seconds of the controller's call."""
    if call is None:
        return line
    seconds, _, steps = line.partition(" ")
    return f"{seconds} of {call:.2f}" + (f" {steps}" if steps else "")


def _memory(windows: dict[str, PhaseMemory]) -> str:
    return "\n".join(f"{name} {memory.describe()}" for name, memory in sorted(windows.items())) or "–"


def _cpu(windows: dict[str, PhaseMemory]) -> str:
    """Each server's CPU seconds inside the window, in all and by process (the tree's order: its main process first)."""
    return (
        "\n".join(
            f"{name} {memory.cpu_seconds:.2f} ({' + '.join(f'{spent:.2f}' for spent in memory.cpu_by_process.values())})"
            for name, memory in sorted(windows.items())
        )
        or "–"
    )


def _restore_against_live(run: ScaleRun) -> str:
    """Each server's peak during the restore against its RSS just before the checkpoint (the state it held
    live, moments before the crash): the restored server's own memory, whatever the bound above says."""
    live, restored = run.memory.get("commit", {}), run.memory.get("restore", {})
    return (
        "\n".join(
            f"{name} {restored[name].peak / MIB:,.0f} of {live[name].rss_before / MIB:,.0f} MiB "
            f"({restored[name].peak / live[name].rss_before:.0%})"
            for name in sorted(set(live) & set(restored))
            if live[name].rss_before
        )
        or "–"
    )


def _places(figures: ServerFigures, top: int = 4) -> str:
    if not figures.cpu_places:
        return "–"
    return ", ".join(f"{place} {share:.0%}" for place, share in list(figures.cpu_places.items())[:top])


def render_demo_runs(runs: list[ScaleRun], console: Console) -> None:
    """Scenario (a) and (c) runs, one column each."""
    if not runs:
        return
    table = Table(title=f"bench_scale (a, c): {runs[0].rollouts:,} rollouts, the reference stack on this machine")
    table.add_column("")
    for run in runs:
        label = f"({run.scenario}) {run.store}, {run.workers} worker{'s' if run.workers > 1 else ''} per server"
        table.add_column(label, justify="right")
    rows: list[tuple[str, Any]] = [
        ("result", lambda r: "[green]ok[/]" if r.ok else f"[red]failed[/]: {r.error[:60]}"),
        ("finished before the checkpoint", lambda r: f"{r.finished_before:,}"),
        ("exported (in flight, captured)", lambda r: f"{r.exported:,}"),
        ("exported past their first turn", lambda r: f"{r.exported_past_first_turn:,}"),
        ("continued after the restore", lambda r: f"{r.continued:,}"),
        ("started over", lambda r: f"{r.restarted:,}"),
        ("started after the restore", lambda r: f"{r.started_after_restore:,}"),
        ("lost / differing", lambda r: f"{r.lost} / {r.differing}"),
        (
            f"prepare s (≤ {TARGETS['prepare']}; {_several('prepare')})",
            lambda r: _mark(r.prepare_seconds, _target(r, "prepare")),
        ),
        ("prepare by stage s", lambda r: ", ".join(f"{k} {v:.2f}" for k, v in r.prepare_stages.items()) or "–"),
        (
            f"commit s (≤ {TARGETS['commit']}; {_several('commit')})",
            _commit_mark,
        ),
        (
            f"restore s (≤ {TARGETS['restore']}; {_several('restore')})",
            lambda r: _mark(r.restore_seconds, _target(r, "restore")),
        ),
        ("commit by participant s (of the call; steps)", lambda r: _lines(r, "commit")),
        ("restore by participant s (of the call; steps)", lambda r: _lines(r, "restore")),
        ("records by participant", lambda r: _per_participant(r.records_by_participant)),
        ("bytes by participant", lambda r: _per_participant(r.bytes_by_participant)),
        ("records / bytes written", lambda r: f"{r.records:,} / {r.bytes_written:,}"),
        ("RSS MiB before → peak, commit", lambda r: _memory(r.memory.get("commit", {}))),
        ("RSS MiB before → peak, restore", lambda r: _memory(r.memory.get("restore", {}))),
        ("CPU s in the commit (by process)", lambda r: _cpu(r.memory.get("commit", {}))),
        ("CPU s in the restore (by process)", lambda r: _cpu(r.memory.get("restore", {}))),
        ("restore peak / the server's RSS before the crash", _restore_against_live),
        ("uninterrupted run s", lambda r: f"{r.uninterrupted_seconds:.1f}"),
        ("whole run s", lambda r: f"{r.total_seconds:.1f}"),
    ]
    for label, value in rows:
        table.add_row(label, *(value(run) for run in runs))
    names = sorted({name for run in runs for name in run.servers if not name.startswith(REFERENCE_PREFIX)})
    for name in names:
        table.add_section()

        def server(run: ScaleRun, name: str = name) -> ServerFigures:
            return run.servers.get(name, ServerFigures())

        table.add_row(
            f"{name}: peak RSS MiB / fds / processes",
            *(f"{server(r).peak_rss_mib:,.0f} / {server(r).peak_fds:,} / {server(r).processes}" for r in runs),
        )
        table.add_row(f"{name}: CPU s", *(f"{server(r).cpu_seconds:.1f}" for r in runs))
        if any(server(r).cpu_places for r in runs):
            table.add_row(f"{name}: CPU went to", *(_places(server(r)) for r in runs))
    console.print(table)


def render_sessions(columns: dict[str, SessionsRun], console: Console) -> None:
    """Scenario (b): one column per run (``name → run``), side by side."""
    runs = list(columns.values())
    first = runs[0]
    workers = sorted({run.workers for run in runs})
    table = Table(
        title=f"bench_scale (b): {first.sessions:,} sandbox sessions × {first.session_bytes:,} bytes, "
        f"{'/'.join(map(str, workers))} worker{'s' if workers != [1] else ''}, through the control plane"
    )
    table.add_column("")
    for name in columns:
        table.add_column(name, justify="right")
    rows: list[tuple[str, Callable[[SessionsRun], str]]] = [
        ("result", lambda run: "[green]ok[/]" if run.ok else f"[red]failed[/]: {run.error[:80]}"),
        ("lost / differing", lambda run: f"{run.lost} / {run.differing}"),
        ("sessions made s", lambda run: f"{run.create_seconds:.1f}"),
        ("prepare s", lambda run: f"{run.prepare_seconds:.3f}"),
        (
            f"commit s (≤ {TARGETS['sessions_commit']})",
            lambda run: _mark(run.commit_seconds, TARGETS["sessions_commit"]),
        ),
        (
            "the same bytes, written + fsynced alone s",
            lambda run: f"{run.write_fsync_seconds:.3f}" if run.write_fsync_seconds else "–",
        ),
        ("fresh server answers s (after the crash)", lambda run: f"{run.restart_seconds:.2f}"),
        (
            f"restore s (≤ {TARGETS['sessions_restore']})",
            lambda run: _mark(run.restore_seconds, TARGETS["sessions_restore"]),
        ),
        ("commit s (steps)", lambda run: _lines(run, "commit")),
        ("restore s (steps)", lambda run: _lines(run, "restore")),
        ("records / bytes", lambda run: f"{run.records:,} / {run.bytes_written:,}"),
        ("RSS MiB before → peak, commit", lambda run: _memory(run.memory.get("commit", {}))),
        ("RSS MiB before → peak, restore", lambda run: _memory(run.memory.get("restore", {}))),
    ]
    for label, value in rows:
        table.add_row(label, *(value(run) for run in runs))
    console.print(table)


def s3_commit_ratio(local: list[ScaleRun], s3: list[ScaleRun]) -> float | None:
    """Scenario (c)'s commit over (a)'s local commit at the same worker count, in this run (None: not both)."""
    for run in s3:
        for base in local:
            if base.workers == run.workers and base.commit_seconds and run.commit_seconds:
                return run.commit_seconds / base.commit_seconds
    return None


def render_s3_ratio(ratio: float | None, console: Console) -> None:
    if ratio is None:
        return
    mark = "[green]✓[/]" if ratio <= TARGETS["s3_commit_ratio"] else "[red]✗[/]"
    console.print(f"(c) S3 commit / (a) local commit: {ratio:.2f}× (≤ {TARGETS['s3_commit_ratio']}×) {mark}")
