"""The full demo (``gymckpt demo``): its phases, driving the reference stack through :class:`RolloutHarness`.

1. An uninterrupted run: the reference stack as real processes on loopback, every
   rollout's task run to its result once, without a checkpoint; then that stack is
   closed. Its results are what the interrupted run must reproduce (the reference stack is
   deterministic: the same task gives the same reward and response).
2. A fresh stack runs the same tasks. Rollouts are started one after the other over a
   window as long as the uninterrupted run's median rollout, so at the checkpoint the ones
   still running stand at different turns. The checkpoint is taken, event-driven, as soon
   as half of them have finished (``asyncio.wait(FIRST_COMPLETED)`` in a loop, bounded):
   prepare, commit of every rollout still in flight (restarts left out), publish.
3. ``/run`` calls the environment ended before its export (their replies were on the wire)
   are awaited; then every Gym server's process group is SIGKILLed (the inference
   backend survives), fresh processes start on the same ports, the checkpoint is restored,
   every participant resumes, and each exported rollout's next attempt (``r-a1``) is run
   to its result. A rollout that could not be captured starts over from its input.
4. Every result is compared with the uninterrupted run's, the checkpoint is verified
   offline, and a table is printed (:mod:`gymckpt.demo.report`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from rich.markup import escape

from gymckpt.control.coordination import runs_to_await
from gymckpt.demo.launch import TurnTrigger, launch_rollouts, past_first_turn
from gymckpt.demo.measure import generation_tokens, read_stages, redone_model_calls
from gymckpt.demo.report import (
    EXIT_DIFFERS,
    EXIT_SETUP,
    EXIT_TERMINATED,
    DemoOutcome,
    Progress,
    compare_results,
    failure_summary,
    mean_reward,
    refused_at_checkpoint,
    render,
    render_kept,
    result_of,
    stage_summary,
)
from gymckpt.demo.stacks import DemoStacks, PhaseFailed, logs_showing_errors
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.stack.harness import RolloutHarness, StateSizes, task_for
from gymckpt.store import verify

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from rich.console import Console

    from gymckpt.control.coordination import Coordinator, ParticipantCommit

__all__ = ["run_demo"]

#: how long the ``/run`` calls the environment ended before its export may take to reply
_ENDED_RUNS_SECONDS = 10.0


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
    workers: int = 2,
    restore_workers: int = 3,
    stack_options: dict[str, Any] | None = None,
    checkpoint_after: float = 0.5,
    observer: Callable[[str, RolloutHarness], None] | None = None,
    sizes: StateSizes | None = None,
    checkpoint_turn: TurnTrigger | int | dict[str, Any] | None = None,
) -> DemoOutcome:
    """Run the full demo; print progress on ``progress_console`` (default ``console``) and the table.

    ``seed`` chooses the tasks: ``task_for(seed * rollouts + i)`` for ``i < rollouts``.
    ``timeout`` bounds every phase (stack start, each batch of rollouts, each control call).
    The servers' configs and logs go to a new directory under ``logs_dir`` (the system's
    temporary directory by default), kept only when the demo fails or ``keep`` is set.
    The returned outcome's ``exit_code`` is the process exit status. Every Gym server of the
    interrupted stack runs ``workers`` uvicorn workers and is restarted with ``restore_workers``
    (the uninterrupted reference runs one worker per server).

    ``stack_options`` go to :func:`~gymckpt.stack.harness.default_stack_spec` (the
    inference backend's ``token_delay_seconds``, the model's ``tool_turns``);
    ``checkpoint_after`` is the share of rollouts finished when the checkpoint is taken
    (0.5: half; a smaller share leaves more in flight), unless ``checkpoint_turn``
    (:class:`~gymckpt.demo.launch.TurnTrigger`, or its turn, or its fields as a dict) decides
    by turn: once its share of the rollouts are in flight at its turn or later. ``sizes`` is how much state each rollout
    carries (:class:`~gymckpt.stack.harness.StateSizes`; default: its realistic defaults; the
    prompt length goes into the tasks, the rest into the stack). ``observer`` is called with
    an event name and the stack at each phase's edge: ``started:<label>`` once a stack
    answers, ``checkpoint`` before prepare, ``crash`` before the SIGKILL, ``restored``
    once the fresh processes answer, and ``continued`` when every rollout has its result
    (benchmarks sample the servers' processes between them).
    """
    if rollouts < 1:
        raise ValueError("the demo needs at least one rollout")
    if workers < 1 or restore_workers < 1:
        raise ValueError("every Gym server needs at least one worker")
    if not 0 < checkpoint_after < 1:
        raise ValueError("checkpoint_after is the share of rollouts finished at the checkpoint: between 0 and 1")
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
        workers=workers,
        restore_workers=restore_workers,
        stack_options=stack_options,
        checkpoint_after=checkpoint_after,
        observer=observer,
        sizes=sizes if sizes is not None else StateSizes(),
        trigger=TurnTrigger.of(checkpoint_turn),
    )
    asyncio.run(demo.run())
    render(demo.outcome, console)
    if demo.outcome.kept_urls:
        render_kept(demo.outcome, demo.kept_pids, demo.token, console)
    return demo.outcome


class _Demo(DemoStacks):
    """One run of the demo: its phases, driven through the stacks of :class:`DemoStacks`."""

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
        workers: int = 1,
        restore_workers: int = 1,
        stack_options: dict[str, Any] | None = None,
        checkpoint_after: float = 0.5,
        observer: Callable[[str, RolloutHarness], None] | None = None,
        sizes: StateSizes | None = None,
        trigger: TurnTrigger | None = None,
    ) -> None:
        super().__init__(
            outcome=DemoOutcome(rollouts=rollouts, store_url=store_url, embedded_endpoint=embedded_endpoint),
            store_url=store_url,
            storage_options=storage_options,
            sizes=sizes if sizes is not None else StateSizes.compact(),
            stack_options=dict(stack_options or {}),
            timeout=timeout,
            logs_dir=logs_dir,
            keep=keep,
            observer=observer,
        )
        self.progress = progress
        self.trigger = trigger
        self.checkpoint_after = checkpoint_after
        self.workers = workers
        self.restore_workers = restore_workers
        first = seed * rollouts
        #: rollout id ("<task index>-0") → task
        self.tasks = {
            f"{first + i}-0": task_for(first + i, prompt_chars=self.sizes.prompt_chars) for i in range(rollouts)
        }
        #: the uninterrupted run's median rollout duration: the launch window of the interrupted run
        self.median_rollout = 1.0
        #: tasks not started before the checkpoint (a turn trigger reached during the launch)
        self.unlaunched: list[str] = []

    # --- the run

    async def run(self) -> None:
        began = time.perf_counter()
        terminated = self._stop_on_sigterm()
        try:
            await self._phases()
        except asyncio.CancelledError:
            if not terminated.is_set():
                raise
            # SIGTERM (a scheduler, kill): the servers are stopped below, as for Ctrl-C; one line says so
            self.outcome.error = "stopped by SIGTERM; every server the demo started was stopped"
            self.outcome.exit_code = EXIT_TERMINATED
        except PhaseFailed as exc:
            if exc.log_tails:
                self.progress.console.print(exc.log_tails.strip("\n"), highlight=False, markup=False)
            self.outcome.error = str(exc)
            self.outcome.exit_code = exc.exit_code
        except Exception as exc:  # a bug, or something no phase expected: one line, the traceback kept in a file
            self.outcome.error = " ".join(f"{type(exc).__name__}: {exc}".split()) + self._keep_traceback()
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
        demo = await self._start_stack("demo", storage_options=self.storage_options, workers=self.workers)
        gym = await self._wait_up(demo, "demo")
        self.outcome.workers_before = await self._worker_counts(demo, gym)
        self.progress(
            f"a fresh stack answers after {time.perf_counter() - began:.1f} s: "
            + escape(", ".join(f"{name} {url}" for name, url in demo.urls.items()))
        )
        runs = await self._launch_until_checkpoint(demo)
        in_flight = sorted(key for key, task in runs.items() if not task.done())
        # only the log's length before the prepare: reading the log itself takes long enough under load
        # for many rollouts to end meanwhile; the entries up to that length are read after the checkpoint
        completed_before_prepare = await self._model_call_count(demo)
        self._observe("checkpoint", demo)
        exported = await self._checkpoint(demo, gym, in_flight)
        completed = (await self._model_calls(demo))[:completed_before_prepare]
        held_calls = await self._held_calls(exported, completed)
        await self._await_ended_runs(runs, in_flight, exported)

        # a rollout whose /run returned a failure before the crash has no result: it is lost
        finals: dict[str, dict[str, Any] | None] = {}
        failed_before: list[Any] = []
        for key, task in runs.items():
            if task.done() and key not in exported:
                reply = _outcome_of(task)
                result = result_of(reply)
                if result is not None:
                    finals[key] = result
                    outcome.finished_before.append(key)
                elif refused_at_checkpoint(reply):  # admission was closed: it never started, so it starts over
                    outcome.refused_at_checkpoint.append(key)
                else:
                    failed_before.append(reply)
        outcome.finished_before.sort()
        outcome.refused_at_checkpoint.sort()
        to_restart = sorted(
            [key for key, task in runs.items() if not task.done() and key not in exported]
            + outcome.refused_at_checkpoint
        )

        gym = await self._crash_and_restart(demo, gym, runs)
        calls_before = await self._model_calls(demo)
        await self._restore(demo, gym, exported)
        continued, failed_after = await self._continue(demo, gym, exported, to_restart)
        finals.update(continued)
        outcome.lost_reasons = "; ".join(
            f"{when}: {failure_summary(replies)}"
            for when, replies in (("before the crash", failed_before), ("after the restore", failed_after))
            if replies
        )
        self._observe("continued", demo)
        calls_after = await self._model_calls(demo)
        outcome.model_calls_before_crash, outcome.model_calls_redone = redone_model_calls(
            calls_before, calls_after, exported
        )
        tokens = generation_tokens(calls_before, calls_after, exported, held_calls)
        outcome.tokens_in_flight, outcome.tokens_kept_by_cuts = tokens.in_flight, tokens.kept
        outcome.tokens_generated_again, outcome.held_from_first_token = tokens.generated_again, tokens.from_first_token

        outcome.lost, outcome.differing = compare_results(reference, finals)
        outcome.compared = True
        outcome.mean_reward = mean_reward(finals.values())
        if outcome.lost or outcome.differing:
            self.progress(
                f"[bold red]{_n(len(outcome.lost), 'rollout')} lost, {_differ(len(outcome.differing))}[/] "
                "from the uninterrupted run"
                + (f" (lost {escape(outcome.lost_reasons)})" if outcome.lost and outcome.lost_reasons else "")
            )
        else:
            self.progress(
                f"every rollout has its result, each equal to the uninterrupted run's "
                f"(mean reward {outcome.mean_reward:.3f})"
            )
        await self._verify()
        if self.keep:
            await self._keep(demo)
        problems = []
        if outcome.lost:
            reasons = f" ({outcome.lost_reasons})" if outcome.lost_reasons else ""
            problems.append(f"{_n(len(outcome.lost), 'rollout')} lost{reasons}")
        if outcome.differing:
            problems.append(f"{_differ(len(outcome.differing))} from the uninterrupted run")
        if not outcome.verified:
            problems.append("the checkpoint did not verify")
        if problems:
            raise PhaseFailed("; ".join(problems))

    # --- phases

    async def _uninterrupted_run(self) -> dict[str, dict[str, Any] | None]:
        """Every task once on a fresh stack without a checkpoint: the results to reproduce."""
        began = time.perf_counter()
        stack = await self._start_stack("uninterrupted")
        await self._wait_up(stack, "uninterrupted")
        self.progress(f"uninterrupted run: the reference stack answers after {time.perf_counter() - began:.1f} s")
        durations: dict[str, float] = {}

        async def timed(key: str) -> Any:
            """The reply, or the exception the call raised: one failed call does not end the others."""
            began = time.perf_counter()
            try:
                reply = await stack.run(key, self.tasks[key])
            except (aiohttp.ClientError, ValueError, OSError) as exc:
                return exc
            durations[key] = time.perf_counter() - began
            return reply

        began = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                replies = await asyncio.gather(*(timed(key) for key in self.tasks))
        except TimeoutError as exc:
            raise PhaseFailed(
                f"the uninterrupted run did not finish within {self.timeout:.0f} s{logs_showing_errors(stack)}",
                EXIT_SETUP,
                log_tails=stack.log_tails(),
            ) from exc
        self.outcome.uninterrupted_seconds = time.perf_counter() - began
        reference = {key: result_of(reply) for key, reply in zip(self.tasks, replies, strict=True)}
        failed = [key for key, result in reference.items() if result is None]
        if failed:
            raise PhaseFailed(
                f"the uninterrupted run failed for {len(failed)} of {len(self.tasks)} rollouts "
                f"(e.g. {failed[0]}): {failure_summary(replies)}{logs_showing_errors(stack)}",
                EXIT_SETUP,
                log_tails=stack.log_tails(),
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

    async def _launch_until_checkpoint(self, stack: RolloutHarness) -> dict[str, asyncio.Task[dict[str, Any]]]:
        """Start every rollout, then wait for the checkpoint's moment (:func:`launch_rollouts`)."""
        try:
            async with asyncio.timeout(self.timeout):
                launch = await launch_rollouts(
                    stack,
                    self.tasks,
                    spawn=self._spawn,
                    median_rollout=self.median_rollout,
                    checkpoint_after=self.checkpoint_after,
                    trigger=self.trigger,
                )
        except TimeoutError as exc:
            raise PhaseFailed(
                f"the rollouts did not reach the checkpoint's moment within {self.timeout:.0f} s"
                f"{logs_showing_errors(stack)}",
                log_tails=stack.log_tails(),
            ) from exc
        runs = launch.runs
        self.outcome.launch_seconds, self.outcome.peak_in_flight = launch.launch_seconds, launch.peak_in_flight
        self.unlaunched = launch.unlaunched
        done = sum(task.done() for task in runs.values())
        at_turn = f", {launch.at_turn} of them at turn {self.trigger.turn} or later" if self.trigger else ""
        later = f" ({len(launch.unlaunched)} start after the restore)" if launch.unlaunched else ""
        self.progress(
            f"started {_n(len(runs), 'rollout')}{later} over {self.outcome.launch_seconds:.2f} s "
            f"(up to {self.outcome.peak_in_flight} at once); {done} finished, {len(runs) - done} in flight"
            f"{at_turn}: checkpoint"
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
            raise PhaseFailed(
                f"the checkpoint failed: {exc}{logs_showing_errors(stack)}", log_tails=stack.log_tails()
            ) from exc
        outcome.prepare_seconds, outcome.commit_seconds = done.prepare_seconds, done.commit_seconds
        outcome.restarts_reported = sorted(done.prepared.restarts())
        environment: ParticipantCommit | None = None
        for reply in done.commits.values():
            outcome.bytes_by_participant[f"{reply.kind}/{reply.instance}"] = reply.records_bytes or 0
            outcome.records_by_participant[f"{reply.kind}/{reply.instance}"] = reply.record_count
            if reply.kind == "environment":
                environment = reply
        if environment is None:
            raise PhaseFailed("no environment participant committed")
        exported = sorted(set(environment.episode_ids) & set(done.scope))
        outcome.exported = exported
        parts = " · ".join(f"{name} {size:,}" for name, size in sorted(outcome.bytes_by_participant.items()))
        self.progress(
            f"checkpoint {outcome.checkpoint_id}: prepare {done.prepare_seconds:.3f} s "
            f"({len(outcome.restarts_reported)} restarts), commit {done.commit_seconds:.3f} s of "
            f"{_n(len(done.scope), 'rollout')}: {_n(outcome.records_written, 'record')}, {outcome.bytes_written:,} bytes "
            f"({parts}); gym/checkpoint.json published"
        )
        outcome.stages = await read_stages(self.outcome.checkpoint_dir, self.storage_options, exported, self.progress)
        outcome.exported_past_first_turn = past_first_turn(outcome.stages)
        if outcome.stages:
            self.progress(f"where the exported {_n(len(exported), 'rollout')} stood: {stage_summary(outcome.stages)}")
        return exported

    async def _await_ended_runs(
        self, runs: dict[str, asyncio.Task[dict[str, Any]]], in_flight: list[str], exported: list[str]
    ) -> None:
        """K6: wait for the ``/run`` calls in flight that were neither exported nor restarts.

        The environment ended them before its export: their replies are on the wire. One
        that does not come (it reached the environment after the export, or still waits in
        the trainer's pool) starts over after the crash, as a restart does.
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
                + (f"; {len(late)} came after it or wait in the trainer's pool, and will start over" if late else "")
            )

    async def _crash_and_restart(
        self, stack: RolloutHarness, gym: Coordinator, runs: dict[str, asyncio.Task[dict[str, Any]]]
    ) -> Coordinator:
        """SIGKILL every Gym server's process group, start fresh ones, wait until they answer."""
        began = time.perf_counter()
        self._observe("crash", stack)
        # the trainer's side goes first: a /run still waiting for a connection must not reach the fresh processes
        for task in runs.values():
            task.cancel()
        await asyncio.gather(*runs.values(), return_exceptions=True)
        await asyncio.to_thread(stack.crash)
        await gym.close()
        self.progress(
            f"SIGKILL of every Gym server's process group ({', '.join(stack.gym_servers)}); "
            "the inference backend keeps running"
        )
        stack.restart(workers=self.restore_workers)  # in the loop's thread: an interrupt cannot leave orphans
        self._note_pids(stack)
        fresh = await self._wait_up(stack, "demo (restarted)")
        self.outcome.workers_after = await self._worker_counts(stack, fresh)
        self._observe("restored", stack)
        self.outcome.restart_seconds = time.perf_counter() - began
        self.progress(
            f"fresh processes on the same ports answer after {self.outcome.restart_seconds:.2f} s, "
            f"{self.restore_workers} workers per Gym server (before the crash: {self.workers})"
        )
        return fresh

    async def _restore(self, stack: RolloutHarness, gym: Coordinator, exported: list[str]) -> None:
        outcome = self.outcome
        try:
            restored = await stack.restore(
                gym, outcome.checkpoint_id, outcome.checkpoint_dir, exported, deadline_seconds=self.timeout
            )
            outcome.restore_seconds = restored.restore_seconds
            await gym.resume(outcome.checkpoint_id, time.time() + self.timeout)
        except Exception as exc:
            raise PhaseFailed(f"the restore failed: {exc}") from exc
        expected = {capture_key(key, 1) for key in exported}
        for url, reply in restored.replies.items():
            if gym.kinds[url].kind == "environment" and set(reply.restored) != expected:
                missing = sorted(expected - set(reply.restored))
                raise PhaseFailed(
                    f"the environment restored {len(reply.restored)} of {len(expected)} rollouts: {missing}"
                )
        self.progress(
            f"restored {_n(len(exported), 'rollout')} in {outcome.restore_seconds:.3f} s "
            "(installed under attempt 1), every participant resumed"
            if exported
            else "nothing exported to restore; every participant resumed"
        )

    async def _continue(
        self, stack: RolloutHarness, gym: Coordinator, exported: list[str], to_restart: list[str]
    ) -> tuple[dict[str, dict[str, Any] | None], list[Any]]:
        """Run each exported rollout's next attempt, and start the others over; forget them all after.

        Returns every result (None: none) and the replies of the attempts without one.
        """
        outcome = self.outcome
        checkpoint_id = outcome.checkpoint_id
        if to_restart:
            try:
                await gym.retire(to_restart, checkpoint_id=checkpoint_id, deadline_ts=time.time() + self.timeout)
            except Exception as exc:
                raise PhaseFailed(f"retiring the old attempts of the restarted rollouts failed: {exc}") from exc
        unlaunched = set(self.unlaunched)
        order = [*exported, *to_restart, *self.unlaunched]

        async def next_attempt(key: str) -> dict[str, Any]:
            if key in unlaunched:  # never started before the crash: its first attempt
                return await stack.run(key, self.tasks[key])
            rollout, attempt = split_capture_key(key)
            return await stack.run(capture_key(rollout, attempt + 1), self.tasks[key])

        began = time.perf_counter()
        attempts = {key: self._spawn(next_attempt(key)) for key in order}
        if attempts:
            await asyncio.wait(attempts.values(), timeout=self.timeout)
        outcome.continue_seconds = time.perf_counter() - began
        replies = [_outcome_of(attempts[key]) for key in order]
        results = {key: result_of(reply) for key, reply in zip(order, replies, strict=True)}
        outcome.continued = sorted(key for key in exported if results[key] is not None)
        outcome.restarted = sorted(key for key in to_restart if results[key] is not None)
        outcome.started_after_restore = sorted(key for key in unlaunched if results[key] is not None)
        if order:
            try:
                await gym.forget(order, checkpoint_id=checkpoint_id, deadline_ts=time.time() + self.timeout)
            except Exception as exc:
                raise PhaseFailed(f"forgetting the finished rollouts failed: {exc}") from exc
        failed = [key for key in order if results[key] is None]
        self.progress(
            f"continued {_n(len(outcome.continued), 'rollout')} from their boundaries and started "
            f"{len(outcome.restarted)} over"
            + (f" and {len(outcome.started_after_restore)} for the first time" if unlaunched else "")
            + f", in {outcome.continue_seconds:.2f} s"
            + (
                f"; [red]{len(failed)} without a result[/], e.g. {escape(failed[0])}: {escape(_reply_of(replies, order, failed[0]))}"
                if failed
                else ""
            )
        )
        return results, [reply for reply, key in zip(replies, order, strict=True) if results[key] is None]

    async def _verify(self) -> None:
        began = time.perf_counter()
        try:
            report = await asyncio.to_thread(verify, self.outcome.checkpoint_dir, **self.storage_options)
        except Exception as exc:
            raise PhaseFailed(f"verify could not read the checkpoint: {exc}") from exc
        self.outcome.verify_seconds = time.perf_counter() - began
        self.outcome.verify_report = report
        self.progress(
            f"verify {escape(self.outcome.checkpoint_dir)}: {'OK' if report.ok else '[red]DAMAGED[/]'} "
            f"({len(report.errors)} errors, {len(report.warnings)} warnings, "
            f"{report.records_checked} records re-hashed in {self.outcome.verify_seconds:.3f} s)"
        )


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
