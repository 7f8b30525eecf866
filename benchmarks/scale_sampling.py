"""What bench_scale watches on the servers: process trees sampled, py-spy attribution, the servers' own lines.

- :class:`ServerSampler` reads each server's process tree (its uvicorn supervisor, the
  coordinator and the workers) every ``interval``: peak resident memory, peak open
  descriptors, CPU seconds. With py-spy installed (the dev extras), each Gym server is
  profiled from the moment the interrupted stack answers until the crash, and its samples
  are sorted by where they were taken (:func:`place_of`: the store, the rest of gymckpt,
  pydantic, starlette and FastAPI, uvicorn, aiohttp, asyncio's loop, other). It also
  brackets the demo's commit and restore with a :class:`~benchmarks.scale_memory.MemoryWindow`
  each (peak RSS before and during, per server).
- :class:`CoordinatorSpans`: the coordinator's own spans (each prepare stage's seconds).
- :func:`participant_lines`: each participant's commit and restore, with its steps, as its
  server logged them.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from benchmarks.scale_memory import MemoryWindow, PhaseMemory

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from gymckpt.stack.harness import RolloutHarness

__all__ = [
    "REFERENCE_PREFIX",
    "CoordinatorSpans",
    "ServerFigures",
    "ServerSampler",
    "participant_lines",
    "place_of",
    "places_of",
    "py_spy",
]

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


def py_spy() -> str | None:
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

    def __init__(self, interval: float, *, profile: bool, workdir: Path, keep_logs: bool = False) -> None:
        self.interval = interval
        self.keep_logs = keep_logs
        #: name → URL of the restored stack's servers (the same ports as before the crash)
        self.server_urls: dict[str, str] = {}
        self.profile = profile and py_spy() is not None
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
        #: each Gym server's memory around the commit and around the restore: ``{"commit": {name: …}}``
        self.memory: dict[str, dict[str, PhaseMemory]] = {}
        self._window: MemoryWindow | None = None

    # --- the demo's events

    def __call__(self, event: str, stack: RolloutHarness) -> None:
        if event.startswith("started:"):
            self._label = event.partition(":")[2]
        if event == "started:uninterrupted":  # its CPU only tells how busy the machine was with other work
            self._watch({f"{REFERENCE_PREFIX}{name}": pid for name, pid in stack.pids.items()})
        if event in ("started:demo", "restored"):
            self._watch(stack.pids)
        if event == "started:demo":
            self._bracket(stack)
            if self.profile:
                self._start_profiles({name: stack.pids[name] for name in stack.gym_servers if name in stack.pids})
        if event == "continued":
            logs = [server.log_path for server in stack.stack.servers.values()]
            self.participant_lines = participant_lines(logs)
            self.server_urls = dict(stack.urls)
            if self.keep_logs:
                kept = self.workdir / "logs"
                kept.mkdir(exist_ok=True)
                for log in logs:
                    with contextlib.suppress(OSError):
                        shutil.copy(log, kept / log.name)
        if event == "crash":
            self._sample_once()  # the last CPU reading of the processes about to die
            self._stop_profiles()
            with self._lock:
                self._pids = {}

    def start(self) -> None:
        self._thread.start()

    # --- memory around the commit and the restore

    def _bracket(self, stack: RolloutHarness) -> None:
        """Wrap this harness's commit (the coordinator's, inside ``checkpoint``) and ``restore`` in memory windows.

        The demo's events do not bracket either operation (``checkpoint`` comes before
        prepare, ``restored`` before the restore call), so the harness instance's own
        methods are wrapped; the class and every other harness are left alone.
        """
        checkpoint, restore = stack.checkpoint, stack.restore

        async def checkpoint_bracketed(gym: Any, *args: Any, **kwargs: Any) -> Any:
            commit = gym.commit
            gym.commit = self._windowed("commit", stack, commit)
            try:
                return await checkpoint(gym, *args, **kwargs)
            finally:
                del gym.commit  # the class's method again

        stack.checkpoint = checkpoint_bracketed  # type: ignore[method-assign]
        stack.restore = self._windowed("restore", stack, restore)  # type: ignore[method-assign]

    def _windowed(self, phase: str, stack: RolloutHarness, call: Callable[..., Awaitable[Any]]) -> Any:
        async def bracketed(*args: Any, **kwargs: Any) -> Any:
            window = MemoryWindow()
            window.begin({name: pid for name, pid in stack.pids.items() if name in stack.gym_servers})
            self._window = window
            try:
                return await call(*args, **kwargs)
            finally:
                self._window = None
                self.memory[phase] = window.end()

        return bracketed

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
        window = self._window
        if window is not None:
            window.sample()  # only where the kernel's high-water mark could not be reset
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
            command = [str(py_spy()), "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", "25"]
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
        """Seconds of each ``coordinate.prepare.<kind>`` stage of the last prepare."""
        if self.exporter is None:
            return {}
        stages = {}
        prefix = "gym.checkpoint.coordinate.prepare."
        for span in self.exporter.get_finished_spans():
            if span.name.startswith(prefix) and not span.name.endswith(".call") and span.end_time and span.start_time:
                stages[span.name[len(prefix) :]] = (span.end_time - span.start_time) / 1e9
        return stages

    def call_seconds(self, operation: str) -> dict[str, float]:
        """Seconds of the coordinator's last ``coordinate.<operation>.call`` to each server, by URL: the
        controller's side of the call (sending, the server's queue and work, the reply)."""
        if self.exporter is None:
            return {}
        calls = {}
        name = f"gym.checkpoint.coordinate.{operation}.call"
        for span in self.exporter.get_finished_spans():
            url = (span.attributes or {}).get("nemo.gym.checkpoint.server")
            if span.name == name and span.end_time and span.start_time and isinstance(url, str):
                calls[url] = (span.end_time - span.start_time) / 1e9
        return calls

    def clear(self) -> None:
        """Forget the spans kept so far (the next run's start from none)."""
        if self.exporter is not None:
            self.exporter.clear()


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
