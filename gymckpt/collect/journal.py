"""A collection's two local files: the results (one line per row that ended) and the dispatch log.

Results (``--out``): each line is a row's ``_ng_*`` fields (rollout id, task and rollout
index, attempt) and either ``"result"`` (the environment's) or ``"failure"``
(``{"failure_reason", "terminal"}``). Lines are appended as replies arrive, flushed at
once and fsynced at every checkpoint and at the end; when a row ran twice (a failure,
then a later attempt), its last line wins. A partial last line (the collector was
killed mid-write) is cut off when the file is opened again; any other damaged line is an
error, never silently dropped.

The dispatch log (beside it, ``<stem>.dispatch.jsonl``) says which attempt of which row
this run may have sent: its first line ``{"run_id": ...}``, then ``[rollout_id, attempt]``
before each ``/run``. It is fsynced before the request leaves (writes of concurrent
dispatches share one fsync), so after any crash a resume knows every attempt that may
still run somewhere and fences it.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gymckpt.errors import InvalidDataset

__all__ = ["DispatchLog", "PriorRun", "ResultsFile", "dispatch_log_path"]


def dispatch_log_path(results: str | Path) -> Path:
    """``results.jsonl`` → ``results.dispatch.jsonl`` (beside it)."""
    path = Path(results)
    return path.with_name(f"{path.stem}.dispatch.jsonl")


def _cut_partial_tail(path: Path, data: bytes) -> bytes:
    """Drop an unterminated last line (a write the crash interrupted) from the file and from ``data``."""
    if not data or data.endswith(b"\n"):
        return data
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as stream:
        stream.truncate(keep)
        stream.flush()
        os.fsync(stream.fileno())
    return data[:keep]


class ResultsFile:
    """The results file: :meth:`load` what earlier runs wrote, then :meth:`append` as rows end."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stream: Any = None

    def load(self) -> dict[str, dict[str, Any]]:
        """The last line of each rollout id already in the file (none if it does not exist)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        data = _cut_partial_tail(self.path, data)
        lines: dict[str, dict[str, Any]] = {}
        for number, raw in enumerate(data.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise InvalidDataset(f"a damaged results line ({exc})", path=str(self.path), line=number) from None
            if not isinstance(value, dict) or not isinstance(value.get("_ng_rollout_id"), str):
                raise InvalidDataset("a results line without _ng_rollout_id", path=str(self.path), line=number)
            lines[value["_ng_rollout_id"]] = value
        return lines

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = open(self.path, "ab")  # noqa: SIM115 (closed by close())

    def append(self, line: dict[str, Any]) -> None:
        """Write one line and flush it (it survives the collector's death; fsync comes with :meth:`sync`)."""
        self._stream.write(orjson.dumps(line) + b"\n")
        self._stream.flush()

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.flush()
            os.fsync(self._stream.fileno())

    def close(self) -> None:
        if self._stream is not None:
            self.sync()
            self._stream.close()
            self._stream = None


def ended(line: dict[str, Any] | None) -> bool:
    """Whether a results line ends its row for good: a result, or a terminal failure."""
    if line is None:
        return False
    if "result" in line:
        return True
    failure = line.get("failure")
    return isinstance(failure, dict) and bool(failure.get("terminal"))


@dataclass
class PriorRun:
    """What an earlier run's dispatch log says: its id and the highest attempt of each row it sent."""

    run_id: str
    attempts: dict[str, int] = field(default_factory=dict)


class DispatchLog:
    """The dispatch log of this run (see the module notes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._pending: list[bytes] = []
        self._waiters: list[asyncio.Future[None]] = []
        self._flusher: asyncio.Task[None] | None = None

    def read(self) -> PriorRun | None:
        """The earlier run's log, or None without one; a partial last line is ignored."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        lines = data.split(b"\n")
        try:
            header = orjson.loads(lines[0])
            prior = PriorRun(str(header["run_id"]))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise InvalidDataset("the dispatch log has no run_id header", path=str(self.path), line=1) from None
        for raw in lines[1:]:
            try:
                rollout_id, attempt = orjson.loads(raw)
            except (orjson.JSONDecodeError, ValueError, TypeError):
                continue  # the partial last line of a killed run
            if isinstance(rollout_id, str) and isinstance(attempt, int):
                prior.attempts[rollout_id] = max(attempt, prior.attempts.get(rollout_id, -1))
        return prior

    def start(self, run_id: str, carried: dict[str, int]) -> None:
        """Begin this run's log: the header and the attempts carried over, replacing the old log atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.part")
        body = orjson.dumps({"run_id": run_id}) + b"\n"
        body += b"".join(orjson.dumps([key, attempt]) + b"\n" for key, attempt in sorted(carried.items()))
        with open(temp, "wb") as stream:
            stream.write(body)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    async def record(self, rollout_id: str, attempt: int) -> None:
        """Log that ``attempt`` of ``rollout_id`` is about to be sent; returns once it is on disk."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(orjson.dumps([rollout_id, attempt]) + b"\n")
        self._waiters.append(waiter)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await waiter

    async def _flush(self) -> None:
        while self._pending:
            chunk, waiters = b"".join(self._pending), self._waiters
            self._pending, self._waiters = [], []
            try:
                await asyncio.to_thread(self._write, chunk)
            except BaseException as exc:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                raise
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _write(self, chunk: bytes) -> None:
        assert self._fd is not None, "start() first"
        view = memoryview(chunk)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
