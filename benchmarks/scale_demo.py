"""Scenarios (a) and (c) of bench_scale: ``gymckpt demo``'s scenario at scale, on local disk or on S3.

Each run is :func:`gymckpt.demo.run_demo` at ``rollouts``: an uninterrupted run of every
task, then a fresh stack with every rollout started, a checkpoint once ``checkpoint_after``
of them have finished (so most are in flight, the inference backend's token delay keeping
them there), SIGKILL of every Gym server, fresh processes with the same worker count,
restore, resume, and each exported rollout continued (the others start over). Every result
is compared with the uninterrupted run's.

(a) checkpoints into a local directory; (c) into ``s3://`` on moto's server, run in a child
process on 127.0.0.1 (its own GIL: the controller's rollouts do not slow it down).
:class:`DemoKnobs` carries what the stack and the demo are given, including options named
only on the command line (``--stack-option``/``--demo-option``), so new knobs of the
reference servers (state sizes) and of the demo (when to checkpoint) pass through unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from benchmarks.scale_sampling import CoordinatorSpans, ServerFigures, ServerSampler
from gymckpt.demo import run_demo
from gymckpt.demo.report import EXIT_TERMINATED

if TYPE_CHECKING:
    from benchmarks.scale_memory import PhaseMemory
    from gymckpt.demo.report import DemoOutcome

__all__ = ["BUCKET", "DemoKnobs", "ScaleRun", "ChildMoto", "run_demo_scenario"]

#: the bucket scenario (c) checkpoints into
BUCKET = "gymckpt-bench-scale"


@dataclass
class DemoKnobs:
    """What every demo run of the benchmark is given."""

    rollouts: int
    timeout: float = 1800.0
    checkpoint_after: float = 0.25
    sample_seconds: float = 0.5
    profile: bool = True
    keep: bool = False
    #: for :func:`~gymckpt.stack.harness.default_stack_spec` (``token_delay_seconds``, ``tool_turns``, state sizes, …)
    stack_options: dict[str, Any] = field(default_factory=dict)
    #: further keyword arguments of :func:`~gymckpt.demo.run_demo` (when to checkpoint, …)
    demo_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScaleRun:
    """One demo run at one worker count, on one store."""

    scenario: str
    workers: int
    rollouts: int
    store: str = "local"
    ok: bool = False
    error: str = ""
    #: stopped by SIGTERM (the demo stopped every server it started)
    terminated: bool = False
    in_flight_at_checkpoint: int = 0
    exported: int = 0
    exported_past_first_turn: int = 0
    continued: int = 0
    restarted: int = 0
    #: rollouts not started before the checkpoint (the turn trigger reached during the launch)
    started_after_restore: int = 0
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
    #: ``kind/instance`` → records and bytes it committed
    records_by_participant: dict[str, int] = field(default_factory=dict)
    bytes_by_participant: dict[str, int] = field(default_factory=dict)
    #: the coordinator's spans: each prepare stage's seconds (environment, model, agent, resources)
    prepare_stages: dict[str, float] = field(default_factory=dict)
    #: the controller's call to each Gym server, s: ``{"commit": {"agent": 0.61}}`` (its route's line says
    #: how much of it the server spent on the operation; the rest is the request and reply in transit)
    call_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    #: each participant's own commit and restore, from its INFO line: ``{"commit": {"agent": "0.57 (…)"}}``
    participant_lines: dict[str, dict[str, str]] = field(default_factory=dict)
    #: each Gym server's memory around the commit and the restore: ``{"commit": {"agent": PhaseMemory}}``
    memory: dict[str, dict[str, PhaseMemory]] = field(default_factory=dict)
    servers: dict[str, ServerFigures] = field(default_factory=dict)


def run_demo_scenario(
    scenario: str,
    knobs: DemoKnobs,
    workers: int,
    root: Path,
    console: Console,
    *,
    store_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ScaleRun:
    """One demo run at ``workers`` workers per Gym server (before and after the crash).

    ``store_url`` is where the checkpoint goes (default: a directory under ``root``), with
    ``storage_options`` (an S3 endpoint's).
    """
    spans = CoordinatorSpans()
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{scenario}-{workers}w-", dir=root))
    sampler = ServerSampler(knobs.sample_seconds, profile=knobs.profile, workdir=workdir, keep_logs=knobs.keep)
    sampler.start()
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the demo's table: this benchmark prints its own
    try:
        options: dict[str, Any] = {
            "rollouts": knobs.rollouts,
            "store_url": store_url or str(workdir / "checkpoints"),
            "storage_options": storage_options,
            "timeout": knobs.timeout,
            "workers": workers,
            "restore_workers": workers,
            "stack_options": dict(knobs.stack_options),
            "checkpoint_after": knobs.checkpoint_after,
            **knobs.demo_options,  # a demo option named on the command line wins
        }
        outcome = run_demo(console=quiet, progress_console=console, logs_dir=workdir, observer=sampler, **options)
    finally:
        sampler.stop()
        quiet.file.close()
    run = _figures(outcome, scenario, workers, "s3" if store_url and "://" in store_url else "local")
    run.servers = sampler.figures
    run.prepare_stages = spans.prepare_stages()
    names = {url: name for name, url in sampler.server_urls.items()}
    run.call_seconds = {
        operation: {names.get(url, url): seconds for url, seconds in spans.call_seconds(operation).items()}
        for operation in ("commit", "restore")
    }
    spans.clear()
    run.participant_lines = sampler.participant_lines
    run.memory = _with_records_bytes(sampler.memory, outcome)
    if run.ok and not knobs.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not run.ok:
        console.print(f"kept for a look: {workdir}", highlight=False)
    return run


def _with_records_bytes(memory: dict[str, dict[str, PhaseMemory]], outcome: DemoOutcome) -> dict[str, Any]:
    """Each server's windows with the bytes of its participant's records (server name = participant kind,
    ``resources`` for the resources server)."""
    by_kind: dict[str, int] = {}
    for name, size in outcome.bytes_by_participant.items():
        kind = name.partition("/")[0]
        by_kind[kind] = by_kind.get(kind, 0) + size
    for windows in memory.values():
        for server, figures in windows.items():
            figures.records_bytes = by_kind.get(server, 0)
    return memory


def _figures(outcome: DemoOutcome, scenario: str, workers: int, store: str) -> ScaleRun:
    return ScaleRun(
        scenario=scenario,
        workers=workers,
        rollouts=outcome.rollouts,
        store=store,
        ok=outcome.exit_code == 0,
        error=outcome.error,
        terminated=outcome.exit_code == EXIT_TERMINATED,
        in_flight_at_checkpoint=outcome.rollouts - len(outcome.finished_before) - len(outcome.started_after_restore)
        if outcome.exported
        else 0,
        exported=len(outcome.exported),
        exported_past_first_turn=outcome.exported_past_first_turn,
        continued=len(outcome.continued),
        restarted=len(outcome.restarted),
        started_after_restore=len(outcome.started_after_restore),
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
        records_by_participant=dict(outcome.records_by_participant),
        bytes_by_participant=dict(outcome.bytes_by_participant),
    )


_SERVE_MOTO = """
import sys
from gymckpt.testing.moto import MotoEndpoint
endpoint = MotoEndpoint().start()
endpoint.create_bucket(sys.argv[1])
print(endpoint.url, flush=True)
sys.stdin.read()  # until the parent closes it
endpoint.stop()
"""


class ChildMoto:
    """moto's S3 server in a child process on 127.0.0.1 and a free port, with ``bucket`` created.

    ``with ChildMoto(bucket) as options:`` gives the storage options that reach it.
    """

    def __init__(self, bucket: str = BUCKET) -> None:
        self.bucket = bucket
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> dict[str, Any]:
        from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET

        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVE_MOTO, self.bucket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        url = self._process.stdout.readline().strip()
        if not url.startswith("http://"):
            self.__exit__()
            raise RuntimeError("moto's S3 server did not start (pip install -e '.[demo-s3]')")
        return {"endpoint_url": url, "key": DUMMY_KEY, "secret": DUMMY_SECRET, "region": "us-east-1"}

    def __exit__(self, *exc_info: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
