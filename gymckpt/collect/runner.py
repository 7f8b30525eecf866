"""``gymckpt collect``: run a dataset through an environment server; checkpoint rows in flight; resume.

A collection sends each row's ``/run`` (at most ``concurrency`` at once) and appends each
reply to the results file. It checkpoints every ``every`` seconds, on SIGUSR1, and on
SIGTERM or SIGINT (then with ``stop``: the servers are left stopped and it exits with
:data:`EXIT_STOPPED` once the checkpoint is published). No row is dispatched while a
checkpoint is open.

``resume`` picks the newest published checkpoint of the root (if it belongs to the run the
dispatch log names), skips the rows the results file has ended, fences every attempt the
crashed run may still have running (retire everywhere), restores the checkpoint's rows in
flight and sends them as their next attempt (they continue from their boundaries), and
sends the fenced rows again as their next attempt (they start over). Each rollout that had
an attempt fenced or restored is forgotten once it ended.

It fails loudly (:mod:`gymckpt.collect.health`): before the first row, the checkpoint
directory is checked against every server's ``allowed_roots`` (a refusal ends the run with
nothing sent); each failed checkpoint is one short line and is counted; a run whose
checkpoints fell short (none published, or fewer than ``min_checkpoint_success`` of those
attempted) exits with :data:`EXIT_CHECKPOINTS_FAILED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from gymckpt import transport
from gymckpt.collect.checkpoints import CheckpointRoot, PublishedCheckpoint, new_checkpoint_id
from gymckpt.collect.dataset import Row, load_rows
from gymckpt.collect.health import (
    DEFAULT_MIN_CHECKPOINT_SUCCESS,
    check_checkpoint_dir,
    checkpoint_shortfall,
    failure_line,
    not_prepared_line,
)
from gymckpt.collect.journal import DispatchLog, PriorRun, ResultsFile, dispatch_log_path, ended
from gymckpt.collect.progress import CollectProgress
from gymckpt.control.coordination import Coordinator, runs_to_await
from gymckpt.errors import CollectionExists, CoordinationError, GymckptError, ReplyTooLarge
from gymckpt.identity import capture_key, split_capture_key

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

__all__ = [
    "EXIT_CHECKPOINTS_FAILED",
    "EXIT_FAILED_ROWS",
    "EXIT_OK",
    "EXIT_STOPPED",
    "CollectOptions",
    "CollectSummary",
    "collect",
]

#: exit statuses: 2 (a usage or settings error, the checkpoint directory refused) is the command's
EXIT_OK, EXIT_FAILED_ROWS, EXIT_CHECKPOINTS_FAILED, EXIT_STOPPED = 0, 1, 3, 75

#: how long a stopping checkpoint waits for the replies of rows that ended before the export
ENDED_RUNS_SECONDS = 30.0
#: pause before sending again a /run the environment parked (a checkpoint was open there)
PARKED_RETRY_SECONDS = 0.2
#: how many times a parked /run is sent again before it counts as failed
PARKED_RETRIES = 600


@dataclass
class CollectOptions:
    """Everything a collection needs; see ``gymckpt collect --help`` for each."""

    dataset: Path
    environment: str
    out: Path
    token: str
    servers: list[str] = field(default_factory=list)
    checkpoint_dir: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    every: float = 0.0
    keep: int = 2
    concurrency: int = 32
    resume: bool = False
    checkpoint_timeout: float = 120.0
    run_timeout: float = 3600.0
    connect_timeout: float = 60.0
    #: the fraction of the checkpoints attempted that must be published (at least one always must)
    min_checkpoint_success: float = DEFAULT_MIN_CHECKPOINT_SUCCESS


@dataclass
class CollectSummary:
    """What a collection did (this run)."""

    rows: int = 0
    #: rows the results file had ended before this run (resume)
    skipped: int = 0
    finished: int = 0
    failed: int = 0
    continued: int = 0
    restarted: int = 0
    #: the checkpoints published, by id
    checkpoints: list[str] = field(default_factory=list)
    #: checkpoints attempted but not published (not prepared in time, a commit or publish that failed)
    checkpoints_failed: int = 0
    #: the first failed checkpoint's line (None: none failed)
    checkpoint_failure: str | None = None
    #: why the checkpoints fell short (then the exit status is 3), None if they did not
    checkpoint_shortfall: str | None = None
    prepare_seconds: list[float] = field(default_factory=list)
    commit_seconds: list[float] = field(default_factory=list)
    stopped: bool = False
    #: the checkpoint the stop published (None: nothing was in flight, or its checkpoint failed)
    stopped_at: str | None = None
    exit_code: int = EXIT_OK


@dataclass
class _Plan:
    """Where each unfinished row starts: its attempt, and what the resume does first."""

    attempts: dict[str, int] = field(default_factory=dict)
    fenced: dict[str, int] = field(default_factory=dict)
    continued: dict[str, int] = field(default_factory=dict)
    checkpoint: PublishedCheckpoint | None = None


def plan_resume(
    rows: list[Row],
    earlier: dict[str, dict[str, Any]],
    prior: PriorRun | None,
    checkpoint: PublishedCheckpoint | None,
) -> _Plan:
    """Which rows continue from ``checkpoint``, which are fenced and start over, and each one's next attempt.

    The checkpoint counts only if it is the prior run's (same ``run_id``) or there is no
    dispatch log. Attempts sent by the prior run (its log, the checkpoint's ``dispatched``,
    the results file's failed attempts) of a row not ended are fenced unless continued.
    """
    if checkpoint is not None and prior is not None and checkpoint.run_id != prior.run_id:
        checkpoint = None
    unfinished = {row.rollout_id for row in rows if not ended(earlier.get(row.rollout_id))}
    sent: dict[str, int] = dict(prior.attempts) if prior is not None else {}
    sources = [checkpoint.dispatched] if checkpoint is not None else []
    sources.append(
        {
            key: line["_ng_attempt_index"]
            for key, line in earlier.items()
            if isinstance(line.get("_ng_attempt_index"), int)
        }
    )
    for source in sources:
        for key, attempt in source.items():
            sent[key] = max(attempt, sent.get(key, -1))
    continued = (
        {key: attempt for key, attempt in checkpoint.attempts("continued").items() if key in unfinished}
        if checkpoint is not None
        else {}
    )
    fenced = {key: attempt for key, attempt in sent.items() if key in unfinished and key not in continued}
    attempts = {key: attempt + 1 for key, attempt in {**fenced, **continued}.items()}
    return _Plan(attempts, fenced, continued, checkpoint)


class Collector:
    """One collection run (see the module notes); :func:`collect` runs it."""

    def __init__(self, options: CollectOptions, console: Console) -> None:
        self.options = options
        self.console = console
        self.summary = CollectSummary()
        self.results = ResultsFile(options.out)
        self.dispatch = DispatchLog(dispatch_log_path(options.out))
        self.root = CheckpointRoot(options.checkpoint_dir, options.storage_options) if options.checkpoint_dir else None
        self.run_id = secrets.token_hex(16)
        #: rollout id → the attempt of its /run in flight
        self.in_flight: dict[str, int] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        #: rollouts whose earlier attempts were fenced or restored: forgotten once ended
        self.to_forget: set[str] = set()
        self.ended_rollouts: set[str] = set()
        self.dispatch_open = asyncio.Event()
        self.dispatch_open.set()
        self.stopping = False
        self._stop_requested = asyncio.Event()
        self._stop_failed = False
        self._collecting = False
        self.gym: Any = None
        self._checkpoint_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self.progress: CollectProgress | None = None
        self._http: aiohttp.ClientSession | None = None

    # --- the run

    async def run(self) -> CollectSummary:
        options = self.options
        rows = load_rows(options.dataset)
        self._refuse_to_overwrite()
        earlier = self.results.load() if options.resume else {}
        prior = self.dispatch.read() if options.resume else None
        latest = self.root.latest() if self.root is not None and options.resume else None
        plan = plan_resume(rows, earlier, prior, latest)
        todo = [row for row in rows if not ended(earlier.get(row.rollout_id))]
        self.summary.rows, self.summary.skipped = len(rows), len(rows) - len(todo)
        servers = list(dict.fromkeys([options.environment.rstrip("/"), *(url.rstrip("/") for url in options.servers)]))
        self.progress = CollectProgress(self.console, len(rows), done=self.summary.skipped)
        loop = asyncio.get_running_loop()
        if not todo and not plan.fenced:  # a finished collection: nothing to send, no server needed
            if self.root is not None:
                self.root.close()
            return self._finish()
        handlers = {
            signal.SIGUSR1: self._checkpoint_now,
            signal.SIGTERM: self._stop,
            signal.SIGINT: self._stop,
        }
        for signum, handler in handlers.items():
            loop.add_signal_handler(signum, handler)
        try:
            async with Coordinator(
                servers,
                token=options.token,
                storage_options=options.storage_options,
                probe_timeout=options.connect_timeout,
            ) as gym:
                self.gym = gym
                await self._connect()
                self.dispatch.start(self.run_id, {**plan.fenced, **plan.attempts})
                self.results.open()
                if latest is not None and plan.checkpoint is None:
                    self._event(f"{latest.checkpoint_id} belongs to another run than the dispatch log's: not restored")
                if self.stopping:  # stopped before any row was sent: nothing to checkpoint
                    self.summary.stopped = True
                    return self._finish()
                await self._prepare_resume(plan)
                with self.progress:
                    await self._collect(todo, plan)
                if not self.summary.stopped:  # a stopped stack is left as the checkpoint found it
                    await self._forget(sorted(self.to_forget & self.ended_rollouts))
        finally:
            for signum in handlers:
                loop.remove_signal_handler(signum)
            await self._close()
        return self._finish()

    def _finish(self) -> CollectSummary:
        """The exit status: stopped with its checkpoint published (resumable: 75 whatever came before);
        too few checkpoints (a failed stop's included); a row failed; all done."""
        summary = self.summary
        summary.checkpoint_shortfall = checkpoint_shortfall(
            len(summary.checkpoints), summary.checkpoints_failed, self.options.min_checkpoint_success
        )
        if self._stop_failed and summary.checkpoint_shortfall is None:
            summary.checkpoint_shortfall = "the stop's checkpoint was not published"
        if summary.stopped and not self._stop_failed:
            summary.exit_code = EXIT_STOPPED
        elif summary.checkpoint_shortfall is not None:
            summary.exit_code = EXIT_CHECKPOINTS_FAILED
        else:
            summary.exit_code = EXIT_FAILED_ROWS if summary.failed else EXIT_OK
        return summary

    def _refuse_to_overwrite(self) -> None:
        if self.options.resume:
            return
        if self.options.out.exists():
            raise CollectionExists(
                f"{self.options.out} exists: pass --resume to continue that collection, or choose another --out"
            )
        if self.root is not None and self.root.published():
            raise CollectionExists(
                f"{self.options.checkpoint_dir} holds checkpoints of an earlier collection: "
                "pass --resume to continue it, or choose another --checkpoint-dir"
            )

    async def _connect(self) -> None:
        """Every server answers, and none refuses the checkpoint directory (before any row is sent)."""
        found = await self.gym.discover(require_model=False)
        found.raise_for_problems()
        if self.options.checkpoint_dir is None:
            return
        unchecked = check_checkpoint_dir(found.participants, self.options.checkpoint_dir)
        if unchecked:  # reference servers: their refusal, if any, comes at the first checkpoint
            self._event(f"--checkpoint-dir not checked with {', '.join(unchecked)}: no allowed_roots in their status")

    async def _prepare_resume(self, plan: _Plan) -> None:
        """Fence the prior run's attempts, restore the checkpoint's rows in flight (see :func:`plan_resume`)."""
        deadline = time.time() + self.options.checkpoint_timeout
        label = f"collect-{self.run_id[:12]}"
        if plan.fenced:
            fenced = [capture_key(key, attempt) for key, attempt in sorted(plan.fenced.items())]
            await self.gym.retire(fenced, checkpoint_id=label, deadline_ts=deadline)
            self.to_forget.update(plan.fenced)
            self.summary.restarted += len(plan.fenced)
            self._event(f"{len(fenced)} rows the previous run may have sent start over as their next attempt")
        if plan.continued and plan.checkpoint is not None:
            restore_id = f"restore-{secrets.token_hex(6)}"
            scope = [capture_key(key, attempt) for key, attempt in sorted(plan.continued.items())]
            self.to_forget.update(plan.continued)
            try:
                await self.gym.restore(restore_id, deadline, plan.checkpoint.url, scope)
                await self.gym.resume(restore_id, time.time() + self.options.checkpoint_timeout)
            except (CoordinationError, GymckptError) as exc:
                # the coordinator retired the replacement attempts: start these rows over after them
                for key, attempt in plan.continued.items():
                    plan.attempts[key] = attempt + 2
                self.summary.restarted += len(scope)
                self._event(f"the restore of {plan.checkpoint.checkpoint_id} failed ({exc}); its rows start over")
            else:
                self.summary.continued += len(scope)
                self._event(
                    f"restored {len(scope)} rows in flight from {plan.checkpoint.checkpoint_id}: "
                    "they continue as their next attempt"
                )

    async def _collect(self, todo: list[Row], plan: _Plan) -> None:
        """Dispatch every row (restored ones first), checkpointing on the timer and on signals."""
        timer = asyncio.create_task(self._timer()) if self.options.every > 0 and self.root is not None else None
        self._collecting = True
        try:
            queue = deque(sorted(todo, key=lambda row: row.rollout_id not in plan.continued))
            slots = asyncio.Semaphore(max(1, self.options.concurrency))
            while queue and not self.stopping:
                if not await self._unless_stopped(slots.acquire()):
                    break
                if not await self._unless_stopped(self.dispatch_open.wait()) or self.stopping:
                    slots.release()
                    break
                row = queue.popleft()
                attempt = plan.attempts.get(row.rollout_id, 0)
                self.in_flight[row.rollout_id] = attempt
                task = asyncio.create_task(self._run_row(row, attempt))
                self.tasks[row.rollout_id] = task
                task.add_done_callback(lambda _task: slots.release())
                self._report()
            while self.tasks and not self.stopping:
                await self._unless_stopped(asyncio.wait(list(self.tasks.values()), return_when=asyncio.FIRST_COMPLETED))
            if self.stopping:
                await self._stopped()
        finally:
            if timer is not None:
                async with self._checkpoint_lock:  # a checkpoint under way ends (published or not) first
                    timer.cancel()
                await asyncio.gather(timer, return_exceptions=True)

    async def _unless_stopped(self, work: Any) -> bool:
        """Await ``work`` unless a stop comes first (then ``work`` is cancelled): whether it completed."""
        job = asyncio.ensure_future(work)
        stop = asyncio.create_task(self._stop_requested.wait())
        try:
            await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if job.done():
            return True
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return False

    async def _timer(self) -> None:
        while True:
            await asyncio.sleep(self.options.every)
            if self.in_flight and not self.stopping:
                await self.checkpoint(stop=False)

    def _checkpoint_now(self) -> None:
        """SIGUSR1: a checkpoint now, once rows are being dispatched (not while connecting or restoring)."""
        if self._collecting and not self.stopping:
            self._spawn(self.checkpoint(stop=False))
        else:
            self._event("SIGUSR1: no checkpoint now (not collecting yet, or stopping)")

    def _stop(self) -> None:
        if self.stopping:
            self._event("already stopping: waiting for the last checkpoint")
            return
        self.stopping = True
        self._event("stopping: a last checkpoint of the rows in flight, then exit")
        self._stop_requested.set()

    async def _stopped(self) -> None:
        """The stop: a checkpoint with ``stop`` (servers left stopped); the other rows' calls are abandoned."""
        self.summary.stopped = True
        if self.root is not None and self.in_flight:
            self.summary.stopped_at = await self.checkpoint(stop=True)
            self._stop_failed = self.summary.stopped_at is None
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- one row

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # bounded by the descriptors (transport.pool_limit): rows beyond it wait here, not in a failed connect
            self._http = transport.client_session(timeout=aiohttp.ClientTimeout(total=self.options.run_timeout))
        return self._http

    async def _run_row(self, row: Row, attempt: int) -> None:
        key = capture_key(row.rollout_id, attempt)
        try:
            await self.dispatch.record(row.rollout_id, attempt)
            reply = await self._post_run(key, row.task)
        except asyncio.CancelledError:
            raise
        # ValueError: a reply not JSON; ReplyTooLarge: one beyond transport.data_reply_limit(), read no further
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, ReplyTooLarge) as exc:
            reply = {"failure": {"failure_reason": f"/run failed: {exc or type(exc).__name__}", "terminal": False}}
        finally:
            self.in_flight.pop(row.rollout_id, None)
            self.tasks.pop(row.rollout_id, None)
        self._record(row, attempt, reply)

    async def _post_run(self, key: str, task: dict[str, Any]) -> dict[str, Any]:
        """The environment's reply; a /run parked by an open checkpoint there is sent again."""
        url = f"{self.options.environment.rstrip('/')}/run"
        for _ in range(PARKED_RETRIES):
            # never sent twice on a dropped connection: a second /run of a running episode is refused
            sent = {"episode_id": key, "task": task}
            async with transport.request(self._client(), "POST", url, resend=False, json=sent) as response:
                body = await transport.read_bounded_json(response, transport.data_reply_limit())
            if not isinstance(body, dict):
                return {"failure": {"failure_reason": f"/run answered {response.status}: {body!r}", "terminal": False}}
            error = body.get("error")
            if isinstance(error, dict) and error.get("code") == "checkpoint_parked":
                await asyncio.sleep(PARKED_RETRY_SECONDS)
                await self.dispatch_open.wait()
                continue
            if isinstance(error, dict):
                return {"failure": {"failure_reason": f"{error.get('code')}: {error.get('detail')}", "terminal": False}}
            return body
        return {"failure": {"failure_reason": "/run stayed parked by checkpoints", "terminal": False}}

    def _record(self, row: Row, attempt: int, reply: dict[str, Any]) -> None:
        line = row.tagged(attempt)
        failed = "result" not in reply
        if failed:
            failure = reply.get("failure")
            line["failure"] = (
                failure if isinstance(failure, dict) else {"failure_reason": str(reply), "terminal": False}
            )
        else:
            line["result"] = reply["result"]
        self.results.append(line)
        self.ended_rollouts.add(row.rollout_id)
        self.summary.finished += not failed
        self.summary.failed += failed
        if self.progress is not None:
            self.progress.row_ended(failed=failed, in_flight=len(self.in_flight))

    def _report(self) -> None:
        if self.progress is not None:
            self.progress.update(in_flight=len(self.in_flight))

    def _event(self, message: str) -> None:
        if self.progress is not None:
            self.progress.event(message)
        else:
            self.console.print(message, markup=False, highlight=False)

    # --- checkpoints

    async def checkpoint(self, *, stop: bool) -> str | None:
        """Prepare, commit the rows in flight, publish, move ``LATEST``, prune; the id, or None if it failed.

        Dispatch waits meanwhile. Unless ``stop``, every server resumes afterwards (also after a failure).
        """
        if self.root is None:
            return None
        async with self._checkpoint_lock:
            self.dispatch_open.clear()
            checkpoint_id = new_checkpoint_id()
            prepared_any = False
            resume = not stop
            try:
                deadline = time.time() + self.options.checkpoint_timeout
                began = time.perf_counter()
                prepared_any = True
                prepared = await self.gym.prepare(checkpoint_id, deadline)
                prepare_seconds = time.perf_counter() - began
                if not prepared.prepared:
                    resume = True
                    self._checkpoint_failed(not_prepared_line(checkpoint_id, prepared))
                    return None
                in_flight = {capture_key(key, attempt): key for key, attempt in self.in_flight.items()}
                scope = prepared.continued(in_flight)
                directory = self.root.directory(checkpoint_id)
                began = time.perf_counter()
                commits = await self.gym.commit(checkpoint_id, deadline, directory, scope, stop=stop)
                commit_seconds = time.perf_counter() - began
                environment = next(
                    (reply for url, reply in commits.items() if self.gym.kinds[url].kind == "environment"), None
                )
                exported = set(environment.episode_ids) if environment is not None else set()
                continued = sorted(set(scope) & exported)
                restarts = sorted(prepared.restarts() & set(in_flight))
                if stop:  # a row the environment ended before its export has its reply on the wire
                    waiting = runs_to_await(in_flight, committed=continued, restarts=restarts)
                    tasks = [self.tasks[in_flight[key]] for key in waiting if in_flight[key] in self.tasks]
                    if tasks:
                        await asyncio.wait(tasks, timeout=ENDED_RUNS_SECONDS)
                await asyncio.to_thread(self._sync_files)
                extra = {
                    "collection": "gymckpt collect",
                    "run_id": self.run_id,
                    "created_at": time.time(),
                    "continued": [_attempt_object(key) for key in continued],
                    "restarted": [_attempt_object(key) for key in restarts],
                    "dispatched": self._dispatched(),
                }
                await self.gym.publish(directory, commits, extra=extra)
                await asyncio.to_thread(self._advance, checkpoint_id)
            except (CoordinationError, GymckptError, OSError) as exc:
                resume = True
                kinds = {url: info.kind for url, info in self.gym.kinds.items()}
                self._checkpoint_failed(failure_line(checkpoint_id, exc, kinds))
                return None
            finally:
                if prepared_any and resume:
                    with contextlib.suppress(CoordinationError, GymckptError, OSError):
                        await self.gym.resume(checkpoint_id, time.time() + self.options.checkpoint_timeout)
                if not stop:
                    self.dispatch_open.set()
            self.summary.checkpoints.append(checkpoint_id)
            self.summary.prepare_seconds.append(prepare_seconds)
            self.summary.commit_seconds.append(commit_seconds)
            self._event(
                f"checkpoint {checkpoint_id} published: {len(continued)} rows in flight continue, "
                f"{len(restarts)} restart; prepare {prepare_seconds:.2f} s, commit {commit_seconds:.2f} s"
            )
            return checkpoint_id

    def _checkpoint_failed(self, line: str) -> None:
        """Count a checkpoint not taken, and say so in one line."""
        self.summary.checkpoints_failed += 1
        if self.summary.checkpoint_failure is None:
            self.summary.checkpoint_failure = line
        self._event(line)

    def _dispatched(self) -> dict[str, int]:
        """Every attempt this run may have sent (its dispatch log, read back)."""
        prior = self.dispatch.read()
        return dict(prior.attempts) if prior is not None else {}

    def _sync_files(self) -> None:
        self.results.sync()

    def _advance(self, checkpoint_id: str) -> None:
        assert self.root is not None
        self.root.advance(checkpoint_id)
        deleted = self.root.prune(self.options.keep, current=checkpoint_id)
        if deleted:
            self._event(f"deleted {len(deleted)} older checkpoints (keeping {self.options.keep})")

    # --- the end

    async def _forget(self, rollouts: list[str]) -> None:
        if not rollouts:
            return
        try:
            await self.gym.forget(rollouts, checkpoint_id=f"collect-{self.run_id[:12]}", deadline_ts=time.time() + 60)
        except (CoordinationError, GymckptError) as exc:
            self._event(f"forgetting {len(rollouts)} ended rollouts failed: {exc}")

    async def _close(self) -> None:
        async with self._checkpoint_lock:  # a SIGUSR1 checkpoint under way ends first: no half-taken one is left
            for task in list(self._background):
                task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        self.results.close()
        self.dispatch.close()
        if self.root is not None:
            self.root.close()


def _attempt_object(key: str) -> dict[str, Any]:
    rollout_id, attempt = split_capture_key(key)
    return {"rollout_id": rollout_id, "attempt": attempt}


async def collect(options: CollectOptions, console: Console) -> CollectSummary:
    """Run one collection (see the module notes) and return its summary."""
    return await Collector(options, console).run()
