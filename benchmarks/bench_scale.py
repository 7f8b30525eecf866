"""The reference stack at scale (issue 27): three scenarios, each checkpointed, SIGKILLed, restored and checked.

::

    python -m benchmarks.bench_scale                                   # a, b and c at full size
    python -m benchmarks.bench_scale --scenario b --sessions 200       # a short run of b
    python -m benchmarks.bench_scale --scenario a --rollouts 2000 --workers 1 --no-profile
    python -m benchmarks.bench_scale --json out.json

- (a) ``gymckpt demo``'s scenario at ``--rollouts`` (16,000) with one and with two workers
  per server (``--workers 1,2``), checkpointing to local disk (:mod:`benchmarks.scale_demo`)
  once most of the rollouts that fit inside the agent are in flight at their second model
  call or later (``--checkpoint-turn``, ``--checkpoint-share``). Each rollout inside the agent holds a
  connection at every server on its path, and a process here has 20,000 descriptors (the
  hard limit, not raisable in this container): :func:`connection_pools` sizes each Gym
  server's data pool and the trainer's ``/run`` pool to fit (``--data-pool``,
  ``--trainer-pool``); the rollouts beyond wait in the trainer's pool, as a trainer's would.
  ``--stack-option KEY=VALUE`` reaches :func:`~gymckpt.stack.harness.default_stack_spec`
  (state sizes of the reference servers), ``--demo-option KEY=VALUE`` :func:`~gymckpt.demo.run_demo`
  (when to checkpoint); values are read as YAML (``3``, ``0.5``, ``true``, ``text``).
- (b) ``--sessions`` (1,000) sandbox sessions of ``--session-bytes`` (350,000) through the
  control plane and the HTTP routes (:mod:`benchmarks.scale_sessions`).
- (c) scenario (a) at the first worker count, checkpointing to ``s3://`` on moto's server
  (a child process on 127.0.0.1); its commit is reported as a ratio of (a)'s local commit
  in the same run.

Each prints, per participant, records and bytes, prepare/commit/restore seconds and their
steps, and each server's RSS before and peak during commit and restore
(:mod:`benchmarks.scale_memory`), with py-spy attribution of the Gym servers' CPU in (a) and
(c) (:mod:`benchmarks.scale_sampling`; ``--no-profile`` turns it off). ``--json FILE`` writes
every figure. Exit status 1 when any rollout or session is lost or differs, or a scenario fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from benchmarks.machine import cpu_snapshot, filesystem, non_negative, positive, warn_if_disturbed
from benchmarks.scale_demo import BUCKET, ChildMoto, DemoKnobs, ScaleRun, run_demo_scenario
from benchmarks.scale_report import TARGETS, render_demo_runs, render_s3_ratio, render_sessions, s3_commit_ratio
from benchmarks.scale_sampling import py_spy
from benchmarks.scale_sessions import SessionsRun, run_sessions_scenario
from gymckpt import __version__ as gymckpt_version
from gymckpt import transport
from gymckpt.servers.sandbox import DEFAULT_SESSION_BYTES

if TYPE_CHECKING:
    from benchmarks.scale_memory import PhaseMemory

__all__ = ["SCENARIOS", "TARGETS", "build_parser", "main"]

SCENARIOS = ("a", "b", "c")


def _raise_descriptor_limit() -> tuple[int, int]:
    """This process's soft descriptor limit raised to the hard one (the harness holds a socket per rollout)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard


def _cpu_seconds(demo_runs: list[ScaleRun]) -> float:
    return sum(figures.cpu_seconds for run in demo_runs for figures in run.servers.values())


def _others_share(start: tuple[float, float, float], end: tuple[float, float, float], ours: float) -> float:
    """The share of the CPUs busy with neither this process nor the servers it started (NaN: unknown)."""
    wall = end[0] - start[0]
    ours += end[1] - start[1]
    return max(0.0, ((end[2] - start[2]) - ours) / (wall * (os.cpu_count() or 1))) if wall > 0 else float("nan")


def _scenarios(text: str) -> list[str]:
    chosen = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"scenarios are a comma-separated choice of {', '.join(SCENARIOS)}")
    return [name for name in SCENARIOS if name in chosen]


def _option(text: str) -> tuple[str, Any]:
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key.strip(), yaml.safe_load(value)


#: descriptors a server process keeps beside its data connections (listening socket, logs, the store's files)
_DESCRIPTOR_SLACK = 1_000


#: the share of the rollouts that fit inside the agent at their second model call or later when (a) checkpoints:
#: the acceptance wants 8,000 of them past their first turn, and 9,116 fit at 20,000 descriptors
CHECKPOINT_SHARE = 0.92
#: the agent's and the environment's pool to the resources server: tool calls, seed and verify are short
RESOURCES_POOL = 512


@dataclasses.dataclass(frozen=True)
class ConnectionPools:
    """How many connections each leg of a rollout's path may hold per process (see :func:`connection_pools`)."""

    #: each Gym server's data pool towards the next server on the path: the rollouts inside the agent at once
    data: int
    #: the trainer's ``/run`` calls at the environment
    trainer: int
    #: the agent's and the environment's pool of its own to the resources server
    resources: int
    #: the model server's connections to the inference backend, in all: the generations decoding at once
    inference: int


def connection_pools(descriptors: int, rollouts: int) -> ConnectionPools:
    """Pools that fit the stack into ``descriptors`` per process, at any worker count.

    A rollout inside the agent holds a connection at every server on its path: the trainer's
    ``/run`` into the environment, the environment's to the agent, the agent's to the model,
    the model's to the inference backend. So the environment and the agent each hold two per
    rollout, and beside them the connections to the resources server, which take a pool of
    their own (:data:`RESOURCES_POOL`; in a shared pool, their idle connections would sit
    outside its bound) and the awaited lanes. The trainer's pool is no larger than the data
    pool: the kernel spreads accepted connections over a server's workers unevenly, so one
    worker may get nearly all of them. At 20,000 descriptors: 9,116 rollouts inside the agent.

    The model server's pool to the inference backend stays at a server's own bound
    (:data:`~gymckpt.transport.DOWNSTREAM_POOL_LIMIT`, 1,024), as an inference engine's batch
    would bound it: a rollout waiting there for its generation to start is still inside the
    agent. Sized like the data pool, it let 9,116 generations decode at once, their replies came
    faster than two cores serve them, and each server's event loop fell seconds behind, a
    checkpoint's control calls with it (prepare 4-16 s).
    """
    resources = RESOURCES_POOL
    awaited = 2 * transport.AWAITED_POOL_LIMIT  # the environment's and the agent's, to two servers each
    share = max((descriptors - _DESCRIPTOR_SLACK - resources - awaited) // 2, 64)
    pool = min(rollouts, share)
    inference = min(transport.DOWNSTREAM_POOL_LIMIT, pool)
    return ConnectionPools(data=pool, trainer=pool, resources=min(resources, pool), inference=inference)


def _memory_json(memory: dict[str, dict[str, PhaseMemory]]) -> dict[str, Any]:
    return {
        phase: {
            name: {
                **asdict(figures),
                "bound": figures.bound,
                "within_bound": figures.within_bound,
                "cpu_seconds": figures.cpu_seconds,
            }
            for name, figures in windows.items()
        }
        for phase, windows in memory.items()
    }


def _run_json(run: ScaleRun | SessionsRun) -> dict[str, Any]:
    return {**asdict(run), "memory": _memory_json(run.memory)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module notes)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario", type=_scenarios, default=list(SCENARIOS), help="which scenarios, comma-separated (a,b,c)"
    )
    parser.add_argument("--rollouts", type=positive, default=16_000, help="(a, c) rollouts started at once (16,000)")
    parser.add_argument(
        "--workers", default="1,2", help="(a) uvicorn workers per Gym server, one run each, comma-separated (1,2)"
    )
    parser.add_argument(
        "--s3-workers", type=positive, default=None, help="(c) workers per Gym server (the first of --workers)"
    )
    parser.add_argument("--token-delay", type=float, default=0.5, help="(a, c) the inference backend's s per token")
    parser.add_argument("--tool-turns", type=int, default=3, help="(a, c) tool calls per rollout (3)")
    parser.add_argument(
        "--checkpoint-after",
        type=float,
        default=0.25,
        help="(a, c) with --checkpoint-turn 0: share of rollouts finished when the checkpoint is taken (0.25)",
    )
    parser.add_argument(
        "--checkpoint-turn",
        type=non_negative,
        default=2,
        help="(a, c) checkpoint once --checkpoint-share of all rollouts are in flight at this model call or later "
        "(2; 0: by --checkpoint-after)",
    )
    parser.add_argument(
        "--checkpoint-share",
        type=float,
        default=None,
        help=f"(a, c) see --checkpoint-turn (default: {CHECKPOINT_SHARE} of the rollouts that fit inside the agent at once)",
    )
    parser.add_argument(
        "--stack-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="(a, c) one more keyword of default_stack_spec (repeatable)",
    )
    parser.add_argument(
        "--demo-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="(a, c) one more keyword of run_demo (repeatable)",
    )
    parser.add_argument(
        "--data-pool",
        type=positive,
        default=None,
        help="(a, c) each Gym server's outbound data connections per process: how many rollouts can be inside "
        "the agent at once (default: what the descriptor limit allows, see the module notes)",
    )
    parser.add_argument(
        "--trainer-pool",
        type=positive,
        default=None,
        help="(a, c) the trainer's /run connections to the environment (GYMCKPT_POOL_LIMIT; default: the rest "
        "of the environment's descriptors)",
    )
    parser.add_argument(
        "--inference-pool",
        type=positive,
        default=None,
        help="(a, c) the model server's connections to the inference backend, in all: how many generations "
        f"decode at once (default: {transport.DOWNSTREAM_POOL_LIMIT:,}, a server's own bound)",
    )
    parser.add_argument("--sessions", type=positive, default=1_000, help="(b) sandbox sessions (1,000)")
    parser.add_argument(
        "--session-bytes", type=positive, default=DEFAULT_SESSION_BYTES, help="(b) bytes per session (350,000)"
    )
    parser.add_argument("--session-workers", type=positive, default=1, help="(b) workers of the sandbox server (1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="bound of each phase in seconds (1800)")
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="how often the servers are sampled")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True, help="py-spy profiles")
    parser.add_argument("--dir", default=None, help="where the checkpoints and logs go (a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and logs of a run that passed")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    worker_counts = [int(part) for part in args.workers.split(",") if part.strip()]
    console = Console(stderr=True)
    out = Console(width=max(Console().width, 140))
    soft, hard = _raise_descriptor_limit()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    demo_scenarios = {"a", "c"} & set(args.scenario)
    if demo_scenarios and args.profile and py_spy() is None:
        console.print("py-spy is not installed (pip install py-spy): CPU seconds only, no breakdown")
    console.print(
        f"gymckpt {gymckpt_version} · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"descriptors {soft:,} (hard {hard:,}) · store {root} ({filesystem(root)})",
        highlight=False,
    )

    def sized(workers: int) -> DemoKnobs:
        """The knobs of one run at ``workers`` workers, its connection pools sized (and said) for it."""
        pools = connection_pools(soft, args.rollouts)
        data_pool, trainer_pool = args.data_pool or pools.data, args.trainer_pool or pools.trainer
        inference_pool = args.inference_pool or pools.inference
        os.environ["GYMCKPT_POOL_LIMIT"] = str(trainer_pool)  # the harness's pool (the servers are given theirs)
        console.print(
            f"{workers} worker(s) per server: up to {trainer_pool:,} /run calls at the environment (the trainer's "
            f"pool; the rest wait in the trainer), each Gym server process's data pool {data_pool:,}, "
            f"to the resources server {pools.resources:,}, the model's to the inference backend {inference_pool:,}",
            highlight=False,
        )
        demo_options = dict(knobs.demo_options)
        if args.checkpoint_turn and "checkpoint_turn" not in dict(args.demo_option):
            share = args.checkpoint_share or CHECKPOINT_SHARE * min(trainer_pool, data_pool) / args.rollouts
            demo_options["checkpoint_turn"] = {"turn": args.checkpoint_turn, "share": min(share, 0.95)}
        return dataclasses.replace(
            knobs,
            stack_options={
                **knobs.stack_options,
                "data_pool_limit": data_pool,
                "resources_pool_limit": pools.resources,
                "inference_pool_limit": inference_pool,
            },
            demo_options=demo_options,
        )

    knobs = DemoKnobs(
        rollouts=args.rollouts,
        timeout=args.timeout,
        checkpoint_after=args.checkpoint_after,
        sample_seconds=args.sample_seconds,
        profile=args.profile,
        keep=args.keep,
        stack_options={
            "token_delay_seconds": args.token_delay,
            "tool_turns": args.tool_turns,
            **dict(args.stack_option),
        },
        demo_options={"checkpoint_turn": None, **dict(args.demo_option)},
    )
    before = cpu_snapshot()
    local: list[ScaleRun] = []
    s3: list[ScaleRun] = []
    sessions: SessionsRun | None = None
    if "a" in args.scenario:
        for workers in worker_counts:
            local.append(run_demo_scenario("a", sized(workers), workers, root, console))
            if local[-1].terminated:  # SIGTERM: the demo stopped its servers; no further run
                break
    terminated = any(run.terminated for run in local)
    if "b" in args.scenario and not terminated:
        sessions = run_sessions_scenario(
            sessions=args.sessions,
            session_bytes=args.session_bytes,
            workers=args.session_workers,
            root=root,
            console=console,
            timeout=args.timeout,
            keep=args.keep,
        )
    if "c" in args.scenario and not terminated:
        workers = args.s3_workers or worker_counts[0]
        with ChildMoto() as options:
            store_url = f"s3://{BUCKET}/checkpoints"
            s3.append(
                run_demo_scenario(
                    "c", sized(workers), workers, root, console, store_url=store_url, storage_options=options
                )
            )
    share = _others_share(before, cpu_snapshot(), _cpu_seconds(local + s3))
    render_demo_runs(local + s3, out)
    if sessions is not None:
        render_sessions({"sandbox": sessions}, out)
    ratio = s3_commit_ratio(local, s3)
    render_s3_ratio(ratio, out)
    warn_if_disturbed(out, share, os.cpu_count())
    if args.json:
        figures = {
            "machine": {"gymckpt": gymckpt_version, "python": platform.python_version(), "cpus": os.cpu_count()},
            "targets": TARGETS,
            "a": [_run_json(run) for run in local],
            "b": _run_json(sessions) if sessions is not None else None,
            "c": [_run_json(run) for run in s3],
            "c_commit_ratio": ratio,
            "others_cpu_share": share,
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    if not args.dir:
        with contextlib.suppress(OSError):
            root.rmdir()  # empty unless a run kept its directory
    runs: list[Any] = [*local, *s3, *([sessions] if sessions is not None else [])]
    return 0 if runs and all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
