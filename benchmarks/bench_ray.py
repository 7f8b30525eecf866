"""``make bench-ray``: the Ray demo's scenario on three nodes against the one-machine stack, side by side.

::

    python -m benchmarks.bench_ray                      # 2,000 rollouts
    python -m benchmarks.bench_ray --rollouts 500 --json out.json
    python -m benchmarks.bench_ray --checkpoint-turn 2    # issue 27's scenario (a), checkpointed by turn
    python -m benchmarks.bench_ray --scenario b           # issue 27's (b): 1,000 sessions x 350 KB

Both runs take the same tasks, the same stack (:func:`~gymckpt.stack.harness.default_stack_spec`,
one uvicorn worker per server, the realistic state of issue 27 unless ``--state compact``, the
connection pools sized as bench_scale sizes them), the same inference token delay, a checkpoint
to ``s3://`` on moto's server (a child process) once half the rollouts have finished (or, with
``--checkpoint-turn``, once ``--checkpoint-share`` of them are in flight at that turn: by default
0.92 of those that fit inside the agent at once, as bench_scale's (a)), and every result
compared with an uninterrupted run:

- **three Ray nodes** (:func:`gymckpt.demo.ray_demo.run_ray_demo`): a head and two worker
  raylets on this machine, the environment and agent on ``node1``; ``node1`` is SIGKILLed,
  every server is placed again on the nodes left and restored. Recovery: from the node's
  death to every server answering after the restore (the loss's detection, the stop of the
  survivors, the new placement, the fresh processes answering, restore and resume).
- **one machine** (:func:`gymckpt.demo.run_demo`): every Gym server SIGKILLed and restarted on
  its port (the inference backend survives). Recovery: from the SIGKILL to the fresh
  processes answering, plus the restore.

Printed: prepare, commit, restore and recovery seconds, and the rollouts finished before the
loss, exported, lost and different, of each.

``--scenario b`` runs bench_scale's scenario (b) instead, both ways: the sandbox server of
1,000 sessions of 350 KB on this machine, SIGKILLed and restarted on its socket
(:func:`~benchmarks.scale_sessions.run_sessions_scenario`), and placed on a Ray node that is
then lost (:func:`~benchmarks.ray_sessions.run_ray_sessions`); the table is bench_scale's.

The machine's cores are shared by the three Ray nodes (Ray's CPU accounting only) and by
whatever else runs: figures are noisy. Needs what ``gymckpt demo
--ray`` needs (root, ``ip``, ``unshare``, ``pip install -e '.[ray,demo-s3]'``). Exit status 1
when a run fails, loses a rollout or a result differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.bench_scale import CHECKPOINT_SHARE, ConnectionPools, connection_pools
from benchmarks.machine import non_negative, positive
from benchmarks.ray_sessions import run_ray_sessions
from benchmarks.scale_demo import BUCKET, ChildMoto
from benchmarks.scale_report import render_sessions
from benchmarks.scale_sessions import SessionsRun, run_sessions_scenario
from gymckpt import __version__ as gymckpt_version
from gymckpt.demo import run_demo
from gymckpt.demo.launch import TurnTrigger
from gymckpt.demo.ray_demo import RayDemoUnavailable, run_ray_demo
from gymckpt.servers.sandbox import DEFAULT_SESSION_BYTES
from gymckpt.stack.harness import StateSizes
from gymckpt.transport import raise_descriptor_limit

__all__ = ["Side", "build_parser", "main"]


@dataclass
class Side:
    """One column of the comparison."""

    name: str
    ok: bool = False
    error: str = ""
    rollouts: int = 0
    finished_before: int = 0
    exported: int = 0
    lost: int = 0
    differing: int = 0
    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    restore_seconds: float = 0.0
    exported_past_first_turn: int = 0
    started_after_restore: int = 0
    records_mb: float = 0.0
    #: from the loss to fresh server processes answering (before the restore)
    placed_seconds: float = 0.0
    recovery_seconds: float = 0.0
    total_seconds: float = 0.0


def _ray_side(args: argparse.Namespace, console: Console) -> Side:
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the demo's own table: this prints its own
    try:
        outcome = run_ray_demo(
            rollouts=args.rollouts,
            console=quiet,
            progress_console=console,
            timeout=args.timeout,
            token_delay_seconds=args.token_delay,
            checkpoint_after=args.checkpoint_after,
            sizes=_sizes(args),
            checkpoint_turn=_trigger(args),
            pool_limits=_pool_limits(args),
        )
    except RayDemoUnavailable as exc:
        return Side("three Ray nodes", error=str(exc))
    finally:
        quiet.file.close()
    return Side(
        "three Ray nodes",
        ok=outcome.exit_code == 0,
        error=outcome.error,
        rollouts=outcome.rollouts,
        finished_before=outcome.finished_before,
        exported=outcome.exported,
        lost=len(outcome.lost),
        differing=len(outcome.differing),
        prepare_seconds=outcome.prepare_seconds,
        commit_seconds=outcome.commit_seconds,
        restore_seconds=outcome.restore_seconds,
        exported_past_first_turn=outcome.exported_past_first_turn,
        started_after_restore=outcome.started_after_restore,
        records_mb=sum(outcome.records_bytes.values()) / 1e6,
        placed_seconds=outcome.placed_seconds,
        recovery_seconds=outcome.recovery_seconds,
        total_seconds=outcome.total_seconds,
    )


def _one_machine_side(args: argparse.Namespace, console: Console, root: Path) -> Side:
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    try:
        with ChildMoto() as options:
            outcome = run_demo(
                rollouts=args.rollouts,
                store_url=f"s3://{BUCKET}/one-machine",
                storage_options=options,
                console=quiet,
                progress_console=console,
                timeout=args.timeout,
                logs_dir=root,
                workers=1,
                restore_workers=1,
                stack_options={"token_delay_seconds": args.token_delay, **_pool_limits(args)},
                checkpoint_after=args.checkpoint_after,
                sizes=_sizes(args),
                checkpoint_turn=_trigger(args),
            )
    finally:
        quiet.file.close()
    return Side(
        "one machine",
        ok=outcome.exit_code == 0,
        error=outcome.error,
        rollouts=outcome.rollouts,
        finished_before=len(outcome.finished_before),
        exported=len(outcome.exported),
        lost=len(outcome.lost),
        differing=len(outcome.differing),
        prepare_seconds=outcome.prepare_seconds,
        commit_seconds=outcome.commit_seconds,
        restore_seconds=outcome.restore_seconds,
        exported_past_first_turn=outcome.exported_past_first_turn,
        started_after_restore=len(outcome.started_after_restore),
        records_mb=outcome.bytes_written / 1e6,
        placed_seconds=outcome.restart_seconds,
        recovery_seconds=outcome.restart_seconds + outcome.restore_seconds,
        total_seconds=outcome.total_seconds,
    )


def _sizes(args: argparse.Namespace) -> StateSizes:
    return StateSizes() if args.state == "realistic" else StateSizes.compact()


def _trigger(args: argparse.Namespace) -> TurnTrigger | None:
    if args.checkpoint_turn <= 0:
        return None
    # as bench_scale's (a): a share of the rollouts that fit inside the agent at once, not of all of them
    share = args.checkpoint_share or CHECKPOINT_SHARE * _pools(args).data / args.rollouts
    return TurnTrigger(turn=args.checkpoint_turn, share=min(share, 0.95))


def _pools(args: argparse.Namespace) -> ConnectionPools:
    return connection_pools(resource.getrlimit(resource.RLIMIT_NOFILE)[0], args.rollouts)


def _pool_limits(args: argparse.Namespace) -> dict[str, int]:
    """Each Gym server's data pool, its pool to the resources server and the model's to the inference
    backend, sized as bench_scale sizes them."""
    pools = _pools(args)
    return {
        "data_pool_limit": pools.data,
        "resources_pool_limit": pools.resources,
        "inference_pool_limit": pools.inference,
    }


def render(sides: list[Side], out: Console) -> None:
    table = Table(title=f"the demo's scenario at {sides[0].rollouts:,} rollouts", title_justify="left")
    table.add_column("")
    for side in sides:
        table.add_column(side.name, justify="right")
    rows: list[tuple[str, str]] = [
        ("finished before the loss", "finished_before"),
        ("exported (continued after it)", "exported"),
        ("exported past their first turn", "exported_past_first_turn"),
        ("started after the restore (never launched)", "started_after_restore"),
        ("records MB", "records_mb"),
        ("lost", "lost"),
        ("differing", "differing"),
        ("prepare s", "prepare_seconds"),
        ("commit s", "commit_seconds"),
        ("restore s", "restore_seconds"),
        ("fresh servers answer s (of recovery)", "placed_seconds"),
        ("recovery s", "recovery_seconds"),
        ("whole run s", "total_seconds"),
    ]
    for label, name in rows:
        values = [getattr(side, name) for side in sides]
        table.add_row(label, *(f"{value:.3f}" if isinstance(value, float) else f"{value:,}" for value in values))
    out.print(table)
    for side in sides:
        if not side.ok:
            out.print(f"[red]{side.name} failed[/]: {side.error}", highlight=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ray", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenario",
        choices=("a", "b"),
        default="a",
        help="a: the demo's rollouts (the options below); b: bench_scale's big sessions (--sessions, --session-bytes)",
    )
    parser.add_argument("--rollouts", type=positive, default=2_000, help="rollouts of each run (2,000)")
    parser.add_argument("--token-delay", type=float, default=0.03, help="the inference backend's s per token")
    parser.add_argument(
        "--checkpoint-after", type=float, default=0.5, help="share of rollouts finished at the checkpoint (0.5)"
    )
    parser.add_argument(
        "--state",
        choices=("compact", "realistic"),
        default="realistic",
        help="the state each rollout carries: realistic (the demo's default, issue 27's scenario (a): prompts, "
        "tool outputs, 96-token generations with logprobs, reasoning), or compact (the small stack)",
    )
    parser.add_argument(
        "--checkpoint-turn",
        type=non_negative,
        default=0,
        help="checkpoint once --checkpoint-share of the rollouts are in flight at this model call or later "
        "(0: by --checkpoint-after)",
    )
    parser.add_argument(
        "--checkpoint-share",
        type=float,
        default=0.0,
        help=f"see --checkpoint-turn (default: {CHECKPOINT_SHARE} of the rollouts that fit inside the agent at once, "
        "as bench_scale's)",
    )
    parser.add_argument("--sessions", type=positive, default=1_000, help="(b) sandbox sessions (1,000)")
    parser.add_argument(
        "--session-bytes", type=positive, default=DEFAULT_SESSION_BYTES, help="(b) bytes each session holds (350 KB)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="bound of each phase in seconds (1800)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    out = Console(width=max(Console().width, 100))
    soft, hard = raise_descriptor_limit()
    # the harness's /run pool, in this process and the controller
    os.environ["GYMCKPT_POOL_LIMIT"] = str(_pools(args).trainer)
    console.print(
        f"gymckpt {gymckpt_version} · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"descriptors {soft:,} (hard {hard:,})",
        highlight=False,
    )
    if args.scenario == "b":
        return _sessions(args, console, out)
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as root:
        sides = [_one_machine_side(args, console, Path(root)), _ray_side(args, console)]
    render(sides, out)
    if args.json:
        figures = {"machine": {"gymckpt": gymckpt_version, "cpus": os.cpu_count()}, "runs": [asdict(s) for s in sides]}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = all(side.ok and side.lost == 0 and side.differing == 0 for side in sides)
    return 0 if ok else 1


def _sessions(args: argparse.Namespace, console: Console, out: Console) -> int:
    """Scenario (b) on this machine and on three Ray nodes, side by side; 0 when both came back whole."""
    with tempfile.TemporaryDirectory(prefix="bench-ray-b-") as root:
        columns: dict[str, SessionsRun] = {
            "one machine": run_sessions_scenario(
                sessions=args.sessions,
                session_bytes=args.session_bytes,
                root=Path(root),
                console=console,
                timeout=args.timeout,
            ),
            "three Ray nodes": run_ray_sessions(
                sessions=args.sessions, session_bytes=args.session_bytes, console=console, timeout=args.timeout
            ),
        }
    render_sessions(columns, out)
    for name, run in columns.items():
        if not run.ok:
            out.print(f"[red]{name} failed[/]: {run.error}", highlight=False)
    if args.json:
        figures = {
            "machine": {"gymckpt": gymckpt_version, "cpus": os.cpu_count()},
            "sessions": {name: asdict(run) for name, run in columns.items()},
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if all(run.ok for run in columns.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
