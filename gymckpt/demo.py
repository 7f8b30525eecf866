"""``gymckpt demo`` (D2): checkpoint in-flight rollouts, kill every server, restore, continue, verify.

The full demo (``run_demo``; ``make demo``):

1. An uninterrupted run: the reference stack (gymckpt.servers.harness) as real processes on
   loopback, every rollout's task run to its result once, without a checkpoint; then that
   stack is closed. Its results are what the interrupted run must reproduce (the reference
   stack is deterministic: the same task gives the same reward and response).
2. A fresh stack runs the same tasks. Rollouts are started one after the other over a
   window as long as the uninterrupted run's median rollout, so at the checkpoint the ones
   still running stand at different turns. The checkpoint is taken, event-driven, as soon
   as half of them have finished (``asyncio.wait(FIRST_COMPLETED)`` in a loop, bounded):
   prepare, commit of every rollout still in flight (restarts left out), publish.
3. ``/run`` calls the environment ended before its export (their replies were on the wire)
   are awaited (K6); then every Gym server's process group is SIGKILLed (the inference
   backend survives), fresh processes start on the same ports, the checkpoint is restored,
   every participant resumes, and each exported rollout's next attempt (``r-a1``) is run
   to its result. A rollout that could not be captured starts over from its input.
4. Every result is compared with the uninterrupted run's, the checkpoint is verified
   offline, and a table is printed. Exit status: 0 success, 1 a rollout lost, a result
   different or a damaged checkpoint (or a phase failing after the rollouts started),
   2 a setup failure (stack, store, embedded endpoint).

``--store s3`` runs the same demo against an S3 endpoint served by moto inside the demo
process: every Gym server gets its endpoint and credentials through the checkpoint
block's ``storage_options``, and the coordinator and ``verify`` get them too.

``--store-only`` is the earlier demo of the store alone: generated records of four
participants written, published, verified and one scope restored, without servers.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from gymckpt.control.coordination import Coordinator, runs_to_await
from gymckpt.control.marks import capture_key, split_capture_key
from gymckpt.demo_report import (
    EXIT_DIFFERS,
    EXIT_OK,
    EXIT_SETUP,
    DemoOutcome,
    Progress,
    compare_results,
    count_stages,
    mean_reward,
    render,
    result_of,
    stage_label,
    stage_summary,
)
from gymckpt.servers.harness import RolloutHarness, default_stack_spec, task_for
from gymckpt.servers.stack import load_stack
from gymckpt.store import open_store, verify
from gymckpt.store.checkpoint_store import backend_for_url

if TYPE_CHECKING:
    from collections.abc import Coroutine, Iterator

    from rich.console import Console

    from gymckpt.control.models import CommitReply

__all__ = ["DEMO_BUCKET", "run_demo", "run_s3_demo", "run_s3_store_demo", "run_store_demo"]

T = TypeVar("T")

#: the bucket ``gymckpt demo --store s3`` creates on its embedded endpoint
DEMO_BUCKET = "gymckpt-demo"
#: the bounds of the launch window (seconds), whatever the uninterrupted run measured
_LAUNCH_WINDOW_BOUNDS = (0.2, 5.0)
#: how long the ``/run`` calls the environment ended before its export may take to reply
_ENDED_RUNS_SECONDS = 10.0


class _Failed(Exception):
    """A phase failed: the message, and the exit code it gives."""

    def __init__(self, message: str, exit_code: int = EXIT_DIFFERS) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_demo(
    *,
    rollouts: int = 64,
    store_url: str = "./checkpoints",
    keep: bool = False,
    seed: int = 0,
    console: Console,
    progress_console: Console | None = None,
    storage_options: dict[str, Any] | None = None,
    embedded_endpoint: str = "",
    timeout: float = 120.0,
    logs_dir: Path | None = None,
) -> DemoOutcome:
    """Run the full demo; print progress on ``progress_console`` (default ``console``) and the table.

    ``seed`` chooses the tasks: ``task_for(seed * rollouts + i)`` for ``i < rollouts``.
    ``timeout`` bounds every phase (stack start, each batch of rollouts, each control call).
    The servers' configs and logs go to a new directory under ``logs_dir`` (the system's
    temporary directory by default), kept only when the demo fails or ``keep`` is set.
    The returned outcome's ``exit_code`` is the process exit status.
    """
    if rollouts < 1:
        raise ValueError("the demo needs at least one rollout")
    demo = _Demo(
        rollouts=rollouts,
        store_url=store_url,
        keep=keep,
        seed=seed,
        progress=Progress(progress_console or console),
        storage_options=dict(storage_options or {}),
        embedded_endpoint=embedded_endpoint,
        timeout=timeout,
        logs_dir=logs_dir,
    )
    asyncio.run(demo.run())
    render(demo.outcome, console)
    if demo.outcome.kept_urls:
        _print_kept(demo.outcome, demo.kept_pids, demo.token, console)
    return demo.outcome


def run_s3_demo(
    *,
    rollouts: int = 64,
    keep: bool = False,
    seed: int = 0,
    console: Console,
    progress_console: Console | None = None,
    timeout: float = 120.0,
    logs_dir: Path | None = None,
) -> DemoOutcome:
    """The full demo with the checkpoint on an S3 endpoint served by moto in this process.

    Starts moto's server on 127.0.0.1 and a free port, creates a bucket, and runs the demo
    against ``s3://gymckpt-demo/checkpoints`` with the endpoint and dummy credentials in
    every Gym server's ``storage_options``; the endpoint stops when the demo ends.
    """
    from gymckpt.store.moto_endpoint import MotoEndpoint

    store_url = f"s3://{DEMO_BUCKET}/checkpoints"
    try:
        endpoint = MotoEndpoint().start()
        endpoint.create_bucket(DEMO_BUCKET)
    except Exception as exc:  # moto missing, no port, bucket refused: the demo cannot start
        outcome = DemoOutcome(rollouts=rollouts, store_url=store_url)
        outcome.error = f"the embedded S3 endpoint did not start: {exc}"
        outcome.exit_code = EXIT_SETUP
        render(outcome, console)
        return outcome
    try:
        (progress_console or console).print(
            f"embedded S3 endpoint (moto) at {endpoint.url}, bucket {DEMO_BUCKET}", highlight=False
        )
        return run_demo(
            rollouts=rollouts,
            store_url=store_url,
            keep=keep,
            seed=seed,
            console=console,
            progress_console=progress_console,
            storage_options=endpoint.storage_options(),
            embedded_endpoint=endpoint.url,
            timeout=timeout,
            logs_dir=logs_dir,
        )
    finally:
        endpoint.stop()


class _Demo:
    """One run of the demo: both stacks, the controller's side, and what it measured."""

    def __init__(
        self,
        *,
        rollouts: int,
        store_url: str,
        keep: bool,
        seed: int,
        progress: Progress,
        storage_options: dict[str, Any],
        embedded_endpoint: str,
        timeout: float,
        logs_dir: Path | None,
    ) -> None:
        self.progress = progress
        self.keep = keep
        self.timeout = timeout
        self.storage_options = storage_options
        self.store_url = store_url
        self.token = secrets.token_urlsafe(16)
        self.outcome = DemoOutcome(rollouts=rollouts, store_url=store_url, embedded_endpoint=embedded_endpoint)
        first = seed * rollouts
        #: rollout id ("<task index>-0") → task
        self.tasks = {f"{first + i}-0": task_for(first + i) for i in range(rollouts)}
        self._logs_parent = logs_dir
        #: the stacks' configs and logs, made with the first stack; removed after a clean run
        self.workdir: Path | None = None
        self.harnesses: list[RolloutHarness] = []
        self.coordinators: list[Coordinator] = []
        self.kept_pids: dict[str, int] = {}
        #: the uninterrupted run's median rollout duration: the launch window of the interrupted run
        self.median_rollout = 1.0
        self._session: aiohttp.ClientSession | None = None
        #: every task the demo started: cancelled at cleanup, so none outlives it (an interrupt included)
        self._spawned: set[asyncio.Task[Any]] = set()

    # --- the run

    async def run(self) -> None:
        began = time.perf_counter()
        try:
            await self._phases()
        except _Failed as exc:
            self.outcome.error = str(exc)
            self.outcome.exit_code = exc.exit_code
        except Exception as exc:  # a bug, or something no phase expected: report it, still clean up
            self.progress.console.print_exception()
            self.outcome.error = f"{type(exc).__name__}: {exc}"
            self.outcome.exit_code = EXIT_DIFFERS
        finally:
            await self._cleanup()
            self.outcome.total_seconds = time.perf_counter() - began

    async def _phases(self) -> None:
        outcome = self.outcome
        self._choose_checkpoint_dir()
        self.progress(
            f"[bold]gymckpt demo[/]: {_n(outcome.rollouts, 'rollout')}, checkpoint into {escape(outcome.checkpoint_dir)}"
        )
        reference = await self._uninterrupted_run()

        began = time.perf_counter()
        demo = await self._start_stack("demo", storage_options=self.storage_options)
        gym = await self._wait_up(demo, "demo")
        self.progress(
            f"a fresh stack answers after {time.perf_counter() - began:.1f} s: "
            + escape(", ".join(f"{name} {url}" for name, url in demo.urls.items()))
        )
        runs = await self._launch_until_half_finished(demo)
        in_flight = sorted(key for key, task in runs.items() if not task.done())
        exported = await self._checkpoint(demo, gym, in_flight)
        await self._await_ended_runs(runs, in_flight, exported)

        # a rollout whose /run returned a failure before the crash has no result: it is lost
        finals: dict[str, dict[str, Any] | None] = {}
        for key, task in runs.items():
            if task.done() and key not in exported:
                result = result_of(_outcome_of(task))
                if result is not None:
                    finals[key] = result
                    outcome.finished_before.append(key)
        outcome.finished_before.sort()
        to_restart = sorted(key for key, task in runs.items() if not task.done() and key not in exported)

        gym = await self._crash_and_restart(demo, gym, runs)
        calls_before = await self._model_calls(demo)
        await self._restore(gym, exported)
        finals.update(await self._continue(demo, gym, exported, to_restart))
        calls_after = await self._model_calls(demo)
        self._count_redone_model_calls(calls_before, calls_after, exported)

        outcome.lost, outcome.differing = compare_results(reference, finals)
        outcome.mean_reward = mean_reward(finals.values())
        if outcome.lost or outcome.differing:
            self.progress(
                f"[bold red]{_n(len(outcome.lost), 'rollout')} lost, {_differ(len(outcome.differing))}[/] "
                "from the uninterrupted run"
            )
        else:
            self.progress(
                f"every rollout has its result, each equal to the uninterrupted run's "
                f"(mean reward {outcome.mean_reward:.3f})"
            )
        await self._verify()
        if self.keep:
            self._keep(demo)
        problems = []
        if outcome.lost:
            problems.append(f"{_n(len(outcome.lost), 'rollout')} lost")
        if outcome.differing:
            problems.append(f"{_differ(len(outcome.differing))} from the uninterrupted run")
        if not outcome.verified:
            problems.append("the checkpoint did not verify")
        if problems:
            raise _Failed("; ".join(problems))

    # --- phases

    def _allowed_roots(self) -> list[str]:
        """The store root: the servers may write checkpoints there and nowhere else."""
        url = self.store_url
        return [url.rstrip("/")] if "://" in url else [str(Path(url).expanduser().resolve())]

    def _choose_checkpoint_dir(self) -> None:
        """A new checkpoint directory under the store root; a root that cannot hold one is a setup failure."""
        name = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        self.outcome.checkpoint_id = name
        url = self.store_url
        if "://" in url:
            self.outcome.checkpoint_dir = f"{url.rstrip('/')}/{name}"
        else:
            root = Path(url).expanduser().resolve()
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _Failed(f"cannot create the store root {root}: {exc}", EXIT_SETUP) from exc
            if not os.access(root, os.W_OK | os.X_OK):
                raise _Failed(f"the store root {root} is not writable", EXIT_SETUP)
            self.outcome.checkpoint_dir = str(root / name)
        try:
            backend = backend_for_url(self.outcome.checkpoint_dir, **self.storage_options)
            try:
                backend.exists("gym")
            finally:
                backend.close()
        except Exception as exc:
            raise _Failed(f"cannot reach the store {self.outcome.checkpoint_dir}: {exc}", EXIT_SETUP) from exc

    async def _uninterrupted_run(self) -> dict[str, dict[str, Any] | None]:
        """Every task once on a fresh stack without a checkpoint: the results to reproduce."""
        began = time.perf_counter()
        stack = await self._start_stack("uninterrupted")
        await self._wait_up(stack, "uninterrupted")
        self.progress(f"uninterrupted run: the reference stack answers after {time.perf_counter() - began:.1f} s")
        url = stack.urls["environment"]
        durations: dict[str, float] = {}

        async def timed(key: str) -> dict[str, Any]:
            began = time.perf_counter()
            reply = await self._run(url, key, self.tasks[key])
            durations[key] = time.perf_counter() - began
            return reply

        began = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                replies = await asyncio.gather(*(timed(key) for key in self.tasks))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _Failed(f"the uninterrupted run failed: {exc!r}{self._log_tails(stack)}", EXIT_SETUP) from exc
        self.outcome.uninterrupted_seconds = time.perf_counter() - began
        reference = {key: result_of(reply) for key, reply in zip(self.tasks, replies, strict=True)}
        failed = [key for key, result in reference.items() if result is None]
        if failed:
            example = replies[list(self.tasks).index(failed[0])]
            raise _Failed(
                f"the uninterrupted run failed for {len(failed)} rollouts, e.g. {failed[0]}: {example}", EXIT_SETUP
            )
        self.outcome.reference_mean_reward = mean_reward(reference.values())
        self.median_rollout = statistics.median(durations.values())
        self.progress(
            f"uninterrupted run: {_n(len(reference), 'rollout')} at once in {self.outcome.uninterrupted_seconds:.1f} s "
            f"(median rollout {self.median_rollout:.2f} s), mean reward {self.outcome.reference_mean_reward:.3f}; "
            "stack closed"
        )
        await self._close_stack(stack)
        return reference

    async def _launch_until_half_finished(self, stack: RolloutHarness) -> dict[str, asyncio.Task[dict[str, Any]]]:
        """Start every rollout, then wait until half of them have finished.

        The first half starts at once; the second half one by one over the uninterrupted
        run's median rollout, and whatever is left when the first rollout finishes starts
        then. So every rollout is running just before the first ones finish, and when half
        have finished the others stand anywhere from their first turn to their last.
        """
        low, high = _LAUNCH_WINDOW_BOUNDS
        window = min(max(self.median_rollout, low), high)
        at_once = (len(self.tasks) + 1) // 2
        interval = window / max(len(self.tasks) - at_once, 1)
        url = stack.urls["environment"]
        runs: dict[str, asyncio.Task[dict[str, Any]]] = {}
        running = 0
        first_finished = asyncio.Event()

        def finished(_: object) -> None:
            nonlocal running
            running -= 1
            first_finished.set()

        began = time.perf_counter()
        target = len(self.tasks) // 2
        try:
            async with asyncio.timeout(self.timeout):
                for index, key in enumerate(self.tasks):
                    # paced against the clock, so a slow loop does not stretch the window
                    delay = began + max(index - at_once + 1, 0) * interval - time.perf_counter()
                    if delay > 0 and not first_finished.is_set():
                        try:
                            await asyncio.wait_for(first_finished.wait(), delay)
                        except TimeoutError:
                            pass
                    runs[key] = self._spawn(self._run(url, key, self.tasks[key]))
                    running += 1
                    runs[key].add_done_callback(finished)
                    self.outcome.peak_in_flight = max(self.outcome.peak_in_flight, running)
                self.outcome.launch_seconds = time.perf_counter() - began
                while sum(task.done() for task in runs.values()) < target:
                    pending = [task for task in runs.values() if not task.done()]
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError as exc:
            done = sum(task.done() for task in runs.values())
            raise _Failed(
                f"only {done} of {len(self.tasks)} rollouts finished within {self.timeout:.0f} s{self._log_tails(stack)}"
            ) from exc
        done = sum(task.done() for task in runs.values())
        self.progress(
            f"started {_n(len(runs), 'rollout')} over {self.outcome.launch_seconds:.2f} s "
            f"(up to {self.outcome.peak_in_flight} at once); {done} finished, {len(runs) - done} in flight: checkpoint"
        )
        return runs

    async def _checkpoint(self, stack: RolloutHarness, gym: Coordinator, in_flight: list[str]) -> list[str]:
        """Prepare, commit the in-flight rollouts, publish; return the rollouts the environment exported."""
        outcome = self.outcome
        try:
            done = await stack.checkpoint(
                gym, outcome.checkpoint_id, outcome.checkpoint_dir, in_flight, deadline_seconds=self.timeout
            )
        except Exception as exc:
            raise _Failed(f"the checkpoint failed: {exc}{self._log_tails(stack)}") from exc
        outcome.prepare_seconds, outcome.commit_seconds = done.prepare_seconds, done.commit_seconds
        outcome.restarts_reported = sorted(done.prepared.restarts())
        environment: CommitReply | None = None
        for reply in done.commits.values():
            _, kind, instance, _ = reply.manifest.rsplit("/", 3)
            outcome.bytes_by_participant[f"{kind}/{instance}"] = reply.records_bytes
            outcome.records_by_participant[f"{kind}/{instance}"] = reply.record_count
            if kind == "environment":
                environment = reply
        if environment is None:
            raise _Failed("no environment participant committed")
        exported = sorted(set(environment.episode_ids) & set(done.scope))
        outcome.exported = exported
        parts = " · ".join(f"{name} {size:,}" for name, size in sorted(outcome.bytes_by_participant.items()))
        self.progress(
            f"checkpoint {outcome.checkpoint_id}: prepare {done.prepare_seconds:.3f} s "
            f"({len(outcome.restarts_reported)} restarts), commit {done.commit_seconds:.3f} s of "
            f"{_n(len(done.scope), 'rollout')}: {_n(outcome.records_written, 'record')}, {outcome.bytes_written:,} bytes "
            f"({parts}); gym/checkpoint.json published"
        )
        outcome.stages = await self._stages(exported)
        if outcome.stages:
            self.progress(f"where the exported {_n(len(exported), 'rollout')} stood: {stage_summary(outcome.stages)}")
        return exported

    async def _await_ended_runs(
        self, runs: dict[str, asyncio.Task[dict[str, Any]]], in_flight: list[str], exported: list[str]
    ) -> None:
        """K6: wait for the ``/run`` calls in flight that were neither exported nor restarts.

        The environment ended them before its export: their replies are on the wire. One
        that does not come (it reached the environment after the export) starts over
        after the crash, as a restart does.
        """
        waiting = runs_to_await(in_flight, committed=exported, restarts=self.outcome.restarts_reported)
        tasks = [runs[key] for key in waiting if not runs[key].done()]
        if tasks:
            await asyncio.wait(tasks, timeout=_ENDED_RUNS_SECONDS)
        late = [key for key in waiting if not runs[key].done()]
        self.outcome.uncaptured = late
        if waiting:
            self.progress(
                f"{_n(len(waiting) - len(late), 'rollout')} ended before the export and returned"
                + (f"; {len(late)} reached the environment after it and will start over" if late else "")
            )

    async def _crash_and_restart(
        self, stack: RolloutHarness, gym: Coordinator, runs: dict[str, asyncio.Task[dict[str, Any]]]
    ) -> Coordinator:
        """SIGKILL every Gym server's process group, start fresh ones, wait until they answer."""
        began = time.perf_counter()
        await asyncio.to_thread(stack.crash)
        for task in runs.values():
            task.cancel()
        await asyncio.gather(*runs.values(), return_exceptions=True)
        await gym.close()
        self.progress(
            f"SIGKILL of every Gym server's process group ({', '.join(stack.gym_servers)}); "
            "the inference backend keeps running"
        )
        stack.restart()  # in the loop's thread: an interrupt cannot leave processes nobody kills
        self._note_pids(stack)
        fresh = await self._wait_up(stack, "demo (restarted)")
        self.outcome.restart_seconds = time.perf_counter() - began
        self.progress(f"fresh processes on the same ports answer after {self.outcome.restart_seconds:.2f} s")
        return fresh

    async def _restore(self, gym: Coordinator, exported: list[str]) -> None:
        outcome = self.outcome
        began = time.perf_counter()
        try:
            if exported:
                replies = await gym.restore(
                    outcome.checkpoint_id, time.time() + self.timeout, outcome.checkpoint_dir, exported
                )
            else:
                replies = {}
            outcome.restore_seconds = time.perf_counter() - began
            await gym.resume(outcome.checkpoint_id, time.time() + self.timeout)
        except Exception as exc:
            raise _Failed(f"the restore failed: {exc}") from exc
        expected = {capture_key(key, 1) for key in exported}
        for url, reply in replies.items():
            if gym.kinds[url].kind == "environment" and set(reply.restored) != expected:
                missing = sorted(expected - set(reply.restored))
                raise _Failed(f"the environment restored {len(reply.restored)} of {len(expected)} rollouts: {missing}")
        self.progress(
            f"restored {_n(len(exported), 'rollout')} in {outcome.restore_seconds:.3f} s "
            "(installed under attempt 1), every participant resumed"
            if exported
            else "nothing exported to restore; every participant resumed"
        )

    async def _continue(
        self, stack: RolloutHarness, gym: Coordinator, exported: list[str], to_restart: list[str]
    ) -> dict[str, dict[str, Any] | None]:
        """Run each exported rollout's next attempt, and start the others over; forget them all after."""
        outcome = self.outcome
        checkpoint_id = outcome.checkpoint_id
        if to_restart:
            try:
                await gym.retire(to_restart, checkpoint_id=checkpoint_id, deadline_ts=time.time() + self.timeout)
            except Exception as exc:
                raise _Failed(f"retiring the old attempts of the restarted rollouts failed: {exc}") from exc
        url = stack.urls["environment"]
        order = [*exported, *to_restart]

        async def next_attempt(key: str) -> dict[str, Any]:
            rollout, attempt = split_capture_key(key)
            return await self._run(url, capture_key(rollout, attempt + 1), self.tasks[key])

        began = time.perf_counter()
        attempts = {key: self._spawn(next_attempt(key)) for key in order}
        if attempts:
            await asyncio.wait(attempts.values(), timeout=self.timeout)
        outcome.continue_seconds = time.perf_counter() - began
        replies = [_outcome_of(attempts[key]) for key in order]
        results = {key: result_of(reply) for key, reply in zip(order, replies, strict=True)}
        outcome.continued = sorted(key for key in exported if results[key] is not None)
        outcome.restarted = sorted(key for key in to_restart if results[key] is not None)
        if order:
            try:
                await gym.forget(order, checkpoint_id=checkpoint_id, deadline_ts=time.time() + self.timeout)
            except Exception as exc:
                raise _Failed(f"forgetting the finished rollouts failed: {exc}") from exc
        failed = [key for key in order if results[key] is None]
        self.progress(
            f"continued {_n(len(outcome.continued), 'rollout')} from their boundaries and started "
            f"{len(outcome.restarted)} over, in {outcome.continue_seconds:.2f} s"
            + (
                f"; [red]{len(failed)} without a result[/], e.g. {escape(failed[0])}: {escape(_reply_of(replies, order, failed[0]))}"
                if failed
                else ""
            )
        )
        return results

    async def _verify(self) -> None:
        began = time.perf_counter()
        try:
            report = await asyncio.to_thread(verify, self.outcome.checkpoint_dir, **self.storage_options)
        except Exception as exc:
            raise _Failed(f"verify could not read the checkpoint: {exc}") from exc
        self.outcome.verify_seconds = time.perf_counter() - began
        self.outcome.verify_report = report
        self.progress(
            f"verify {escape(self.outcome.checkpoint_dir)}: {'OK' if report.ok else '[red]DAMAGED[/]'} "
            f"({len(report.errors)} errors, {len(report.warnings)} warnings, "
            f"{report.records_checked} records re-hashed in {self.outcome.verify_seconds:.3f} s)"
        )

    def _keep(self, stack: RolloutHarness) -> None:
        """Leave the demo stack running (``--keep``): its URLs and process groups for the report."""
        self.outcome.kept_urls = dict(stack.urls)
        self.kept_pids = {
            name: server.process.pid for name, server in stack.stack.servers.items() if server.process is not None
        }
        self.harnesses.remove(stack)  # not closed by _cleanup

    # --- helpers

    async def _start_stack(self, label: str, storage_options: dict[str, Any] | None = None) -> RolloutHarness:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="gymckpt-demo-", dir=self._logs_parent))
            self.outcome.logs_dir = str(self.workdir)
        workdir = self.workdir / label
        workdir.mkdir(parents=True, exist_ok=True)
        spec = default_stack_spec(
            token=self.token, storage_options=storage_options or None, allowed_roots=self._allowed_roots()
        )
        try:
            # the servers' modules are imported here (slow): off the loop, but no process starts there
            loaded = await asyncio.to_thread(load_stack, spec, workdir=workdir)
            stack = RolloutHarness(loaded, self.token)
            self.harnesses.append(stack)
            loaded.start()
        except Exception as exc:
            raise _Failed(f"the {label} stack did not start: {exc}", EXIT_SETUP) from exc
        self._note_pids(stack)
        return stack

    def _note_pids(self, stack: RolloutHarness) -> None:
        for server in stack.stack.servers.values():
            if server.process is not None and server.process.pid not in self.outcome.server_pids:
                self.outcome.server_pids.append(server.process.pid)

    async def _wait_up(self, stack: RolloutHarness, label: str) -> Coordinator:
        """Discover every Gym server (and reach the inference backend), watching for processes that exit."""
        options = stack.stack.servers["environment"].config.get("checkpoint", {}).get("storage_options")
        gym = Coordinator(
            [stack.urls[name] for name in stack.gym_servers],
            token=stack.token,
            storage_options=options,
            probe_timeout=self.timeout,
        )
        self.coordinators.append(gym)
        exit_code = EXIT_SETUP if label != "demo (restarted)" else EXIT_DIFFERS

        async def up() -> Any:
            found = await gym.discover()
            if found.ok:
                async with self._client().get(f"{stack.urls['inference']}/calls") as response:
                    await response.read()
            return found

        probe = self._spawn(up())
        deadline = time.monotonic() + self.timeout
        while not probe.done():
            dead = [name for name, server in stack.stack.servers.items() if not server.alive]
            if dead or time.monotonic() > deadline:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)
                why = f"{', '.join(dead)} exited" if dead else f"no answer within {self.timeout:.0f} s"
                raise _Failed(f"the {label} stack did not come up: {why}{self._log_tails(stack, dead)}", exit_code)
            await asyncio.wait({probe}, timeout=0.1)
        try:
            found = probe.result()
        except Exception as exc:
            raise _Failed(f"the {label} stack did not come up: {exc}{self._log_tails(stack)}", exit_code) from exc
        if not found.ok:
            raise _Failed(f"the {label} stack did not come up: {found.problems}{self._log_tails(stack)}", exit_code)
        return gym

    def _client(self) -> aiohttp.ClientSession:
        # a pool without a limit: aiohttp's default of 100 connections would hold back /run calls
        # beyond the 100th in the client, so they would reach the environment only after the checkpoint
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout)
            )
        return self._session

    async def _run(self, url: str, key: str, task: dict[str, Any]) -> dict[str, Any]:
        """One ``/run`` of the environment server: the reply body, with its HTTP status."""
        async with self._client().post(f"{url}/run", json={"episode_id": key, "task": task}) as response:
            body = await response.json(content_type=None)
            if not isinstance(body, dict):
                body = {"body": body}
            body.setdefault("status", response.status)
            return body

    async def _model_calls(self, stack: RolloutHarness) -> list[dict[str, Any]]:
        try:
            async with self._client().get(f"{stack.urls['inference']}/calls") as response:
                calls = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            return []
        return calls if isinstance(calls, list) else []

    def _count_redone_model_calls(
        self, before: list[dict[str, Any]], after: list[dict[str, Any]], exported: list[str]
    ) -> None:
        """Model calls of exported rollouts completed before the crash and made again after the restore.

        A call id is ``"<capture key>:<tool results so far>"``; the replacement attempt's
        call for the same turn has the same rollout and count.
        """
        wanted = set(exported)

        def turn(call: dict[str, Any]) -> tuple[str, str] | None:
            key, _, count = str(call.get("call_id", "")).rpartition(":")
            if not key:
                return None
            rollout, _ = split_capture_key(key)
            return (rollout, count) if rollout in wanted else None

        earlier = {turn(call) for call in before} - {None}
        self.outcome.model_calls_before_crash = sum(1 for call in before if turn(call) is not None)
        self.outcome.model_calls_redone = sum(1 for call in after[len(before) :] if turn(call) in earlier)

    async def _stages(self, exported: list[str]) -> dict[str, int]:
        """Where each exported rollout stood, from its environment and agent records (best effort)."""
        if not exported:
            return {}

        def read() -> dict[str, int]:
            store = open_store(self.outcome.checkpoint_dir, **self.storage_options)
            try:
                index = store.read_index("")
                records: dict[str, dict[str, dict[str, Any]]] = {}
                for entry in index.participants:
                    if entry.kind in ("environment", "agent"):
                        rows = store.read_participant("", kind=entry.kind, instance=entry.instance, scope=exported)
                        records[entry.kind] = {row["episode_id"]: row for row in rows}
            finally:
                store.close()
            environment, agent = records.get("environment", {}), records.get("agent", {})
            return count_stages(stage_label(environment.get(key), agent.get(key)) for key in exported)

        try:
            return await asyncio.to_thread(read)
        except Exception:  # only a breakdown for the progress line: never fail the demo on it
            return {}

    def _log_tails(self, stack: RolloutHarness, names: list[str] | None = None, lines: int = 12) -> str:
        tails = []
        for name in names or list(stack.stack.servers):
            try:
                text = stack.stack.servers[name].log_path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if text and (names or any("Error" in line or "Traceback" in line for line in text)):
                tails.append(f"\n--- {name} log (last {lines} lines):\n" + "\n".join(text[-lines:]))
        return "".join(tails)

    async def _close_stack(self, stack: RolloutHarness) -> None:
        if stack in self.harnesses:
            self.harnesses.remove(stack)
        await stack.close()

    def _spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coroutine)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    async def _cleanup(self) -> None:
        pending = [task for task in self._spawned if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for gym in self.coordinators:
            await gym.close()
        for stack in list(self.harnesses):
            try:
                await self._close_stack(stack)
            except Exception:  # keep closing the others
                pass
        if self._session is not None:
            await self._session.close()
        if self.workdir is not None and self.outcome.exit_code == EXIT_OK and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.outcome.logs_dir = ""


def _outcome_of(task: asyncio.Task[Any]) -> Any:
    """A task's result, its exception, or a note that it did not finish in time (and is cancelled)."""
    if not task.done():
        task.cancel()
        return "no reply in time"
    if task.cancelled():
        return "cancelled"
    return task.exception() or task.result()


def _differ(count: int) -> str:
    return f"{count} result differs" if count == 1 else f"{count} results differ"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _reply_of(replies: list[Any], order: list[str], key: str) -> str:
    reply = replies[order.index(key)]
    return repr(reply)[:300]


def _print_kept(outcome: DemoOutcome, pids: dict[str, int], token: str, console: Console) -> None:
    console.print(f"the demo stack keeps running (--keep); control token {token}:", highlight=False, markup=False)
    for name, url in outcome.kept_urls.items():
        console.print(f"  {name:<12} {url}  (process group {pids.get(name, '?')})", highlight=False, markup=False)
    if outcome.embedded_endpoint:
        console.print(
            "  note: the embedded S3 endpoint stopped with the demo; checkpoints of this stack into it will fail",
            highlight=False,
        )
    groups = " ".join(f"-{pid}" for pid in pids.values())
    console.print(f"stop it: kill -TERM -- {groups}", highlight=False, markup=False)


# --- the store-only demo (``gymckpt demo --store-only``): the store alone, no servers

_WORDS = [
    "the",
    "agent",
    "calls",
    "the",
    "weather",
    "tool",
    "for",
    "Paris",
    "and",
    "the",
    "model",
    "answers",
    "with",
    "a",
    "short",
    "summary",
    "of",
    "the",
    "result",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _chat(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, 40)}]
    for turn in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call_{turn}", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": _text(rng, 60)})
    return messages


def _records(kind: str, episodes: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(f"{seed}-{kind}")
    for index in range(episodes):
        key = f"{index // 4}-{index % 4}"
        step = rng.randint(0, 6)
        if kind == "environment":
            yield {
                "episode_id": key,
                "task_digest": hashlib.sha256(key.encode()).hexdigest(),
                "boundary": None if step == 0 else {"stage": "invoke_agent", "step": step},
            }
        elif kind == "model":
            yield {
                "episode_id": key,
                "cut": {
                    "tokens": [rng.randrange(50_000) for _ in range(rng.randint(16, 256))],
                    "logprob": rng.random(),
                },
            }
        elif kind == "agent":
            yield {"episode_id": key, "session": {"turn": step, "messages": _chat(rng, step)}}
        else:
            yield {
                "episode_id": key,
                "state": {"counter": rng.randint(0, 9), "score": float("nan") if step == 6 else step},
            }


def run_s3_store_demo(*, episodes: int, seed: int, console: Console) -> int:
    """``gymckpt demo --store-only --store s3``: the store demo against an S3 endpoint served by moto in this process.

    Starts moto's server on 127.0.0.1 and a free port, creates a bucket, runs the demo
    against ``s3://gymckpt-demo/checkpoints`` (multipart upload, server-side copy,
    ``If-None-Match: *`` manifests), verifies it, and stops the server: no account needed.
    """
    from gymckpt.store.moto_endpoint import MotoEndpoint

    with MotoEndpoint() as endpoint:
        endpoint.create_bucket(DEMO_BUCKET)
        console.print(
            f"embedded S3 endpoint (moto) at {endpoint.url}, bucket {DEMO_BUCKET}", highlight=False, markup=False
        )
        return run_store_demo(
            f"s3://{DEMO_BUCKET}/checkpoints",
            episodes=episodes,
            seed=seed,
            console=console,
            storage_options=endpoint.storage_options(),
            embedded_endpoint=True,
        )


def run_store_demo(
    store_url: str,
    *,
    episodes: int,
    seed: int,
    console: Console,
    storage_options: dict[str, Any] | None = None,
    embedded_endpoint: bool = False,
) -> int:
    """Run the store demo (``storage_options`` for object storage); return the process exit code."""
    checkpoint_dir = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    options = dict(storage_options or {})
    store = open_store(store_url, **options)
    rows = []
    manifests = []
    started = time.perf_counter()
    for kind in ("environment", "model", "agent", "resources"):
        began = time.perf_counter()
        manifest = store.write_participant(
            checkpoint_dir,
            kind=kind,
            instance=f"{kind}-0",
            checkpoint_id=checkpoint_dir,
            records=_records(kind, episodes, seed),
            extra={"demo_seed": seed},
        )
        manifests.append(manifest)
        rows.append((kind, manifest.record_count, manifest.records_bytes, time.perf_counter() - began))
    commit_seconds = time.perf_counter() - started
    store.publish(checkpoint_dir, manifests, extra={"trainer_step": 7})

    began = time.perf_counter()
    report = verify(f"{store_url.rstrip('/')}/{checkpoint_dir}", **options)
    verify_seconds = time.perf_counter() - began

    scope = [f"{index}-0" for index in range(min(8, episodes // 4))]
    began = time.perf_counter()
    restored = list(store.read_participant(checkpoint_dir, kind="agent", instance="agent-0", scope=scope))
    restore_seconds = time.perf_counter() - began
    expected = [record for record in _records("agent", episodes, seed) if record["episode_id"] in set(scope)]
    faithful = restored == expected

    table = Table(title=Text(f"Checkpoint {checkpoint_dir} in {store_url}"))
    for column in ("participant", "records", "bytes", "commit s"):
        table.add_column(column, justify="right" if column != "participant" else "left")
    for kind, count, size, seconds in rows:
        table.add_row(f"{kind}/{kind}-0", str(count), f"{size:,}", f"{seconds:.3f}")
    console.print(table)
    console.print(
        f"committed {sum(r[2] for r in rows):,} bytes in {commit_seconds:.3f} s; published gym/checkpoint.json\n"
        f"verify: {'OK' if report.ok else 'DAMAGED'} ({len(report.errors)} errors, {len(report.warnings)} warnings, "
        f"{report.records_checked} records re-hashed in {verify_seconds:.3f} s)\n"
        f"restore of agent scope {scope}: {len(restored)} records in {restore_seconds:.3f} s, "
        f"{'identical to what was committed' if faithful else 'DIFFERENT from what was committed'}\n"
        + (
            "the embedded S3 endpoint stops with the demo; against your own bucket: "
            "gymckpt verify s3://BUCKET/PREFIX/CHECKPOINT --endpoint-url URL"
            if embedded_endpoint
            else f"check it yourself: gymckpt verify {store_url.rstrip('/')}/{checkpoint_dir}"
        ),
        highlight=False,
        markup=False,
    )
    store.close()
    return 0 if report.ok and faithful and len(restored) == len(scope) else 1
