"""The demo's stacks and where they keep things: starting, watching and closing the reference
stacks of one demo run, its logs directory and its store root (:class:`DemoStacks`, the base
of the demo's phases in :mod:`gymckpt.demo.full`), and the one-line failure a phase raises
(:class:`PhaseFailed`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from gymckpt.demo.measure import held_model_calls
from gymckpt.demo.report import EXIT_DIFFERS, EXIT_OK, EXIT_SETUP, DemoOutcome
from gymckpt.stack.harness import RolloutHarness, StackNotReady, StateSizes, default_stack_spec
from gymckpt.store.checkpoint_store import backend_for_url

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from gymckpt.control.coordination import Coordinator

__all__ = ["DemoStacks", "PhaseFailed", "logs_showing_errors"]

T = TypeVar("T")


class PhaseFailed(Exception):
    """A phase failed: one line naming what failed, the exit code it gives, and the servers' log tails."""

    def __init__(self, message: str, exit_code: int = EXIT_DIFFERS, *, log_tails: str = "") -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code
        self.log_tails = log_tails


class DemoStacks:
    """The stacks of one demo run and what they leave behind: the logs directory (removed after a
    clean run unless ``keep``), the store root, the server processes, the controller's coordinators."""

    def __init__(
        self,
        *,
        outcome: DemoOutcome,
        store_url: str,
        storage_options: dict[str, Any],
        sizes: StateSizes,
        stack_options: dict[str, Any],
        timeout: float,
        logs_dir: Path | None,
        keep: bool,
        observer: Callable[[str, RolloutHarness], None] | None,
    ) -> None:
        self.outcome = outcome
        self.store_url = store_url
        self.storage_options = storage_options
        self.sizes = sizes
        self.stack_options = stack_options
        self.timeout = timeout
        self.keep = keep
        self._observer = observer
        self.token = secrets.token_urlsafe(16)
        self._logs_parent = logs_dir
        #: the stacks' configs and logs, made with the first stack; removed after a clean run
        self.workdir: Path | None = None
        self.harnesses: list[RolloutHarness] = []
        self.coordinators: list[Coordinator] = []
        self.kept_pids: dict[str, int] = {}
        #: every task the demo started: cancelled at cleanup, so none outlives it (an interrupt included)
        self._spawned: set[asyncio.Task[Any]] = set()

    def _stop_on_sigterm(self) -> asyncio.Event:
        """SIGTERM cancels the demo (its servers are then stopped); the event tells it came."""
        terminated = asyncio.Event()
        task = asyncio.current_task()

        def stop() -> None:
            if terminated.is_set():  # stopping already: a second SIGTERM must not cut the cleanup short
                return
            terminated.set()
            if task is not None:
                task.cancel()

        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
        return terminated

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
                raise PhaseFailed(f"cannot create the store root {root}: {exc}", EXIT_SETUP) from exc
            if not os.access(root, os.W_OK | os.X_OK):
                raise PhaseFailed(f"the store root {root} is not writable", EXIT_SETUP)
            self.outcome.checkpoint_dir = str(root / name)
        try:
            backend = backend_for_url(self.outcome.checkpoint_dir, **self.storage_options)
            try:
                backend.exists("gym")
            finally:
                backend.close()
        except Exception as exc:
            raise PhaseFailed(f"cannot reach the store {self.outcome.checkpoint_dir}: {exc}", EXIT_SETUP) from exc

    async def _keep(self, stack: RolloutHarness) -> None:
        """Leave the demo stack running (``--keep``): its URLs and process groups for the report."""
        self.outcome.kept_urls = dict(stack.urls)
        self.harnesses.remove(stack)  # not closed by _cleanup
        self.kept_pids = await stack.detach()

    def _keep_traceback(self) -> str:
        """Write the exception being handled to the logs directory; the note saying where (or nothing)."""
        if self.workdir is None:
            return ""
        path = self.workdir / "traceback.txt"
        try:
            path.write_text(traceback.format_exc())
        except OSError:
            return ""
        return f" (an unexpected error: its traceback is in {path})"

    async def _worker_counts(self, stack: RolloutHarness, gym: Coordinator) -> dict[str, int]:
        """Each Gym server's linked workers, as its status says (1 for a single process)."""
        counts = {}
        for name in stack.gym_servers:
            try:
                status = await gym.status(stack.urls[name])
            except Exception as exc:
                raise PhaseFailed(f"the status of {name} failed: {exc}") from exc
            counts[name] = int(status.get("workers", 1))
        return counts

    async def _start_stack(
        self, label: str, storage_options: dict[str, Any] | None = None, *, workers: int = 1
    ) -> RolloutHarness:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="gymckpt-demo-", dir=self._logs_parent))
            self.outcome.logs_dir = str(self.workdir)
        workdir = self.workdir / label
        workdir.mkdir(parents=True, exist_ok=True)
        spec = default_stack_spec(
            token=self.token,
            storage_options=storage_options or None,
            allowed_roots=self._allowed_roots(),
            workers=workers,
            **{"sizes": self.sizes, **self.stack_options},
        )
        try:
            stack = await RolloutHarness.open(spec, workdir=workdir, request_timeout=self.timeout)
        except Exception as exc:
            raise PhaseFailed(f"the {label} stack did not start: {exc}", EXIT_SETUP) from exc
        self.harnesses.append(stack)
        self._note_pids(stack)
        return stack

    def _note_pids(self, stack: RolloutHarness) -> None:
        for pid in stack.pids.values():
            if pid not in self.outcome.server_pids:
                self.outcome.server_pids.append(pid)

    async def _wait_up(self, stack: RolloutHarness, label: str) -> Coordinator:
        """Every Gym server discovered and the inference backend reached, or a failure naming why (and the logs)."""
        exit_code = EXIT_SETUP if label != "demo (restarted)" else EXIT_DIFFERS
        try:
            gym = await stack.wait_ready(timeout=self.timeout)
        except StackNotReady as exc:
            raise PhaseFailed(
                f"the {label} stack did not come up: {exc}{logs_showing_errors(stack)}",
                exit_code,
                log_tails=stack.log_tails(exc.exited),
            ) from exc
        self.coordinators.append(gym)
        self._observe(f"started:{label}", stack)
        return gym

    def _observe(self, event: str, stack: RolloutHarness) -> None:
        if self._observer is not None:
            self._observer(event, stack)

    async def _model_call_count(self, stack: RolloutHarness) -> int:
        """The length of the inference backend's call log; 0 if it cannot be read (it only feeds a count)."""
        try:
            return await stack.model_call_count()
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError):
            return 0

    async def _model_calls(self, stack: RolloutHarness) -> list[dict[str, Any]]:
        """The inference backend's call log; empty if it cannot be read (it only feeds a count)."""
        try:
            calls = await stack.model_calls()
        except (aiohttp.ClientError, TimeoutError):
            return []
        return calls if isinstance(calls, list) else []

    async def _held_calls(self, exported: list[str], completed: list[dict[str, Any]]) -> set[str]:
        """The model calls the checkpoint held (:func:`held_model_calls`); the demo fails if it cannot tell."""
        try:
            return await asyncio.to_thread(
                held_model_calls, self.outcome.checkpoint_dir, self.storage_options, exported, completed
            )
        except Exception as exc:
            raise PhaseFailed(f"reading the checkpoint's model records failed: {exc}") from exc

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
        if self.workdir is not None and self.outcome.exit_code == EXIT_OK and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.outcome.logs_dir = ""


def logs_showing_errors(stack: RolloutHarness) -> str:
    """`` (errors in environment.log, …)``: the servers' logs that show an error, to name on the failure line."""
    names = []
    for server in stack.stack.servers.values():
        try:
            text = server.log_path.read_text(errors="replace")
        except OSError:
            continue
        if "Error" in text or "Traceback" in text:
            names.append(server.log_path.name)
    return f" (errors in {', '.join(names)})" if names else ""
