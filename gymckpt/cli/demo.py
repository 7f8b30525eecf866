"""``gymckpt demo``: checkpoint rollouts in flight, kill every server, restore, continue, verify."""

from __future__ import annotations

import functools
import sys

import click

from gymckpt.cli._errors import Command, fail
from gymckpt.cli._options import log_level_option
from gymckpt.cli._output import stderr, stdout
from gymckpt.errors import GymckptError
from gymckpt.stack.serving import MAX_WORKERS

__all__ = ["demo_command"]


@click.command("demo", cls=Command)
@functools.partial(log_level_option, default="warning")
@click.option("--rollouts", default=64, show_default=True, type=click.IntRange(1, 100_000), help="Concurrent rollouts.")
@click.option(
    "--store",
    "store_url",
    default="./checkpoints",
    show_default=True,
    help="Store root (path or URL), or 's3' for an S3 endpoint the demo serves itself (moto, no account).",
)
@click.option("--keep", is_flag=True, help="Leave the restarted stack running; print its URLs and how to stop it.")
@click.option("--seed", default=0, show_default=True, help="Chooses the tasks (the same seed, the same results).")
@click.option(
    "--store-only", is_flag=True, help="Only the store: write four participants' generated records, no servers."
)
@click.option("--episodes", default=64, show_default=True, help="With --store-only: records per participant.")
@click.option(
    "--workers",
    default=2,
    show_default=True,
    type=click.IntRange(1, MAX_WORKERS),
    help="uvicorn workers of each Gym server before the crash.",
)
@click.option(
    "--restore-workers",
    default=3,
    show_default=True,
    type=click.IntRange(1, MAX_WORKERS),
    help="uvicorn workers of each Gym server after the crash (the restore lands on another worker count).",
)
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    help="Three Ray nodes on this machine (root): kill the one holding the environment and agent, recover.",
)
def demo_command(
    rollouts: int,
    store_url: str,
    keep: bool,
    seed: int,
    store_only: bool,
    episodes: int,
    workers: int,
    restore_workers: int,
    on_ray: bool,
) -> None:
    """Checkpoint rollouts in flight, kill every server, restore, continue, verify.

    \b
    Starts the reference stack as real processes on loopback and runs the tasks once
    uninterrupted; then, on a fresh stack, starts the rollouts, checkpoints the ones in
    flight once about half have finished, SIGKILLs every server, restarts them, restores,
    continues each exported rollout, compares every result with the uninterrupted run,
    verifies the checkpoint offline and prints a table. Each Gym server runs --workers
    uvicorn workers before the crash and --restore-workers after it.
    With --ray: a cluster of three Ray nodes in a network namespace of its own (root),
    the stack spread over them, the node holding the environment and agent SIGKILLed,
    every server placed again on the nodes left and restored (gymckpt.demo.ray_demo).
    Exit status: 0 success, 1 a rollout lost, a result different or a damaged
    checkpoint, 2 setup failure, 143 stopped by SIGTERM (every server, and with --ray
    the cluster, taken down first).
    """
    from gymckpt.demo import run_demo, run_s3_demo, run_s3_store_demo, run_store_demo

    if on_ray:
        _ray_demo(rollouts, seed, store_only or keep)
    if store_only:
        if store_url == "s3":
            try:
                sys.exit(run_s3_store_demo(episodes=episodes, seed=seed, console=stdout()))
            except GymckptError as exc:
                fail(str(exc))
        sys.exit(run_store_demo(store_url, episodes=episodes, seed=seed, console=stdout()))
    if store_url == "s3":
        try:  # moto or s3fs missing: one line naming the extra to install
            outcome = run_s3_demo(
                rollouts=rollouts,
                keep=keep,
                seed=seed,
                console=stdout(),
                progress_console=stderr(),
                workers=workers,
                restore_workers=restore_workers,
            )
        except GymckptError as exc:
            fail(str(exc))
    else:
        outcome = run_demo(
            rollouts=rollouts,
            store_url=store_url,
            keep=keep,
            seed=seed,
            console=stdout(),
            progress_console=stderr(),
            workers=workers,
            restore_workers=restore_workers,
        )
    sys.exit(outcome.exit_code)


def _ray_demo(rollouts: int, seed: int, incompatible: bool) -> None:
    """``--ray``: the demo on three local Ray nodes; a machine that cannot run it is one line, exit status 2."""
    from gymckpt.demo.ray_demo import RayDemoUnavailable, run_ray_demo

    if incompatible:
        fail("--ray takes --rollouts and --seed only (it checkpoints to its own S3 server and keeps nothing)")
    try:
        outcome = run_ray_demo(rollouts=rollouts, seed=seed, console=stdout(), progress_console=stderr())
    except RayDemoUnavailable as exc:
        fail(str(exc))
    sys.exit(outcome.exit_code)
