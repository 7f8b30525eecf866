"""``gymckpt demo --ray``: the reference stack over three Ray nodes, one of them lost and recovered from.

:func:`run_ray_demo` starts a Ray cluster on this machine
(:class:`~gymckpt.testing.raycluster.RayCluster`: a head and two worker raylets in a network
namespace it makes, only ``lo`` up, the machine's cores split between the three nodes as Ray
CPUs) and runs the controller in that namespace (``python -m gymckpt.demo.ray_demo REQUEST
RESULT``, a Ray driver: every Ray address is 127.0.0.1 there). The controller:

1. starts moto's S3 server in the namespace and places the reference stack
   (:func:`~gymckpt.stack.harness.default_stack_spec`) through
   :class:`~gymckpt.stack.ray.RayStack`: the environment and the agent pinned to ``node1``
   (a Ray resource of that node), the inference backend to the head, the model and
   resources servers wherever Ray's ``spread`` puts them. Checkpoints go to S3: with
   servers on three nodes a directory would have to be shared by every node (here the
   nodes share one disk, which a real cluster does not: S3 is what a real cluster uses);
2. runs every task once uninterrupted (the results to reproduce), then starts them again
   and checkpoints once half have finished, with the others in flight;
3. SIGKILLs ``node1``'s raylet and every process on it (the environment and the agent go
   with it), waits for the launcher to see the loss, places every server again on the
   nodes left, restores the checkpoint (:func:`~gymckpt.stack.ray_recovery.recover`),
   continues each exported rollout and starts the others over;
4. compares every result with the uninterrupted run's and writes what it saw as JSON.

This process then prints the table: each server's node before and after, the rollouts
(none lost, none different), and prepare, commit, restore and recovery seconds (recovery:
from the node's death to every server answering after the restore). Needs root, ``ip`` and
``unshare``, the ray extra and moto's server (``pip install -e '.[ray,demo-s3]'``).
Exit status: 0 success, 1 a rollout lost or different (or a phase failing), 2 setup, 143
stopped by SIGTERM (which, as Ctrl-C, takes the cluster and its namespace down first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gymckpt.demo.launch import TurnTrigger
from gymckpt.demo.report import (
    EXIT_DIFFERS,
    EXIT_OK,
    EXIT_SETUP,
    EXIT_TERMINATED,
    Progress,
    compare_results,
    result_of,
)
from gymckpt.demo.stacks import PhaseFailed
from gymckpt.stack.harness import StateSizes

if TYPE_CHECKING:
    from collections.abc import Iterator

    from gymckpt.stack.harness import RolloutHarness
    from gymckpt.stack.ray import RayStack

__all__ = ["RayDemoOutcome", "RayDemoUnavailable", "run_ray_demo"]

#: the worker node that holds the environment and the agent, and is killed
VICTIM = "node1"
#: the bucket of moto's S3 server the checkpoint goes to
BUCKET = "gymckpt-ray-demo"
#: how long the ``/run`` calls the environment ended before its export may take to reply
ENDED_RUNS_SECONDS = 10.0


class RayDemoUnavailable(RuntimeError):
    """This machine cannot run the Ray demo; the one-line message says what is missing."""


@dataclass
class RayDemoOutcome:
    """What one run of the Ray demo saw (numbers stay 0 for phases not reached)."""

    rollouts: int
    #: node name → Ray node id
    nodes: dict[str, str] = field(default_factory=dict)
    #: server → node name, at the first placement and after the recovery
    before: dict[str, str] = field(default_factory=dict)
    after: dict[str, str] = field(default_factory=dict)
    killed: str = ""
    #: the servers the launcher reported lost with the node
    lost_servers: list[str] = field(default_factory=list)
    checkpoint_dir: str = ""
    in_flight: int = 0
    finished_before: int = 0
    exported: int = 0
    continued: int = 0
    started_over: int = 0
    lost: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    placements: int = 0
    prepare_seconds: float = 0.0
    commit_seconds: float = 0.0
    restore_seconds: float = 0.0
    #: from the node's death to the launcher reporting its servers lost
    detect_seconds: float = 0.0
    #: from the node's death to every server placed again and answering (before the restore)
    placed_seconds: float = 0.0
    #: from the node's death to every server answering after the restore (and resumed)
    recovery_seconds: float = 0.0
    uninterrupted_seconds: float = 0.0
    total_seconds: float = 0.0
    #: rollouts the turn trigger left unlaunched, started after the restore as first attempts, with a result
    started_after_restore: int = 0
    #: exported rollouts past their first turn (from the checkpoint's environment and agent records)
    exported_past_first_turn: int = 0
    #: ``kind/instance`` → bytes of the participant's records in the checkpoint
    records_bytes: dict[str, int] = field(default_factory=dict)
    error: str = ""
    exit_code: int = EXIT_OK


# --------------------------------------------------------------------------- this process: the cluster, the table


def unavailable() -> str | None:
    """What this machine lacks for the Ray demo, in one line (None: nothing)."""
    from gymckpt.testing.raycluster import missing

    lacking = missing()
    try:
        from gymckpt.demo.s3 import require_s3_packages

        require_s3_packages()
    except Exception:
        lacking.append("moto's server and s3fs (pip install -e '.[demo-s3]')")
    if not lacking:
        return None
    return f"gymckpt demo --ray needs {'; '.join(lacking)} (run as root with iproute2 and util-linux installed)"


def run_ray_demo(
    *,
    rollouts: int = 64,
    seed: int = 0,
    console: Console,
    progress_console: Console | None = None,
    timeout: float = 300.0,
    token_delay_seconds: float = 0.03,
    checkpoint_after: float = 0.5,
    sizes: StateSizes | None = None,
    checkpoint_turn: TurnTrigger | None = None,
    pool_limits: dict[str, int] | None = None,
) -> RayDemoOutcome:
    """Run the Ray demo (see the module); print progress on ``progress_console`` and the table on ``console``.

    Raises :class:`RayDemoUnavailable` when the machine lacks what it needs. ``timeout`` bounds
    each phase of the controller. ``sizes``: the state each rollout carries
    (:class:`~gymckpt.stack.harness.StateSizes`; default its realistic defaults, as
    :func:`~gymckpt.demo.run_demo`'s; :meth:`StateSizes.compact` for the small stack);
    ``checkpoint_turn``: checkpoint once that share of the rollouts in flight reached that turn
    (instead of ``checkpoint_after`` of them finished). ``pool_limits``: ``data_pool_limit``,
    ``resources_pool_limit`` and ``inference_pool_limit`` of
    :func:`~gymckpt.stack.harness.default_stack_spec` (a benchmark at thousands of rollouts sizes
    them to the descriptors).
    """
    why = unavailable()
    if why is not None:
        raise RayDemoUnavailable(why)
    from gymckpt.testing.raycluster import (
        RayCluster,
        RayClusterError,
        RayClusterUnavailable,
        Terminated,
        sigterm_unwinds,
    )

    progress = Progress(progress_console or console)
    outcome = RayDemoOutcome(rollouts=rollouts)
    began = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))  # short: Ray's Unix sockets live under it
    cpus = max(1, (os.cpu_count() or 1) // 3)
    cluster = RayCluster(base, workers=2, cpus=cpus)  # its own namespace: Ray's default port is free there
    with sigterm_unwinds():
        try:
            progress(f"[bold]gymckpt demo --ray[/]: a Ray cluster of three nodes (head, node1, node2; {cpus} CPU each)")
            try:
                cluster.start()
            except (RayClusterUnavailable, RayClusterError) as exc:
                outcome.error, outcome.exit_code = " ".join(str(exc).split()), EXIT_SETUP
                return outcome
            outcome.nodes = cluster.node_ids()
            progress(
                "cluster up in namespace "
                + cluster.namespace
                + ": "
                + ", ".join(f"{name} {node[:8]}" for name, node in outcome.nodes.items())
            )
            request = {
                "address": cluster.address,
                "base": str(base),
                "cluster_id": cluster.cluster_id,
                "node_ids": outcome.nodes,
                "rollouts": rollouts,
                "seed": seed,
                "timeout": timeout,
                "cpus": cpus,
                "token_delay_seconds": token_delay_seconds,
                "checkpoint_after": checkpoint_after,
                "sizes": asdict(sizes if sizes is not None else StateSizes()),
                "checkpoint_turn": None if checkpoint_turn is None else asdict(checkpoint_turn),
                "pool_limits": dict(pool_limits or {}),
            }
            outcome = _run_controller(cluster, request, base, progress_console or console, timeout)
        except Terminated:
            outcome.error, outcome.exit_code = "stopped by SIGTERM; the Ray cluster was taken down", EXIT_TERMINATED
        finally:
            left = cluster.close()
            shutil.rmtree(base, ignore_errors=True)
            if left:
                progress(f"[red]left behind: {escape(', '.join(left))}[/]")
    outcome.total_seconds = time.perf_counter() - began
    render(outcome, console)
    return outcome


def _run_controller(
    cluster: Any, request: dict[str, Any], base: Path, progress_console: Console, timeout: float
) -> RayDemoOutcome:
    bound = 10 * timeout
    run = cluster.run_driver(
        sys.executable,
        "-m",
        "gymckpt.demo.ray_demo",
        request=request,
        base=base,
        bound=bound,
        output=progress_console.file,
    )
    if run.result is None:
        outcome = RayDemoOutcome(rollouts=int(request["rollouts"]), nodes=request["node_ids"])
        outcome.error, outcome.exit_code = run.failure(bound), EXIT_DIFFERS
        return outcome
    return RayDemoOutcome(**run.result)


def render(outcome: RayDemoOutcome, console: Console) -> None:
    """The table: each server's node before and after the loss; the rollouts; the seconds."""
    servers = Table(title="where each server ran", box=box.SIMPLE, title_justify="left")
    for column in ("server", "before", "after"):
        servers.add_column(column)
    for name in outcome.before:
        before = outcome.before[name]
        mark = " (lost)" if name in outcome.lost_servers else ""
        servers.add_row(name, before + mark, outcome.after.get(name, "-"))
    if outcome.before:
        console.print(servers)
    figures = Table(title="rollouts and seconds", box=box.SIMPLE, title_justify="left", show_header=False)
    figures.add_column("what")
    figures.add_column("value", justify="right")
    rows = [
        ("nodes", ", ".join(f"{name} {node[:8]}" for name, node in outcome.nodes.items())),
        ("killed", f"{outcome.killed} (raylet and every process on it)" if outcome.killed else "-"),
        ("rollouts", str(outcome.rollouts)),
        ("in flight at the checkpoint", str(outcome.in_flight)),
        ("finished before the loss", str(outcome.finished_before)),
        ("exported", str(outcome.exported)),
        ("continued", str(outcome.continued)),
        ("started over", str(outcome.started_over)),
        ("started after the restore", str(outcome.started_after_restore)),
        ("exported past their first turn", str(outcome.exported_past_first_turn)),
        ("records bytes", f"{sum(outcome.records_bytes.values()):,}"),
        ("lost", str(len(outcome.lost))),
        ("differing", str(len(outcome.differing))),
        ("placements after the loss", str(outcome.placements)),
        ("prepare s", f"{outcome.prepare_seconds:.3f}"),
        ("commit s", f"{outcome.commit_seconds:.3f}"),
        ("restore s", f"{outcome.restore_seconds:.3f}"),
        ("loss detected s", f"{outcome.detect_seconds:.2f}"),
        ("placed again and answering s", f"{outcome.placed_seconds:.2f}"),
        ("recovery s", f"{outcome.recovery_seconds:.2f}"),
        ("total s", f"{outcome.total_seconds:.1f}"),
    ]
    for what, value in rows:
        figures.add_row(what, value)
    console.print(figures)
    if outcome.exit_code == EXIT_OK:
        console.print("[green]ok[/]: every rollout has its result, each equal to the uninterrupted run's")
    else:
        console.print(f"[bold red]failed[/]: {escape(outcome.error or 'see above')}")


# --------------------------------------------------------------------------- the controller, in the namespace


async def _controller(request: dict[str, Any], outcome: RayDemoOutcome, progress: Progress) -> None:
    from gymckpt.stack.harness import RolloutHarness, default_stack_spec
    from gymckpt.stack.ray import RayStack

    timeout = float(request["timeout"])
    names_of = {node: name for name, node in request["node_ids"].items()}
    token = secrets.token_urlsafe(16)
    with _child_s3(BUCKET) as options:
        spec = default_stack_spec(
            token=token,
            storage_options=options,
            token_delay_seconds=float(request["token_delay_seconds"]),
            sizes=StateSizes(**request["sizes"]),
            **{name: int(limit) for name, limit in request.get("pool_limits", {}).items()},
        )
        root = f"s3://{BUCKET}/run"
        spec["ray"] = {
            "placement": "spread",
            "cpus_per_server": float(request["cpus"]) / 4,
            "checkpoint_dir": root,
            "log_dir": f"{request['base']}/servers",  # each server's config and log, with the cluster's files
            "resources": {
                "environment": {VICTIM: 0.01},
                "agent": {VICTIM: 0.01},
                "inference": {"head": 0.01},
            },
        }
        outcome.checkpoint_dir = f"{root}/ray-demo"
        progress(
            f"moto's S3 server at {options['endpoint_url']} (in the namespace); checkpoint into {outcome.checkpoint_dir}"
        )
        stack = RayStack(spec, address=request["address"])
        harness = RolloutHarness(stack, token, request_timeout=timeout)  # type: ignore[arg-type]
        try:
            await _phases(request, outcome, progress, stack, harness, names_of, options)
        finally:
            await harness.close()


_SERVE_S3 = """
import sys
from gymckpt.testing.moto import MotoEndpoint
endpoint = MotoEndpoint().start()
endpoint.create_bucket(sys.argv[1])
print(endpoint.url, flush=True)
sys.stdin.read()  # until the controller closes it (or exits)
endpoint.stop()
"""


@contextlib.contextmanager
def _child_s3(bucket: str) -> Iterator[dict[str, Any]]:
    """moto's S3 server in a child process (its own GIL: the rollouts do not slow it), ``bucket`` made; its options."""
    from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET

    server = subprocess.Popen([sys.executable, "-c", _SERVE_S3, bucket], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    try:
        url = server.stdout.readline().decode().strip()
        if not url.startswith("http://"):
            raise PhaseFailed(f"moto's S3 server did not start (exit {server.wait(30)})", EXIT_SETUP)
        yield {"endpoint_url": url, "key": DUMMY_KEY, "secret": DUMMY_SECRET, "region": "us-east-1"}
    finally:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _named(placed: dict[str, str], names_of: dict[str, str]) -> dict[str, str]:
    return {server: names_of.get(node, node[:8]) for server, node in placed.items()}


async def _phases(
    request: dict[str, Any],
    outcome: RayDemoOutcome,
    progress: Progress,
    stack: RayStack,
    harness: RolloutHarness,
    names_of: dict[str, str],
    storage_options: dict[str, Any],
) -> None:
    from gymckpt.control.coordination import runs_to_await
    from gymckpt.demo.launch import launch_rollouts, past_first_turn
    from gymckpt.demo.measure import read_stages
    from gymckpt.identity import capture_key, split_capture_key
    from gymckpt.stack.harness import task_for
    from gymckpt.stack.ray_recovery import recover
    from gymckpt.testing.raycluster import RayCluster

    timeout = float(request["timeout"])
    rollouts, first = int(request["rollouts"]), int(request["seed"]) * int(request["rollouts"])
    prompt_chars = int(request["sizes"]["prompt_chars"])
    tasks = {f"{first + i}-0": task_for(first + i, prompt_chars=prompt_chars) for i in range(rollouts)}
    placed = await asyncio.to_thread(stack.place)
    outcome.before = _named(placed, names_of)
    gym = await harness.wait_ready(timeout=timeout)
    progress("placed: " + ", ".join(f"{name} on {node}" for name, node in outcome.before.items()))

    began = time.perf_counter()
    async with asyncio.timeout(timeout):
        replies = await asyncio.gather(*(harness.run(f"ref-{key}", task) for key, task in tasks.items()))
    outcome.uninterrupted_seconds = time.perf_counter() - began
    reference = {key: result_of(reply) for key, reply in zip(tasks, replies, strict=True)}
    if any(result is None for result in reference.values()):
        raise PhaseFailed("the uninterrupted run failed for some rollouts", EXIT_SETUP)
    progress(f"uninterrupted run: {rollouts} rollouts in {outcome.uninterrupted_seconds:.1f} s")
    # the same backend serves both runs: the turn trigger must count only the second run's rollouts
    await harness.reset_model_calls()

    spawned: list[asyncio.Task[Any]] = []

    def spawn(coroutine: Any) -> asyncio.Task[Any]:
        spawned.append(asyncio.create_task(coroutine))
        return spawned[-1]

    async with asyncio.timeout(timeout):
        launch = await launch_rollouts(
            harness,
            tasks,
            spawn=spawn,
            median_rollout=outcome.uninterrupted_seconds / 2,
            checkpoint_after=float(request["checkpoint_after"]),
            trigger=TurnTrigger.of(request.get("checkpoint_turn")),
        )
    runs = launch.runs
    unlaunched = set(launch.unlaunched)
    in_flight = sorted(key for key, task in runs.items() if not task.done())
    outcome.in_flight = len(in_flight)
    cut = await harness.checkpoint(gym, "ray-demo", outcome.checkpoint_dir, in_flight, deadline_seconds=timeout)
    outcome.prepare_seconds, outcome.commit_seconds = cut.prepare_seconds, cut.commit_seconds
    environment = next(reply for reply in cut.commits.values() if reply.kind == "environment")
    exported = sorted(set(environment.episode_ids) & set(cut.scope))
    outcome.exported = len(exported)
    outcome.records_bytes = {
        f"{reply.kind}/{reply.instance}": reply.records_bytes or 0 for reply in cut.commits.values()
    }
    stages = await read_stages(outcome.checkpoint_dir, storage_options, exported, progress)
    outcome.exported_past_first_turn = past_first_turn(stages)
    progress(
        f"checkpoint with {len(in_flight)} rollouts in flight: prepare {cut.prepare_seconds:.3f} s, "
        f"commit {cut.commit_seconds:.3f} s, {len(exported)} exported ({outcome.exported_past_first_turn} past "
        f"their first turn), {sum(outcome.records_bytes.values()) / 1e6:.1f} MB of records"
        + (f"; {len(unlaunched)} not started yet, they start after the restore" if unlaunched else "")
    )
    waiting = runs_to_await(in_flight, committed=exported, restarts=cut.prepared.restarts())
    if pending := [runs[key] for key in waiting if not runs[key].done()]:
        await asyncio.wait(pending, timeout=ENDED_RUNS_SECONDS)
    finals: dict[str, dict[str, Any] | None] = {}
    for key, task in runs.items():
        if task.done() and key not in exported and not task.cancelled() and task.exception() is None:
            finals[key] = result_of(task.result())
    finals = {key: result for key, result in finals.items() if result is not None}
    outcome.finished_before = len(finals)
    over = sorted(key for key in tasks if key not in exported and key not in finals and key not in unlaunched)

    cluster = RayCluster(Path(request["base"]), workers=len(request["node_ids"]) - 1)
    cluster.cluster_id = request["cluster_id"]
    outcome.killed = VICTIM
    killed_at = time.perf_counter()
    await asyncio.to_thread(cluster.kill_node, VICTIM)
    progress(f"SIGKILL of {VICTIM}: its raylet and every process on it")
    outcome.lost_servers = await asyncio.to_thread(stack.wait_lost, timeout)
    outcome.detect_seconds = time.perf_counter() - killed_at
    progress(f"the launcher saw {', '.join(outcome.lost_servers)} lost after {outcome.detect_seconds:.2f} s")
    for task in spawned:
        task.cancel()
    await asyncio.gather(*spawned, return_exceptions=True)
    await gym.close()

    async def placed(attempt: int) -> None:
        outcome.placed_seconds = time.perf_counter() - killed_at

    recovery = await recover(
        stack,
        harness,
        "ray-demo",
        outcome.checkpoint_dir,
        exported,
        keep_resources=False,
        deadline_seconds=timeout,
        before_restore=placed,
    )
    outcome.recovery_seconds = time.perf_counter() - killed_at
    outcome.restore_seconds = recovery.restored.restore_seconds
    outcome.placements = len(recovery.placements)
    outcome.after = _named(recovery.placements[-1], names_of)
    gym = recovery.coordinator
    progress(
        f"placed again on the nodes left and restored in {outcome.recovery_seconds:.2f} s from the loss: "
        + ", ".join(f"{name} on {node}" for name, node in outcome.after.items())
    )
    try:
        if over:
            await gym.retire(over, checkpoint_id="ray-demo", deadline_ts=time.time() + timeout)

        async def next_attempt(key: str) -> dict[str, Any]:
            if key in unlaunched:  # never started before the loss: its first attempt
                return await harness.run(key, tasks[key])
            rollout, attempt = split_capture_key(key)
            return await harness.run(capture_key(rollout, attempt + 1), tasks[key])

        order = [*exported, *over, *sorted(unlaunched)]
        async with asyncio.timeout(timeout):
            replies = await asyncio.gather(*(next_attempt(key) for key in order))
    finally:
        await gym.close()
    results = {key: result_of(reply) for key, reply in zip(order, replies, strict=True)}
    outcome.continued = sum(results[key] is not None for key in exported)
    outcome.started_over = sum(results[key] is not None for key in over)
    outcome.started_after_restore = sum(results[key] is not None for key in unlaunched)
    finals.update(results)
    outcome.lost, outcome.differing = compare_results(reference, finals)
    progress(f"{outcome.continued} continued, {outcome.started_over} started over; compared with the uninterrupted run")
    if outcome.lost or outcome.differing:
        raise PhaseFailed(f"{len(outcome.lost)} rollouts lost, {len(outcome.differing)} different")


def controller_main(argv: list[str]) -> int:
    """``python -m gymckpt.demo.ray_demo REQUEST RESULT``: the controller, run in the cluster's namespace."""
    request_file, result_file = argv
    request = json.loads(Path(request_file).read_text())
    outcome = RayDemoOutcome(rollouts=int(request["rollouts"]), nodes=request["node_ids"])
    progress = Progress(Console(stderr=True, highlight=False, soft_wrap=True))
    try:
        asyncio.run(asyncio.wait_for(_controller(request, outcome, progress), 10 * float(request["timeout"])))
    except PhaseFailed as exc:
        outcome.error, outcome.exit_code = str(exc), exc.exit_code
    except BaseException as exc:  # one line in the table; the traceback here
        traceback.print_exc()
        outcome.error = " ".join(f"{type(exc).__name__}: {exc}".split())
        outcome.exit_code = EXIT_DIFFERS
    Path(result_file).write_text(json.dumps(asdict(outcome), indent=2, default=str))
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(controller_main(sys.argv[1:]))
