"""Scenario (b) of bench_scale on three Ray nodes: the sandbox server placed by the Ray launcher, its node lost.

:func:`run_ray_sessions` starts a Ray cluster on this machine
(:class:`~gymckpt.testing.raycluster.RayCluster`: a head and two worker raylets in a network
namespace it makes, only ``lo`` up) and runs the controller in that namespace
(``python -m benchmarks.ray_sessions REQUEST RESULT``, a Ray driver). The controller places
one ``sandbox`` server through :class:`~gymckpt.stack.ray.RayStack`, pinned to ``node1``, and
runs :class:`~benchmarks.scale_sessions.SessionsPhases`: the sessions are made over HTTP, the
checkpoint is taken through the control routes; then ``node1`` is SIGKILLed (its raylet and
every process on it), the launcher sees the server lost, places it again on a node left, and
the fresh process restores every session. Checkpoints go to a directory under the cluster's
base: the nodes share this machine's disk (a real cluster would give a shared filesystem or
S3). The server's memory is read through its process group leader's pid: the nodes are
processes of this machine.

Needs what ``gymckpt demo --ray`` needs (root, ``ip``, ``unshare``, the ray extra); without it
the run comes back not ok, saying what is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from benchmarks.scale_memory import PhaseMemory
from benchmarks.scale_sampling import participant_lines
from benchmarks.scale_sessions import SERVER, SessionsPhases, SessionsRun, sessions_spec

if TYPE_CHECKING:
    from gymckpt.stack.ray import RayStack

__all__ = ["run_ray_sessions"]

#: the worker node the sandbox server is placed on first, and the one killed
VICTIM = "node1"
#: the directory under the cluster's base where the checkpoints go
CHECKPOINTS = "sessions"


def run_ray_sessions(*, sessions: int, session_bytes: int, console: Console, timeout: float = 600.0) -> SessionsRun:
    """Scenario (b) on three Ray nodes (see the module); progress on ``console``; the figures."""
    from gymckpt.demo.ray_demo import unavailable

    run = SessionsRun(sessions=sessions, session_bytes=session_bytes, workers=1)
    why = unavailable()
    if why is not None:
        run.error = why
        return run
    from gymckpt.testing.raycluster import (
        RayCluster,
        RayClusterError,
        RayClusterUnavailable,
        Terminated,
        sigterm_unwinds,
    )

    base = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # short: Ray's Unix sockets live under it
    cpus = max(1, (os.cpu_count() or 1) // 3)
    cluster = RayCluster(base, workers=2, cpus=cpus)
    with sigterm_unwinds():  # SIGTERM too takes the cluster down
        try:
            try:
                cluster.start()
            except (RayClusterUnavailable, RayClusterError) as exc:
                run.error = " ".join(f"the Ray cluster did not start: {exc}".split())
                return run
            nodes = cluster.node_ids()
            console.print(
                f"[b]scenario b on Ray[/]: three nodes in namespace {cluster.namespace} "
                + ", ".join(f"{name} {node[:8]}" for name, node in nodes.items()),
                highlight=False,
            )
            request = {
                "address": cluster.address,
                "base": str(base),
                "cluster_id": cluster.cluster_id,
                "node_ids": nodes,
                "sessions": sessions,
                "session_bytes": session_bytes,
                "timeout": timeout,
                "cpus": cpus,
            }
            return _run_controller(cluster, request, base, timeout)
        except Terminated:
            run.error = "stopped by SIGTERM; the Ray cluster was taken down"
            return run
        finally:
            left = cluster.close()
            shutil.rmtree(base, ignore_errors=True)
            if left:
                console.print(f"[red]left behind: {', '.join(left)}[/]", highlight=False)


def _run_controller(cluster: Any, request: dict[str, Any], base: Path, timeout: float) -> SessionsRun:
    bound = 4 * timeout
    # its output, Ray's own lines about the node it loses among it, is progress: stderr, as the demo's
    run = cluster.run_driver(
        sys.executable, "-m", "benchmarks.ray_sessions", request=request, base=base, bound=bound, output=sys.stderr
    )
    if run.result is None:
        lost = SessionsRun(sessions=int(request["sessions"]), session_bytes=int(request["session_bytes"]), workers=1)
        lost.error = run.failure(bound)
        return lost
    return _from_json(run.result)


def _from_json(data: dict[str, Any]) -> SessionsRun:
    memory = {
        phase: {name: PhaseMemory(**figures) for name, figures in servers.items()}
        for phase, servers in data.pop("memory", {}).items()
    }
    for servers in memory.values():
        for figures in servers.values():  # JSON keys are strings: the pids were ints
            figures.by_process = {int(pid): marks for pid, marks in figures.by_process.items()}
    return SessionsRun(**data, memory=memory)


# --------------------------------------------------------------------------- the controller, in the namespace


def _stack(request: dict[str, Any], token: str, workdir: Path) -> RayStack:
    from gymckpt.stack.ray import RayStack

    spec = sessions_spec(token, workdir, session_bytes=int(request["session_bytes"]), workers=1)
    spec["ray"] = {
        "cpus_per_server": float(request["cpus"]) / 2,
        "resources": {SERVER: {VICTIM: 0.01}},
        "log_dir": f"{request['base']}/servers",
    }
    return RayStack(spec, address=request["address"])


async def _controller(request: dict[str, Any], run: SessionsRun, console: Console) -> None:
    from gymckpt.testing.raycluster import RayCluster

    timeout = float(request["timeout"])
    names_of = {node: name for name, node in request["node_ids"].items()}
    token = secrets.token_urlsafe(16)
    workdir = Path(request["base"]) / CHECKPOINTS
    workdir.mkdir(parents=True, exist_ok=True)
    stack = _stack(request, token, workdir)
    cluster = RayCluster(Path(request["base"]), workers=len(request["node_ids"]) - 1)
    cluster.cluster_id = request["cluster_id"]

    def start() -> None:
        placed = stack.place()
        run.nodes.append(names_of.get(placed[SERVER], placed[SERVER][:8]))
        console.print(f"placed: {SERVER} on {run.nodes[-1]}", highlight=False)

    logs = []

    def crash() -> str:
        logs.append(stack.servers[SERVER].log_path)  # the commit's lines: the node's files stay when it dies
        cluster.kill_node(VICTIM)
        lost = stack.wait_lost(timeout)
        if SERVER not in lost:
            raise RuntimeError(f"the launcher did not see the {SERVER} server lost with {VICTIM} (lost: {lost})")
        placed = stack.replace(keep_resources=False)
        run.nodes.append(names_of.get(placed[SERVER], placed[SERVER][:8]))
        return (
            f"SIGKILL of {VICTIM}, the {SERVER} server lost with it; placed again on {run.nodes[-1]}, "
            "a fresh process restores"
        )

    try:
        await SessionsPhases(run, stack, token, workdir, console, timeout, start=start, crash=crash).run()
    finally:
        run.participant_lines = participant_lines(
            [log for log in [*logs, stack.servers[SERVER].log_path] if log.is_file()]
        )
        await asyncio.to_thread(stack.close)


def controller_main(argv: list[str]) -> int:
    """``python -m benchmarks.ray_sessions REQUEST RESULT``: the controller, run in the cluster's namespace."""
    request_file, result_file = argv
    request = json.loads(Path(request_file).read_text())
    run = SessionsRun(sessions=int(request["sessions"]), session_bytes=int(request["session_bytes"]), workers=1)
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    began = time.perf_counter()
    try:
        asyncio.run(asyncio.wait_for(_controller(request, run, console), 3 * float(request["timeout"])))
    except BaseException as exc:  # one line in the table; the traceback here
        traceback.print_exc()
        run.error = " ".join(f"{type(exc).__name__}: {exc}".split())
    run.ok = not run.error and not run.lost and not run.differing
    console.print(f"controller done in {time.perf_counter() - began:.1f} s", highlight=False)
    Path(result_file).write_text(json.dumps(asdict(run), indent=2))
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(controller_main(sys.argv[1:]))
