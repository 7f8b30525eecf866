"""Preemption with notice (M4): take a checkpoint when the notice comes, and say how long it took.

Spot instances, Slurm, Kubernetes and Ray's node draining warn a process seconds before they
end it. :class:`PreemptionGuard` wraps the controller's
:class:`~gymckpt.control.coordination.Coordinator`: the trainer takes its checkpoints through
:meth:`PreemptionGuard.checkpoint` (prepare, commit the rollouts in flight, publish under
``<checkpoint_root>/<checkpoint id>``, resume), so the guard knows whether one is open. A
notice (SIGTERM to the controller, or :meth:`PreemptionGuard.notice` from any thread, e.g.
a launcher told that a node drains) then

- finishes the checkpoint already open, if there is one, instead of starting another;
- else takes one at once;
- starts no second checkpoint on a second notice, nor on a later :meth:`~PreemptionGuard.checkpoint`
  call (that call returns the notice's checkpoint);
- commits with ``stop`` when the commit comes after the notice, and resumes nobody: the servers
  stay closed for the end (a controller that lives on restores into fresh servers);
- reports, in one log line and in a :class:`PreemptionResult`, the checkpoint's id, whether it was
  published, the seconds from the notice to that outcome, and the grace period. A success is
  logged at WARNING; a checkpoint not published, or published past the grace, at ERROR (both
  reach stderr even where logging is not configured).

Every checkpoint through the guard is given the grace period less a reserve (the servers'
deadline: half of it for prepare, the rest for commit; the reserve is left for publishing),
so a notice that comes while one is open can still see it finished in time. A checkpoint
that needs longer than the grace could not be taken on a notice either.

The grace period is an argument: the platforms do not tell the process. What they give:
Kubernetes, ``terminationGracePeriodSeconds`` (30 s unless the pod says otherwise), counted
from the start of the ``preStop`` hook, which is then time the controller does not get;
Slurm, the ``N`` of ``--signal=TERM@N`` (sbatch notes the signal may come up to 60 s early);
Ray's node draining, the deadline its caller gave the drain (none unless given), which a
launcher passes with its notice (``notice("node drain", grace_seconds=...)``).

The checkpoint runs as a task of the guard's event loop: the trainer must keep the loop
turning (await its steps, or run blocking work in threads) for it to progress.

A trainer::

    from gymckpt.control.coordination import Coordinator
    from gymckpt.control.preemption import PreemptionGuard

    async with Coordinator(server_urls, token=TOKEN) as gym:
        (await gym.discover()).raise_for_problems()
        guard = PreemptionGuard(
            gym,
            grace_seconds=30,  # the pod's terminationGracePeriodSeconds
            checkpoint_root="s3://bucket/run-7/checkpoints",
            in_flight=lambda: running.keys(),  # capture keys of the /run calls not replied yet
        )
        async with guard:  # SIGTERM is now a notice
            while not guard.noticed:
                await train_one_step()
                if time_to_checkpoint():
                    result = await guard.checkpoint()  # published, or result.error says why not
        preempted = guard.result  # None: the loop ended without a notice
    if preempted is not None:
        sys.exit(0 if preempted.ok else 1)

A guard serves one preemption: once noticed, make a new one for the controller that
restores and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymckpt import errors
from gymckpt.control.coordination_results import EpisodeLike, scope_keys
from gymckpt.identity import episode_object, new_checkpoint_id

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from gymckpt.control.coordination import Coordinator, PrepareResult

__all__ = ["DEFAULT_RESERVE_SECONDS", "CheckpointResult", "PreemptionGuard", "PreemptionResult", "new_checkpoint_id"]

logger = logging.getLogger(__name__)

#: the most of the grace period kept back for publishing (never more than a fifth of it)
DEFAULT_RESERVE_SECONDS = 5.0


@dataclass(frozen=True)
class CheckpointResult:
    """One checkpoint taken through the guard: published, or ``error`` says why not (one line)."""

    checkpoint_id: str
    directory: str
    published: bool
    #: from its start to its publication (or failure), in seconds
    seconds: float
    #: the capture keys committed as continued (the rollouts in flight, restarts left out)
    continued: tuple[str, ...] = ()
    #: the rollouts in flight no server can capture: they start over after a crash
    restarts: tuple[str, ...] = ()
    #: whether the commit asked the servers to stop (it came after a notice)
    stopped: bool = False
    error: str | None = None


@dataclass(frozen=True)
class PreemptionResult:
    """What a notice got: the checkpoint, and the seconds from the notice to its outcome against the grace."""

    reason: str
    grace_seconds: float
    #: from the notice to the checkpoint's publication (or failure)
    seconds: float
    checkpoint: CheckpointResult
    #: the notice finished a checkpoint already open instead of starting one
    finished_open: bool

    @property
    def checkpoint_id(self) -> str:
        return self.checkpoint.checkpoint_id

    @property
    def published(self) -> bool:
        return self.checkpoint.published

    @property
    def within_grace(self) -> bool:
        """Whether the outcome came within the grace period (published or not)."""
        return self.seconds <= self.grace_seconds

    @property
    def ok(self) -> bool:
        """Published within the grace period."""
        return self.published and self.within_grace

    def line(self) -> str:
        """The report, in one line."""
        head = f"preemption ({self.reason}): checkpoint {self.checkpoint_id}"
        if self.finished_open:
            head += " (open at the notice)"
        timing = f"{self.seconds:.2f} s of the {self.grace_seconds:g} s grace"
        if not self.published:
            error = self.checkpoint.error or "unknown error"
            return f"{head} NOT published after {timing}: {error}; restore the last published checkpoint"
        if not self.within_grace:
            return (
                f"{head} published in {self.seconds:.2f} s, past the {self.grace_seconds:g} s grace: "
                "the platform may have ended the controller first; give it a longer grace period"
            )
        return f"{head} published in {timing}"


@dataclass
class _Open:
    checkpoint_id: str
    task: asyncio.Task[CheckpointResult]


@dataclass(frozen=True)
class _Notice:
    reason: str
    monotonic: float
    grace_seconds: float


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, errors.GymckptError) else f"{type(exc).__name__}: {text}"


def _not_ready(prepared: PrepareResult) -> str:
    blockers = sorted({key for keys in prepared.blockers().values() for key in keys})
    shown = ", ".join(blockers[:5]) + (", …" if len(blockers) > 5 else "")
    return f"the {prepared.stopped_at} stage was not ready by its deadline (blocking: {shown or 'none listed'})"


class PreemptionGuard:
    """Takes the controller's checkpoints, and one on a preemption notice (see the module notes).

    Parameters
    ----------
    coordinator:
        A discovered :class:`~gymckpt.control.coordination.Coordinator` of every participant.
    grace_seconds:
        How long the platform leaves between its notice and the end of the controller.
    checkpoint_root:
        Where checkpoints go: each one in ``<checkpoint_root>/<checkpoint id>`` (a path or an
        fsspec URL the servers can write, as the commit's ``checkpoint_dir``).
    in_flight:
        Returns the episodes whose ``/run`` has not replied (asked once each checkpoint is
        prepared): the commit's scope, restarts left out.
    reserve_seconds:
        Kept back from the grace period for publishing; by default the smaller of
        :data:`DEFAULT_RESERVE_SECONDS` and a fifth of the grace (of a notice's shorter grace, at
        most a fifth of it).
    signals:
        Signals that are a notice while the guard is entered (``async with``); handled in the
        event loop, which must run in the main thread. ``()``: none.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        grace_seconds: float,
        checkpoint_root: str,
        in_flight: Callable[[], Iterable[EpisodeLike]],
        reserve_seconds: float | None = None,
        signals: Iterable[signal.Signals] = (signal.SIGTERM,),
    ) -> None:
        if not grace_seconds > 0:
            raise ValueError(f"grace_seconds must be > 0, not {grace_seconds!r}")
        reserve = min(DEFAULT_RESERVE_SECONDS, grace_seconds / 5) if reserve_seconds is None else reserve_seconds
        if not 0 <= reserve < grace_seconds:
            raise ValueError(f"reserve_seconds must be >= 0 and below the grace ({grace_seconds:g} s), not {reserve!r}")
        self.coordinator = coordinator
        self.grace_seconds = float(grace_seconds)
        self.reserve_seconds = float(reserve)
        self.checkpoint_root = checkpoint_root.rstrip("/")
        self._in_flight = in_flight
        self._signals = tuple(signals)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._closed = False
        self._previous: dict[signal.Signals, Any] = {}
        self._open: _Open | None = None
        self._notice: _Notice | None = None
        self._notices = 0
        self._report_task: asyncio.Task[PreemptionResult] | None = None
        self._result: PreemptionResult | None = None
        self._noticed = asyncio.Event()

    # --- entering and leaving

    async def __aenter__(self) -> PreemptionGuard:
        if self._loop is not None:
            raise errors.PreemptionGuardInactive("a PreemptionGuard is entered once; make a new one")
        if not self.coordinator.kinds:
            raise ValueError("the coordinator knows no participant: await its discover() before entering the guard")
        loop = asyncio.get_running_loop()
        self._loop, self._thread = loop, threading.get_ident()
        try:
            for signum in self._signals:
                previous = signal.getsignal(signum)
                loop.add_signal_handler(signum, self.notice, signum.name)
                self._previous[signum] = previous
        except (ValueError, RuntimeError) as exc:  # not the main thread, or no such signal here
            self._remove_signal_handlers()
            self._closed = True
            raise ValueError(
                f"cannot take {', '.join(sig.name for sig in self._signals)} as a notice here ({exc}): "
                "enter the guard in the main thread's event loop, or pass signals=()"
            ) from exc
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop taking signals as notices; wait for a checkpoint still running (its deadlines bound it)."""
        self._remove_signal_handlers()
        while pending := [task for task in self._running() if not task.done()]:
            await asyncio.gather(*pending, return_exceptions=True)
        self._closed = True

    def _running(self) -> list[asyncio.Task[Any]]:
        tasks: list[asyncio.Task[Any]] = [] if self._report_task is None else [self._report_task]
        return tasks if self._open is None else [*tasks, self._open.task]

    def _remove_signal_handlers(self) -> None:
        assert self._loop is not None
        for signum, previous in self._previous.items():
            self._loop.remove_signal_handler(signum)
            if previous is not None:
                signal.signal(signum, previous)
        self._previous.clear()

    # --- state

    @property
    def noticed(self) -> bool:
        """Whether a notice came."""
        return self._notice is not None

    @property
    def notices(self) -> int:
        """How many notices came (the first one's checkpoint is the only one taken)."""
        return self._notices

    @property
    def open_checkpoint(self) -> str | None:
        """The id of the checkpoint open now, if any."""
        return None if self._open is None else self._open.checkpoint_id

    @property
    def result(self) -> PreemptionResult | None:
        """The notice's result once its checkpoint ended (None before)."""
        return self._result

    # --- the notice

    def notice(self, reason: str = "notice", *, grace_seconds: float | None = None) -> None:
        """A preemption notice, from any thread (a signal handler, a launcher's drain callback).

        The first one finishes the open checkpoint or takes one; later ones are counted and
        logged, nothing more. Returns at once: :meth:`wait` gives the result.
        ``grace_seconds``: this notice's own grace (a drain's deadline), else the guard's.
        """
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        if not grace > 0:
            raise ValueError(f"grace_seconds must be > 0, not {grace_seconds!r}")
        loop = self._active_loop()
        notice = _Notice(reason, time.monotonic(), float(grace))
        if threading.get_ident() == self._thread:
            self._on_notice(notice)
        else:
            try:
                loop.call_soon_threadsafe(self._on_notice, notice)
            except RuntimeError as exc:  # the loop closed meanwhile
                raise errors.PreemptionGuardInactive(f"notice ({reason}) after the guard's event loop closed") from exc

    async def wait(self) -> PreemptionResult:
        """The notice's result: waits for a notice, then for its checkpoint (after the guard was left: its result)."""
        if self._result is not None:
            return self._result
        self._active_loop()
        await self._noticed.wait()
        assert self._report_task is not None
        return await asyncio.shield(self._report_task)

    def _on_notice(self, notice: _Notice) -> None:
        reason = notice.reason
        if self._closed:
            logger.error("preemption notice (%s) after the guard was left: no checkpoint taken", reason)
            return
        self._notices += 1
        if self._notice is not None:
            logger.warning(
                "preemption notice %d (%s) while handling the first (%s): no second checkpoint",
                self._notices,
                reason,
                self._notice.reason,
            )
            return
        self._notice = notice
        finished_open = self._open is not None
        if self._open is None:
            self._open = self._start(new_checkpoint_id(), notice.monotonic, notice.grace_seconds)
        logger.warning(
            "preemption notice (%s): %s checkpoint %s within the %g s grace",
            reason,
            "finishing the open" if finished_open else "taking",
            self._open.checkpoint_id,
            notice.grace_seconds,
        )
        self._report_task = asyncio.get_running_loop().create_task(
            self._report(notice, self._open.task, finished_open), name="gymckpt-preemption-report"
        )
        self._noticed.set()

    async def _report(
        self, notice: _Notice, task: asyncio.Task[CheckpointResult], finished_open: bool
    ) -> PreemptionResult:
        checkpoint = await asyncio.shield(task)
        seconds = time.monotonic() - notice.monotonic
        result = PreemptionResult(notice.reason, notice.grace_seconds, seconds, checkpoint, finished_open)
        self._result = result
        logger.log(logging.WARNING if result.ok else logging.ERROR, "%s", result.line())
        return result

    # --- checkpoints

    async def checkpoint(self, checkpoint_id: str | None = None) -> CheckpointResult:
        """Prepare, commit the rollouts in flight, publish, resume; the result says whether it was published.

        After a notice this takes no checkpoint: it returns the notice's. Raises
        :class:`~gymckpt.errors.CheckpointConflict` while another checkpoint is open.
        """
        self._active_loop()
        if self._notice is not None:
            return (await self.wait()).checkpoint
        if self._open is not None:
            raise errors.CheckpointConflict(
                f"checkpoint {self._open.checkpoint_id} is open: await it before taking {checkpoint_id or 'another'}"
            )
        opened = self._open = self._start(checkpoint_id or new_checkpoint_id(), time.monotonic(), self.grace_seconds)
        return await asyncio.shield(opened.task)

    def _start(self, checkpoint_id: str, began: float, grace_seconds: float) -> _Open:
        take = self._take(checkpoint_id, began, grace_seconds)
        task = asyncio.get_running_loop().create_task(take, name=f"gymckpt-{checkpoint_id}")
        return _Open(checkpoint_id, task)

    async def _take(self, checkpoint_id: str, began: float, grace_seconds: float) -> CheckpointResult:
        """One checkpoint within ``grace_seconds`` of ``began``; never raises (a failure is in the result, and logged)."""
        gym = self.coordinator
        directory = f"{self.checkpoint_root}/{checkpoint_id}"
        budget = grace_seconds - self._reserve(grace_seconds)
        started = time.time() - (time.monotonic() - began)
        prepare_deadline = started + budget / 2
        commit_deadline = started + budget
        continued: list[str] = []
        restarts: list[str] = []
        stopped = False
        error: str | None = None
        try:
            prepared = await gym.prepare(checkpoint_id, prepare_deadline)
            if prepared.prepared:
                in_flight = set(scope_keys(self._in_flight()))
                continued = prepared.continued(in_flight)
                restarts = sorted(prepared.restarts() & in_flight)
                stopped = self._notice is not None
                commits = await gym.commit(checkpoint_id, commit_deadline, directory, continued, stop=stopped)
                extra = {
                    "created_at": time.time(),
                    "continued": [episode_object(key) for key in continued],
                    "restarted": [episode_object(key) for key in restarts],
                    "preemption": None if self._notice is None else self._notice.reason,
                }
                await gym.publish(directory, commits, extra=extra)
            else:
                error = _not_ready(prepared)
        except Exception as exc:
            error = _one_line(exc)
            if not isinstance(exc, errors.GymckptError | OSError):
                logger.error("checkpoint %s failed unexpectedly", checkpoint_id, exc_info=True)
        result = CheckpointResult(
            checkpoint_id,
            directory,
            error is None,
            time.monotonic() - began,
            tuple(continued),
            tuple(restarts),
            stopped,
            error,
        )
        if self._notice is None:
            await self._resume(checkpoint_id)
            if error is None:
                logger.info(
                    "checkpoint %s published in %.2f s: %d in flight continue, %d restart",
                    checkpoint_id,
                    result.seconds,
                    len(continued),
                    len(restarts),
                )
            else:
                logger.error("checkpoint %s NOT published: %s", checkpoint_id, error)
        self._open = None
        return result

    def _reserve(self, grace_seconds: float) -> float:
        """The reserve within a grace: the guard's, but at most a fifth of a notice's shorter grace."""
        return (
            self.reserve_seconds
            if grace_seconds >= self.grace_seconds
            else min(self.reserve_seconds, grace_seconds / 5)
        )

    async def _resume(self, checkpoint_id: str) -> None:
        """Reopen every server after a checkpoint taken without a notice (also after a failure)."""
        try:
            await self.coordinator.resume(checkpoint_id, time.time() + self.grace_seconds)
        except Exception as exc:
            logger.error("checkpoint %s: resuming the servers failed: %s", checkpoint_id, _one_line(exc))

    def _active_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._closed:
            raise errors.PreemptionGuardInactive(
                "the PreemptionGuard is not entered: use it inside `async with guard:`"
            )
        return self._loop
