"""The reference stack at scale: N rollouts in flight, a checkpoint, SIGKILL, restore, continuation.

::

    python -m benchmarks.bench_scale                          # 16,000 rollouts, 1 then 2 workers per server
    python -m benchmarks.bench_scale --rollouts 2000 --workers 1 --no-profile   # a smoke run
    python -m benchmarks.bench_scale --json out.json

Each run is ``gymckpt demo``'s scenario (:func:`gymckpt.demo.run_demo`) at ``--rollouts``:
an uninterrupted run of every task, then a fresh stack with every rollout started, a
checkpoint once ``--checkpoint-after`` of them have finished (so most are in flight, the
inference backend's ``--token-delay`` keeping them there), SIGKILL of every Gym server,
fresh processes with the same worker count, restore, resume, and each exported rollout
continued (the others start over). Every result is compared with the uninterrupted run's.

While it runs, a sampler reads each server's process tree (its uvicorn supervisor, the
coordinator and the workers) every ``--sample-seconds``: peak resident memory, peak open
descriptors, CPU seconds. With py-spy installed (the dev extras), each Gym server is
profiled from the moment the interrupted stack answers until the crash, and its samples
are sorted by where they were taken (the store, the rest of gymckpt, pydantic, starlette
and FastAPI, uvicorn, aiohttp, asyncio's loop, other).

The targets (issue 15): prepare ≤ 2.0 s, commit ≤ 1.0 s, restore ≤ 1.0 s, no rollout lost
and none differing. A run that lost or changed a rollout exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.machine import cpu_snapshot, filesystem, positive, warn_if_disturbed
from gymckpt import __version__ as gymckpt_version
from gymckpt.demo import run_demo
from gymckpt.demo.report import EXIT_TERMINATED

if TYPE_CHECKING:
    from gymckpt.demo.report import DemoOutcome
    from gymckpt.stack.harness import RolloutHarness

__all__ = ["TARGETS", "ScaleRun", "main"]

#: issue 15's targets, in seconds
TARGETS = {"prepare": 2.0, "commit": 1.0, "restore": 1.0}
MIB = 1024 * 1024
#: the uninterrupted run's servers, sampled under these names and left out of the table
REFERENCE_PREFIX = "uninterrupted:"

#: where a profile sample was taken, by the first of these found in its innermost frame's file, then outward
_PLACES = (
    ("store", ("gymckpt/store/",)),
    ("gymckpt", ("gymckpt/",)),
    ("pydantic", ("pydantic",)),
    ("starlette/fastapi", ("starlette/", "fastapi/")),
    ("uvicorn", ("uvicorn/", "httptools", "h11/")),
    ("aiohttp", ("aiohttp/", "yarl/", "multidict/")),
    ("asyncio", ("asyncio/", "selectors.py", "socket.py", "ssl.py")),
    ("json", ("json/", "orjson")),
)


@dataclass
class ServerFigures:
    """One server's peaks and CPU, over both of its stacks (before the crash and after the restart)."""

    peak_rss_mib: float = 0.0
    peak_fds: int = 0
    processes: int = 0
    cpu_seconds: float = 0.0
    #: where its profiled samples were taken: place → share of the samples
    cpu_places: dict[str, float] = field(default_factory=dict)
    samples: int = 0


@dataclass
class ScaleRun:
    """One run at one worker count."""

    workers: int
    rollouts: int
    ok: bool = False
    error: str = ""
    #: stopped by SIGTERM (the demo stopped every server it started)
    terminated: bool = False
    in_flight_at_checkpoint: int = 0
    exported: int = 0
    continued: int = 0
    restarted: int = 0
    finished_before: int = 0
    lost: int = 0
    differing: int = 0
    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    restore_seconds: float = 0.0
    uninterrupted_seconds: float = 0.0
    total_seconds: float = 0.0
    records: int = 0
    bytes_written: int = 0
    #: the coordinator's spans: each prepare stage's seconds (environment, model, agent, resources)
    prepare_stages: dict[str, float] = field(default_factory=dict)
    #: each participant's own commit and restore, from its INFO line: ``{"commit": {"agent": "0.57 s (…)"}}``
    participant_lines: dict[str, dict[str, str]] = field(default_factory=dict)
    servers: dict[str, ServerFigures] = field(default_factory=dict)


def _py_spy() -> str | None:
    """py-spy beside this interpreter (a virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def place_of(stack_line: str) -> str:
    """The place one collapsed py-spy stack (``frame;frame;…;leaf``) was sampled in."""
    files = [frame.rpartition("(")[2] for frame in stack_line.split(";")]
    for path in reversed(files):
        for place, needles in _PLACES:
            if any(needle in path for needle in needles):
                return place
    return "other"


def places_of(raw: str) -> tuple[dict[str, float], int]:
    """Shares of py-spy's raw (collapsed) output by place, and the number of samples."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[place_of(stack)] += int(count)
    total = sum(counts.values())
    return ({place: count / total for place, count in counts.most_common()} if total else {}), total


class ServerSampler:
    """Samples every server's process tree on a thread; profiles the Gym servers with py-spy between two events."""

    def __init__(self, interval: float, *, profile: bool, workdir: Path) -> None:
        self.interval = interval
        self.profile = profile and _py_spy() is not None
        self.workdir = workdir
        self.figures: dict[str, ServerFigures] = {}
        self._pids: dict[str, int] = {}
        self._cpu_base: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-sampler", daemon=True)
        self._profilers: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self._label = ""
        #: the participants' commit and restore lines, read from the servers' logs once the rollouts continued
        self.participant_lines: dict[str, dict[str, str]] = {}

    # --- the demo's events

    def __call__(self, event: str, stack: RolloutHarness) -> None:
        if event.startswith("started:"):
            self._label = event.partition(":")[2]
        if event == "started:uninterrupted":  # its CPU only tells how busy the machine was with other work
            self._watch({f"{REFERENCE_PREFIX}{name}": pid for name, pid in stack.pids.items()})
        if event in ("started:demo", "restored"):
            self._watch(stack.pids)
        if event == "started:demo" and self.profile:
            self._start_profiles({name: stack.pids[name] for name in stack.gym_servers if name in stack.pids})
        if event == "continued":
            self.participant_lines = participant_lines([server.log_path for server in stack.stack.servers.values()])
        if event == "crash":
            self._sample_once()  # the last CPU reading of the processes about to die
            self._stop_profiles()
            with self._lock:
                self._pids = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._sample_once()
        self._stop.set()
        self._thread.join(timeout=10)
        self._stop_profiles()

    # --- sampling

    def _watch(self, pids: dict[str, int]) -> None:
        with self._lock:
            self._pids = dict(pids)
            for name in pids:
                figures = self.figures.setdefault(name, ServerFigures())
                self._cpu_base[name] = figures.cpu_seconds  # the new processes' CPU adds to the old ones'

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample_once()

    def _sample_once(self) -> None:
        with self._lock:
            pids = dict(self._pids)
        for name, pid in pids.items():
            rss = fds = 0
            cpu = 0.0
            processes = 0
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for process in tree:
                try:
                    with process.oneshot():
                        rss += process.memory_info().rss
                        fds += process.num_fds()
                        times = process.cpu_times()
                        cpu += times.user + times.system + times.children_user + times.children_system
                    processes += 1
                except psutil.Error:
                    continue
            with self._lock:
                figures = self.figures.setdefault(name, ServerFigures())
                figures.peak_rss_mib = max(figures.peak_rss_mib, rss / MIB)
                figures.peak_fds = max(figures.peak_fds, fds)
                figures.processes = max(figures.processes, processes)
                figures.cpu_seconds = max(figures.cpu_seconds, self._cpu_base.get(name, 0.0) + cpu)

    # --- profiles

    def _start_profiles(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            out = self.workdir / f"{name}.pyspy.txt"
            command = [str(_py_spy()), "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", "25"]
            command += ["--format", "raw", "--output", str(out)]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._profilers[name] = (process, out)

    def _stop_profiles(self) -> None:
        for name, (process, out) in self._profilers.items():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            try:
                raw = out.read_text()
            except OSError:
                continue
            shares, total = places_of(raw)
            figures = self.figures.setdefault(name, ServerFigures())
            figures.cpu_places, figures.samples = shares, total
        self._profilers = {}


class CoordinatorSpans:
    """The coordinator's own spans, kept in memory (the OpenTelemetry SDK of the dev extras), if it is installed."""

    def __init__(self) -> None:
        self.exporter: Any = None
        try:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        except ImportError:
            return
        from gymckpt import telemetry

        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        telemetry.bind(tracer_provider=provider)

    def prepare_stages(self) -> dict[str, float]:
        """Seconds of each ``coordinate.prepare.<kind>`` stage of the last prepare; clears what was kept."""
        if self.exporter is None:
            return {}
        stages = {}
        prefix = "gym.checkpoint.coordinate.prepare."
        for span in self.exporter.get_finished_spans():
            if span.name.startswith(prefix) and not span.name.endswith(".call") and span.end_time and span.start_time:
                stages[span.name[len(prefix) :]] = (span.end_time - span.start_time) / 1e9
        self.exporter.clear()
        return stages


def run_once(args: argparse.Namespace, workers: int, root: Path, console: Console) -> ScaleRun:
    """One demo run at ``workers`` workers per Gym server (before and after the crash)."""
    spans = CoordinatorSpans()
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{workers}w-", dir=root))
    sampler = ServerSampler(args.sample_seconds, profile=args.profile, workdir=workdir)
    sampler.start()
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the demo's table: this benchmark prints its own
    try:
        outcome = run_demo(
            rollouts=args.rollouts,
            store_url=str(workdir / "checkpoints"),
            console=quiet,
            progress_console=console,
            timeout=args.timeout,
            logs_dir=workdir,
            workers=workers,
            restore_workers=workers,
            stack_options={"token_delay_seconds": args.token_delay, "tool_turns": args.tool_turns},
            checkpoint_after=args.checkpoint_after,
            observer=sampler,
        )
    finally:
        sampler.stop()
        quiet.file.close()
    run = _figures(outcome, workers)
    run.servers = sampler.figures
    run.prepare_stages = spans.prepare_stages()
    run.participant_lines = sampler.participant_lines
    if run.ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not run.ok:
        console.print(f"kept for a look: {workdir}", highlight=False)
    return run


def _figures(outcome: DemoOutcome, workers: int) -> ScaleRun:
    return ScaleRun(
        workers=workers,
        rollouts=outcome.rollouts,
        ok=outcome.exit_code == 0,
        error=outcome.error,
        terminated=outcome.exit_code == EXIT_TERMINATED,
        in_flight_at_checkpoint=outcome.rollouts - len(outcome.finished_before) if outcome.exported else 0,
        exported=len(outcome.exported),
        continued=len(outcome.continued),
        restarted=len(outcome.restarted),
        finished_before=len(outcome.finished_before),
        lost=len(outcome.lost),
        differing=len(outcome.differing),
        prepare_seconds=outcome.prepare_seconds,
        commit_seconds=outcome.commit_seconds,
        restore_seconds=outcome.restore_seconds,
        uninterrupted_seconds=outcome.uninterrupted_seconds,
        total_seconds=outcome.total_seconds,
        records=outcome.records_written,
        bytes_written=outcome.bytes_written,
    )


#: a participant's INFO line of one operation (gymckpt.telemetry): its seconds and what it reports in brackets
_OPERATION_LINE = re.compile(
    r"INFO gymckpt\.telemetry: (?P<op>commit|restore) \S+ (?P<kind>[\w-]+)/\S+: ok in "
    r"(?P<seconds>\d+\.\d+) s(?: \((?P<detail>[^)]*)\))?$"
)


def participant_lines(logs: list[Path]) -> dict[str, dict[str, str]]:
    """Each participant's commit and restore as its server logged them (seconds, steps), from ``logs``."""
    found: dict[str, dict[str, str]] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            match = _OPERATION_LINE.search(line)
            if match is None:
                continue
            steps = [word for word in (match["detail"] or "").split() if word.endswith("s") and "=" in word]
            found.setdefault(match["op"], {})[match["kind"]] = f"{float(match['seconds']):.2f}" + (
                f" ({' '.join(steps)})" if steps else ""
            )
    return found


def _mark(seconds: float, target: float) -> str:
    if not seconds:
        return "–"  # not reached
    return f"{seconds:.3f}" + (" [green]✓[/]" if seconds <= target else " [red]✗[/]")


def render(runs: list[ScaleRun], console: Console) -> None:
    table = Table(title=f"bench_scale: {runs[0].rollouts:,} rollouts, the reference stack on this machine")
    table.add_column("")
    for run in runs:
        table.add_column(f"{run.workers} worker{'s' if run.workers > 1 else ''} per server", justify="right")
    rows: list[tuple[str, Any]] = [
        ("result", lambda r: "[green]ok[/]" if r.ok else f"[red]failed[/]: {r.error[:60]}"),
        ("finished before the checkpoint", lambda r: f"{r.finished_before:,}"),
        ("exported (in flight, captured)", lambda r: f"{r.exported:,}"),
        ("continued after the restore", lambda r: f"{r.continued:,}"),
        ("started over", lambda r: f"{r.restarted:,}"),
        ("lost / differing", lambda r: f"{r.lost} / {r.differing}"),
        (f"prepare s (≤ {TARGETS['prepare']})", lambda r: _mark(r.prepare_seconds, TARGETS["prepare"])),
        ("prepare by stage s", lambda r: ", ".join(f"{k} {v:.2f}" for k, v in r.prepare_stages.items()) or "–"),
        (f"commit s (≤ {TARGETS['commit']})", lambda r: _mark(r.commit_seconds, TARGETS["commit"])),
        (f"restore s (≤ {TARGETS['restore']})", lambda r: _mark(r.restore_seconds, TARGETS["restore"])),
        ("commit by participant s", lambda r: _by_participant(r, "commit")),
        ("restore by participant s", lambda r: _by_participant(r, "restore")),
        ("records / bytes written", lambda r: f"{r.records:,} / {r.bytes_written:,}"),
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


def _by_participant(run: ScaleRun, operation: str) -> str:
    lines = run.participant_lines.get(operation, {})
    return "\n".join(f"{kind} {line}" for kind, line in sorted(lines.items())) or "–"


def _places(figures: ServerFigures, top: int = 4) -> str:
    if not figures.cpu_places:
        return "–"
    return ", ".join(f"{place} {share:.0%}" for place, share in list(figures.cpu_places.items())[:top])


def _raise_descriptor_limit() -> tuple[int, int]:
    """This process's soft descriptor limit raised to the hard one (the harness holds a socket per rollout)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard


def _others_share(start: tuple[float, float, float], end: tuple[float, float, float], runs: list[ScaleRun]) -> float:
    """The share of the CPUs busy with neither this process nor the servers it started (NaN: unknown)."""
    wall = end[0] - start[0]
    ours = (end[1] - start[1]) + sum(figures.cpu_seconds for run in runs for figures in run.servers.values())
    return max(0.0, ((end[2] - start[2]) - ours) / (wall * (os.cpu_count() or 1))) if wall > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=positive, default=16_000, help="rollouts started at once (16,000)")
    parser.add_argument(
        "--workers", default="1,2", help="uvicorn workers per Gym server, one run each, comma-separated (1,2)"
    )
    parser.add_argument(
        "--token-delay", type=float, default=0.5, help="the inference backend's seconds per token (0.5)"
    )
    parser.add_argument(
        "--tool-turns", type=int, default=3, help="tool calls per rollout: model calls are one more (3)"
    )
    parser.add_argument(
        "--checkpoint-after",
        type=float,
        default=0.25,
        help="share of rollouts finished when the checkpoint is taken (0.25: three quarters in flight)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="bound of each phase in seconds (1800)")
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="how often the servers are sampled")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="py-spy profiles")
    parser.add_argument("--dir", default=None, help="where the checkpoints and logs go (a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and logs of a run that passed")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    worker_counts = [int(part) for part in args.workers.split(",") if part.strip()]
    console = Console(stderr=True)
    out = Console(width=max(Console().width, 140))
    soft, hard = _raise_descriptor_limit()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.profile and _py_spy() is None:
        console.print("py-spy is not installed (pip install py-spy): CPU seconds only, no breakdown")
    console.print(
        f"gymckpt {gymckpt_version} · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"descriptors {soft:,} (hard {hard:,}) · store {root} ({filesystem(root)})",
        highlight=False,
    )
    before = cpu_snapshot()
    runs = []
    for workers in worker_counts:
        runs.append(run_once(args, workers, root, console))
        if runs[-1].terminated:  # SIGTERM: the demo stopped its servers; no further run
            break
    share = _others_share(before, cpu_snapshot(), runs)
    render(runs, out)
    warn_if_disturbed(out, share, os.cpu_count())
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(run) for run in runs], indent=2))
    if not args.dir:
        with contextlib.suppress(OSError):
            root.rmdir()  # empty unless a run kept its directory
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
