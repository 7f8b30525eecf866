"""Commit and restore through the control plane with telemetry off and on, side by side in one run.

::

    python -m benchmarks.bench_telemetry                      # 2,000 episodes of ~2 KiB, 9 repetitions
    python -m benchmarks.bench_telemetry --quick              # 200 episodes, 2 repetitions (a smoke run)
    python -m benchmarks.bench_telemetry --modes off,batch --json out.json

What is timed is one participant's ``/commit`` and ``/restore`` as a server runs them, minus
HTTP: the route functions :func:`gymckpt.control.routes.control_router` builds (each a
``telemetry.operation(...)`` span, duration metric and INFO line around the
:class:`~gymckpt.control.plane.ControlPlane` call, its attributes set after) are awaited
directly, on a :class:`~gymckpt.testing.participant.FakeParticipant` holding ``--episodes``
episodes of about ``--record-bytes`` bytes each (seeded chat-history-like states from
:mod:`benchmarks.workloads`). The store is a fresh directory on local disk per repetition
(real write and fsync).

Modes, bound with :func:`gymckpt.telemetry.bind` one after another in this process:

- ``off``: ``bind()`` with nothing configured, the OpenTelemetry API's no-op providers (a
  server without ``OTEL_*`` settings);
- ``batch``: an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` over an in-memory span
  exporter, and a ``MeterProvider`` with an ``InMemoryMetricReader`` (what ``OTEL_*`` configures,
  minus the network);
- ``simple``: the same with a ``SimpleSpanProcessor`` (each span exported as it ends).

Per repetition, for each mode in turn (the order reverses from one repetition to the next;
one untimed warm-up round of every mode comes first):

1. bind the mode's providers and check that a span records exactly when the mode is on;
2. first life: a participant with every episode, a fresh plane; prepare (untimed), time
   ``commit`` of every episode, resume (untimed);
3. second life (a restarted server): an empty participant, a fresh plane; time ``restore`` of
   every episode, resume (untimed); every restored state must equal the committed one.

Before and after each timed call (untimed) the span processor is flushed; after it, the
operation's span must have been exported with its record count (mode on) and the spans are
dropped. At the end each on mode's duration histogram must count every commit and restore.
A wrong result stops the run with exit status 1. Logging stays at the default level in
every mode (no INFO lines). Figures are medians of the repetitions; a ratio is the median of
the per-repetition ratios mode's time / off's time (> 1: slower), and a delta the median of
the per-repetition differences.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from fastapi.routing import APIRoute
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console
from rich.table import Table
from rich.text import Text

from benchmarks.machine import cpu_snapshot, filesystem, others_share, positive, warn_if_disturbed
from benchmarks.report import MB
from benchmarks.workloads import build_record
from gymckpt import __version__ as gymckpt_version
from gymckpt import telemetry
from gymckpt.control.models import CommitRequest, ControlRequest, RestoreRequest
from gymckpt.control.plane import ControlPlane
from gymckpt.control.routes import control_router
from gymckpt.testing.participant import FakeParticipant

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["MODES", "BenchFailure", "Measurement", "main"]

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp"
KIND = "environment"
INSTANCE = "env-0"
TOKEN = "bench-telemetry"
#: the deadline of each control call, from when it is built
DEADLINE_S = 600.0
#: the span processor each on mode uses; off has none
MODES: dict[str, type[SpanProcessor] | None] = {
    "off": None,
    "batch": BatchSpanProcessor,
    "simple": SimpleSpanProcessor,
}
_LABELS = {
    "off": "off (no-op API)",
    "batch": "on, batch spans",
    "simple": "on, simple spans",
}


class BenchFailure(RuntimeError):
    """A step answered wrong (records missing, a state changed, no span where one was due): the run is void."""


@dataclass
class Measurement:
    """One repetition of one mode: the timed calls and what they produced."""

    mode: str
    rep: int
    commit_s: float
    restore_s: float
    #: this process's CPU s over the call, every thread (the span processor's, the store's) included
    commit_cpu_s: float
    restore_cpu_s: float
    records_bytes: int
    record_count: int
    restored: int
    #: spans exported for the call (the operation's and its children); 0 when off
    commit_spans: int
    restore_spans: int


@dataclass
class Mode:
    """One telemetry setting: the providers ``telemetry.bind`` gets, and where they record to."""

    name: str
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    spans: InMemorySpanExporter | None = None
    reader: InMemoryMetricReader | None = None
    exported: list[str] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return self.tracer_provider is not None

    def bind(self) -> None:
        """Make this mode the one the routes and the plane record through; check that it took."""
        telemetry.bind(self.tracer_provider, self.meter_provider)
        with telemetry.step("bench_probe") as probe:  # a span only: no metric, no log line
            recording = probe.span.is_recording()
        if recording != self.on:
            raise BenchFailure(
                f"mode {self.name}: a span {'does not record' if self.on else 'records'} after binding "
                "(is an SDK configured globally, e.g. by OTEL_* variables?)"
            )
        self.drain()

    def drain(self) -> list[Any]:
        """Flush the span processor and take every span exported so far (none when off)."""
        if self.tracer_provider is None or self.spans is None:
            return []
        if not self.tracer_provider.force_flush(timeout_millis=30_000):
            raise BenchFailure(f"mode {self.name}: the span processor did not flush within 30 s")
        finished = list(self.spans.get_finished_spans())
        self.spans.clear()
        return finished

    def spans_of(self, operation: str, records: int) -> int:
        """How many spans the call exported; with the mode on, its operation span must carry ``records``."""
        finished = self.drain()
        if not self.on:
            return 0
        name = f"gym.checkpoint.{operation}"
        tops = [span for span in finished if span.name == name]
        if len(tops) != 1 or (tops[0].attributes or {}).get(telemetry.RECORDS) != records:
            seen = sorted({span.name for span in finished})
            raise BenchFailure(
                f"mode {self.name}: expected one {name} span with {records} records, exported {seen} "
                f"({[dict(span.attributes or {}) for span in tops]})"
            )
        return len(finished)

    def histogram_counts(self) -> dict[str, int]:
        """``gym.checkpoint.operation.duration`` data points' counts by operation (mode on)."""
        counts: dict[str, int] = {}
        if self.reader is None:
            return counts
        data = self.reader.get_metrics_data()
        for resource_metrics in data.resource_metrics if data is not None else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name != "gym.checkpoint.operation.duration":
                        continue
                    for point in metric.data.data_points:
                        if isinstance(point, HistogramDataPoint):
                            operation = str(point.attributes.get(telemetry.OPERATION))
                            counts[operation] = counts.get(operation, 0) + point.count
        return counts

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def make_mode(name: str) -> Mode:
    """The providers of mode ``name``, each with its own exporter and reader."""
    processor = MODES[name]
    if processor is None:
        return Mode(name)
    resource = Resource.create({"service.name": "gymckpt-bench-telemetry", "service.version": gymckpt_version})
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(processor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    return Mode(name, tracer_provider, meter_provider, spans, reader)


# --- the episodes


def build_states(episodes: int, record_bytes: int, seed: int) -> dict[str, dict[str, Any]]:
    """``episodes`` seeded episode states of about ``record_bytes`` encoded bytes each, by capture key."""
    states = {}
    for index in range(episodes):
        rng = random.Random(f"gymckpt-bench:telemetry:{seed}:{index}")
        state = build_record(index, rng, record_bytes, nan=False, big_int=False)
        del state["episode_id"]  # the participant's record names its episode
        states[f"bench-{index:06d}"] = state
    return states


def digest(states: dict[str, Any]) -> str:
    """A digest equal for states that round-tripped exactly (key order, int vs float)."""
    hasher = hashlib.sha256()
    for key in sorted(states):
        hasher.update(key.encode())
        hasher.update(orjson.dumps(states[key]))
    return hasher.hexdigest()


# --- one repetition


def _routes(plane: ControlPlane) -> dict[str, Callable[..., Awaitable[Any]]]:
    """The server's route functions for ``plane``, by operation (``commit``, ``restore``, …)."""
    router = control_router(plane, TOKEN)
    return {route.path.rsplit("/", 1)[-1]: route.endpoint for route in router.routes if isinstance(route, APIRoute)}


def _control(checkpoint_id: str) -> ControlRequest:
    return ControlRequest(checkpoint_id=checkpoint_id, deadline_ts=time.time() + DEADLINE_S)


async def _timed(call: Awaitable[T]) -> tuple[float, float, T]:
    """Wall and CPU seconds of awaiting ``call``, after a collection of the previous step's garbage."""
    gc.collect()
    cpu = time.process_time()
    wall = time.perf_counter()
    result = await call
    return time.perf_counter() - wall, time.process_time() - cpu, result


async def _first_life(
    mode: Mode, states: dict[str, dict[str, Any]], checkpoint_id: str, checkpoint_dir: Path
) -> tuple[float, float, Any, int]:
    """Prepare, time commit of every episode, resume; returns the timings, the reply and its span count."""
    participant = FakeParticipant(KIND, INSTANCE)
    for key, state in states.items():
        participant.start(key, state)
    plane = ControlPlane(participant)
    routes = _routes(plane)
    try:
        prepared = await routes["prepare"](_control(checkpoint_id))
        if not prepared.report.ready:
            raise BenchFailure(f"prepare was not ready: {prepared.report}")
        request = CommitRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=time.time() + DEADLINE_S,
            checkpoint_dir=str(checkpoint_dir),
            episode_ids=list(states),
        )
        mode.drain()
        wall, cpu, reply = await _timed(routes["commit"](request))
        spans = mode.spans_of("commit", len(states))
        await routes["resume"](_control(checkpoint_id))
    finally:
        await plane.close()
    if reply.record_count != len(states) or len(reply.episode_ids) != len(states):
        raise BenchFailure(f"the commit wrote {reply.record_count} records, {len(states)} episodes were held")
    return wall, cpu, reply, spans


async def _second_life(
    mode: Mode, states: dict[str, dict[str, Any]], reference: str, checkpoint_id: str, checkpoint_dir: Path
) -> tuple[float, float, int, int]:
    """A restarted server: time restore of every episode, resume, check every restored state."""
    participant = FakeParticipant(KIND, INSTANCE)
    plane = ControlPlane(participant)
    routes = _routes(plane)
    try:
        request = RestoreRequest(
            checkpoint_id=checkpoint_id,
            deadline_ts=time.time() + DEADLINE_S,
            checkpoint_dir=str(checkpoint_dir),
            episode_ids=list(states),
        )
        mode.drain()
        wall, cpu, reply = await _timed(routes["restore"](request))
        spans = mode.spans_of("restore", len(states))
        await routes["resume"](_control(checkpoint_id))
    finally:
        await plane.close()
    expected = {f"{key}-a1" for key in states}
    if set(reply.restored) != expected:
        raise BenchFailure(f"the restore answered {len(reply.restored)} episodes, {len(expected)} committed")
    installed = {str(record["episode_id"]).removesuffix("-a1"): record["state"] for record in participant.installed}
    if len(participant.installed) != len(states) or digest(installed) != reference:
        raise BenchFailure("the restored states differ from the committed ones")
    return wall, cpu, len(reply.restored), spans


async def measure(
    mode: Mode, rep: int, states: dict[str, dict[str, Any]], reference: str, run_dir: Path
) -> Measurement:
    """Commit and restore once in ``mode``, in a checkpoint directory of their own (removed after)."""
    mode.bind()
    checkpoint_id = f"bench-telemetry-{mode.name}-r{rep}"
    checkpoint_dir = run_dir / checkpoint_id
    try:
        commit_s, commit_cpu_s, committed, commit_spans = await _first_life(mode, states, checkpoint_id, checkpoint_dir)
        restore_s, restore_cpu_s, restored, restore_spans = await _second_life(
            mode, states, reference, checkpoint_id, checkpoint_dir
        )
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    return Measurement(
        mode=mode.name,
        rep=rep,
        commit_s=commit_s,
        restore_s=restore_s,
        commit_cpu_s=commit_cpu_s,
        restore_cpu_s=restore_cpu_s,
        records_bytes=committed.records_bytes,
        record_count=committed.record_count,
        restored=restored,
        commit_spans=commit_spans,
        restore_spans=restore_spans,
    )


# --- the run


async def run(
    args: argparse.Namespace, modes: dict[str, Mode], states: dict[str, dict[str, Any]], run_dir: Path, console: Console
) -> list[Measurement]:
    """A warm-up round, then every repetition of every mode; the order of the modes alternates."""
    reference = digest(states)
    names = list(modes)
    for round_index in range(args.warmup):
        for name in names:
            await measure(modes[name], -1 - round_index, states, reference, run_dir)
        console.log(f"warm-up round {round_index + 1}/{args.warmup} done (untimed)")
    measurements: list[Measurement] = []
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            done = await measure(modes[name], rep, states, reference, run_dir)
            measurements.append(done)
            console.log(
                f"rep {rep + 1}/{args.reps}, {name}: commit {done.commit_s * 1000:.1f} ms "
                f"(CPU {done.commit_cpu_s * 1000:.1f} ms, {done.commit_spans} spans), restore "
                f"{done.restore_s * 1000:.1f} ms (CPU {done.restore_cpu_s * 1000:.1f} ms, {done.restore_spans} spans)"
            )
    telemetry.bind()
    for mode in modes.values():
        if mode.on:
            counts = mode.histogram_counts()
            due = args.reps + args.warmup
            if counts.get("commit") != due or counts.get("restore") != due:
                raise BenchFailure(f"mode {mode.name}: the duration histogram counted {counts}, {due} of each due")
    return measurements


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(measurements: list[Measurement], names: list[str]) -> list[dict[str, Any]]:
    """One row per mode: medians, and the medians of the per-repetition ratios and differences to off."""
    off = {item.rep: item for item in measurements if item.mode == "off"}
    rows = []
    for name in names:
        mine = [item for item in measurements if item.mode == name]
        ratios: dict[str, list[float]] = {"commit": [], "restore": []}
        deltas: dict[str, list[float]] = {"commit": [], "restore": [], "commit_cpu": [], "restore_cpu": []}
        for item in mine:
            base = off[item.rep]
            for operation, per_rep in ratios.items():
                ours, theirs = getattr(item, f"{operation}_s"), getattr(base, f"{operation}_s")
                per_rep.append(ours / theirs)
                deltas[operation].append(ours - theirs)
                deltas[f"{operation}_cpu"].append(
                    getattr(item, f"{operation}_cpu_s") - getattr(base, f"{operation}_cpu_s")
                )
        rows.append(
            {
                "mode": name,
                "label": _LABELS[name],
                "commit_s": _median([item.commit_s for item in mine]),
                "restore_s": _median([item.restore_s for item in mine]),
                "commit_cpu_s": _median([item.commit_cpu_s for item in mine]),
                "restore_cpu_s": _median([item.restore_cpu_s for item in mine]),
                "commit_ratio_vs_off": _median(ratios["commit"]),
                "restore_ratio_vs_off": _median(ratios["restore"]),
                "commit_delta_s": _median(deltas["commit"]),
                "restore_delta_s": _median(deltas["restore"]),
                "commit_cpu_delta_s": _median(deltas["commit_cpu"]),
                "restore_cpu_delta_s": _median(deltas["restore_cpu"]),
                "commit_spans": _median([item.commit_spans for item in mine]),
                "restore_spans": _median([item.restore_spans for item in mine]),
                "records_bytes": _median([item.records_bytes for item in mine]),
                "ratio_reps": ratios,
                "reps": [asdict(item) for item in mine],
            }
        )
    return rows


def _table(document: dict[str, Any]) -> Table:
    config = document["config"]
    table = Table(
        title=f"one participant, {config['episodes']:,} episodes of ~{config['record_bytes']:,} B "
        f"({document['rows'][0]['records_bytes'] / MB:.2f} MB of records); median of {config['reps']} "
        "repetition(s), modes alternating",
        title_justify="left",
    )
    table.add_column("telemetry", justify="left", no_wrap=True)
    for name in ("commit ms", "restore ms", "commit vs off", "restore vs off", "commit Δ ms", "restore Δ ms"):
        table.add_column(name, justify="right")
    table.add_column("commit CPU ms (Δ)", justify="right")
    table.add_column("restore CPU ms (Δ)", justify="right")
    table.add_column("spans commit/restore", justify="right", style="dim")
    for row in document["rows"]:
        table.add_row(
            Text(row["label"], style="bold"),
            f"{row['commit_s'] * 1000:.1f}",
            f"{row['restore_s'] * 1000:.1f}",
            Text(f"{row['commit_ratio_vs_off']:.3f}x", style="bold"),
            Text(f"{row['restore_ratio_vs_off']:.3f}x", style="bold"),
            f"{row['commit_delta_s'] * 1000:+.2f}",
            f"{row['restore_delta_s'] * 1000:+.2f}",
            f"{row['commit_cpu_s'] * 1000:.1f} ({row['commit_cpu_delta_s'] * 1000:+.2f})",
            f"{row['restore_cpu_s'] * 1000:.1f} ({row['restore_cpu_delta_s'] * 1000:+.2f})",
            f"{row['commit_spans']:g}/{row['restore_spans']:g}",
        )
    return table


def render(document: dict[str, Any], console: Console) -> None:
    """Print the machine line, what was measured, and the table."""
    config = document["config"]
    console.print(
        f"[bold]gymckpt {config['gymckpt']}: control-plane commit and restore with telemetry off and on[/]: "
        f"Python {config['python']}, opentelemetry-sdk {config['opentelemetry_sdk']}, {config['cpus']} CPUs, "
        f"{config['platform']}"
    )
    console.print(f"temp dir {config['dir']} ({config['filesystem']})")
    console.print(
        "commit and restore are the server's route functions (telemetry.operation around ControlPlane.commit/"
        "restore) awaited without HTTP, on a fake participant; commit of every episode after an untimed prepare, "
        "restore of every episode into a fresh plane and participant, every restored state checked. Spans go to an "
        "in-memory exporter, flushed (untimed) after each call; metrics to an InMemoryMetricReader. "
        "CPU: this process, every thread. A ratio is the median of the per-repetition ratios mode / off "
        "(> 1: slower); Δ the median of the per-repetition differences mode - off (wall, and CPU in brackets).\n"
    )
    console.print(_table(document))
    share = config["others_cpu_share"]
    warn_if_disturbed(console, share, config["cpus"])
    console.print(
        f"[dim]others' CPU share {share:.0%}; load average after: "
        f"{' '.join(f'{value:.2f}' for value in config['load_average'])}; total {config.get('elapsed_s', 0):.0f} s[/]"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_telemetry",
        description="Time control-plane commit and restore with telemetry off and on (batch, simple span processor).",
    )
    parser.add_argument("--episodes", type=positive, default=None, help="episodes held (default 2000, --quick 200)")
    parser.add_argument(
        "--record-bytes", type=positive, default=2048, help="encoded bytes of each episode's state (default 2048)"
    )
    parser.add_argument("--reps", type=positive, default=None, help="repetitions per mode (default 9, --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of every mode first (default 1)")
    parser.add_argument("--quick", action="store_true", help="200 episodes and 2 repetitions (a smoke run)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated modes, off among them (default {','.join(MODES)})"
    )
    parser.add_argument(
        "--dir",
        default=None,
        help=f"where the checkpoints go, on the filesystem under test (default {DEFAULT_DIR.relative_to(REPO)}/ "
        "in the repository); a run directory is created in it and removed after",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the episode states (default 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows to PATH as JSON")
    args = parser.parse_args(argv)
    args.episodes = args.episodes or (200 if args.quick else 2000)
    args.reps = args.reps or (2 if args.quick else 9)
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    args.modes = list(dict.fromkeys(part.strip() for part in args.modes.split(",") if part.strip()))
    for name in args.modes:
        if name not in MODES:
            parser.error(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    if "off" not in args.modes:
        parser.error("--modes must include off: the ratios are to off")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    base = Path(args.dir).resolve() if args.dir else DEFAULT_DIR
    created_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="telemetry-", dir=base))
    started = time.time()
    document: dict[str, Any] = {
        "config": {
            "episodes": args.episodes,
            "record_bytes": args.record_bytes,
            "reps": args.reps,
            "warmup": args.warmup,
            "modes": args.modes,
            "seed": args.seed,
            "dir": str(run_dir),
            "filesystem": filesystem(run_dir),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gymckpt": gymckpt_version,
            "opentelemetry_sdk": version("opentelemetry-sdk"),
        },
    }
    modes = {name: make_mode(name) for name in args.modes}
    console.log(f"building {args.episodes:,} episode states of ~{args.record_bytes:,} B (seed {args.seed}, untimed)")
    states = build_states(args.episodes, args.record_bytes, args.seed)
    gc.collect()
    gc.freeze()  # the states live outside the GC's generations: they burden no timed step
    cpu_start = cpu_snapshot()
    try:
        measurements = asyncio.run(run(args, modes, states, run_dir, console))
    except BenchFailure as exc:
        console.print(f"[bold red]WRONG RESULT, benchmark void:[/] {exc}")
        return 1
    finally:
        telemetry.bind()
        for mode in modes.values():
            mode.shutdown()
        gc.unfreeze()
        shutil.rmtree(run_dir, ignore_errors=True)
        if created_base:
            try:
                base.rmdir()
            except OSError:
                pass  # something else lives there now
    document["config"]["others_cpu_share"] = others_share(cpu_start, cpu_snapshot())
    document["rows"] = summarize(measurements, args.modes)
    document["config"]["elapsed_s"] = time.time() - started
    document["config"]["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        console.log(f"rows written to {args.json}")
    render(document, Console() if sys.stdout.isatty() else Console(width=170))
    return 0


if __name__ == "__main__":
    sys.exit(main())
