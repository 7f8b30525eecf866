"""A controller written from the reference stack's documented wire, for the conformance suite.

It speaks the shapes ``docs/wire.md`` gives for the reference (``NVIDIA-NeMo/Gym``'s
checkpoint stack) and imports nothing from gymckpt, so a test that drives gymckpt's servers
with it checks the wire, not code the two sides share:

- control calls under ``/ng-control/v1/checkpoint/`` with ``Authorization: Bearer <token>``,
  on a connection pool of their own, each fan-out body encoded once;
- episode ids sent as the reference's objects ``{"rollout_id", "attempt"}``;
- every 200 reply parsed strictly (:class:`ReplyShapeError` otherwise) into models of what
  the reference's controller reads: prepare ``phase``/``report``, the commit's ``manifest``
  object and ``episode_ids``, restore ``source_checkpoint_id``/``restored``, resume
  ``phase``/``idempotent``, the retire and forget counts;
- the reference's order: prepare environment → model → agent → resources, stopping at the
  first stage that is not prepared; resume in reverse, every stage even after a failure;
  commit, restore and renew everywhere at once; retire and forget in the groups
  (environment), (agent), (model, resources);
- its own publication, as rollout collection does it: ``<root>/<checkpoint_id>/collection.json``
  and then ``<root>/LATEST`` (:class:`CollectionRoot`), checkpoint ids
  ``ckpt-<YYYYmmddTHHMMSS>-<8 hex>`` and restores under ``restore-<12 hex>``.

:func:`run_episode` is the data side: one environment ``POST /run`` with a reference body.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import aiohttp
import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = [
    "CHECKPOINT_ID_FORMAT",
    "CONTROL_PREFIX",
    "PREPARE_ORDER",
    "RESTORE_ID_FORMAT",
    "RETIRE_ORDER",
    "CollectionManifest",
    "CollectionRoot",
    "CommitReply",
    "CoordinationFailed",
    "EpisodeRef",
    "ForgetReply",
    "ManifestObject",
    "Member",
    "ParticipantError",
    "PrepareOutcome",
    "PrepareReply",
    "PrepareReport",
    "ReferenceController",
    "ReplyShapeError",
    "RenewReply",
    "RestoreReply",
    "ResumeReply",
    "RetireReply",
    "RunReply",
    "StatusReply",
    "new_checkpoint_id",
    "new_restore_id",
    "run_episode",
]

CONTROL_PREFIX = "/ng-control/v1/checkpoint"
Kind = Literal["environment", "model", "agent", "resources"]
PREPARE_ORDER: tuple[Kind, ...] = ("environment", "model", "agent", "resources")
RETIRE_ORDER: tuple[tuple[Kind, ...], ...] = (("environment",), ("agent",), ("model", "resources"))
#: each control call may take until its deadline plus this many seconds
REPLY_SLACK_SECONDS = 5.0
#: discover: tries per server on connection errors, the pause between them, the bound of one probe
DISCOVER_TRIES = 3
DISCOVER_PAUSE_SECONDS = 0.5
DISCOVER_TIMEOUT_SECONDS = 60.0
#: the most blockers a prepare report lists
MAX_BLOCKERS = 100

CHECKPOINT_ID_FORMAT = re.compile(r"ckpt-[0-9]{8}T[0-9]{6}-[0-9a-f]{8}")
RESTORE_ID_FORMAT = re.compile(r"restore-[0-9a-f]{12}")
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)\Z")
_RECORDS_FILE = re.compile(r"records(-[0-9a-f]{64})?\.jsonl")

M = TypeVar("M", bound=BaseModel)


# ----------------------------------------------------------------------------- episode ids


class EpisodeRef(BaseModel):
    """The reference's episode id: one attempt of one rollout (``attempt`` defaults to 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: StrictStr = Field(min_length=1)
    attempt: StrictInt = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _grammar(self) -> EpisodeRef:
        if _ROLLOUT_ID.fullmatch(self.rollout_id) is None:
            raise ValueError(f"rollout id {self.rollout_id!r} is outside the grammar")
        if _ATTEMPT_SUFFIX.search(self.rollout_id) is not None:
            raise ValueError(f"rollout id {self.rollout_id!r} ends with the reserved attempt suffix")
        return self

    @classmethod
    def from_capture_key(cls, key: str) -> EpisodeRef:
        """``r`` → attempt 0 of ``r``; ``r-aN`` (N ≥ 1, no leading zero) → attempt N of ``r``."""
        match = _ATTEMPT_SUFFIX.search(key)
        if match is None:
            return cls(rollout_id=key, attempt=0)
        return cls(rollout_id=key[: match.start()], attempt=int(match.group(1)))

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> EpisodeRef:
        return EpisodeRef(rollout_id=self.rollout_id, attempt=self.attempt + 1)

    def wire(self) -> dict[str, Any]:
        """The object sent on the wire."""
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


def _capture_keys(keys: list[str]) -> list[str]:
    for key in keys:
        EpisodeRef.from_capture_key(key)
    return keys


def _sorted_unique(keys: list[str]) -> list[str]:
    if keys != sorted(set(keys)):
        raise ValueError(f"capture keys must be sorted and unique: {keys}")
    return keys


CaptureKeys = Annotated[list[StrictStr], AfterValidator(_capture_keys)]
SortedCaptureKeys = Annotated[list[StrictStr], AfterValidator(_capture_keys), AfterValidator(_sorted_unique)]
Count = Annotated[StrictInt, Field(ge=0)]


# ----------------------------------------------------------------------------- replies


class _Reply(BaseModel):
    """A reply the controller reads: the fields it needs, strictly typed; other keys are allowed."""

    model_config = ConfigDict(extra="allow", frozen=True)


class PrepareReport(_Reply):
    ready: StrictBool
    blockers: CaptureKeys = Field(max_length=MAX_BLOCKERS)
    blocker_count: Count
    counts: dict[StrictStr, StrictInt]
    restarts: CaptureKeys

    @model_validator(mode="after")
    def _consistent(self) -> PrepareReport:
        if self.blocker_count < len(self.blockers):
            raise ValueError("blocker_count is below the number of blockers listed")
        if self.ready and self.blocker_count:
            raise ValueError("a ready report lists blockers")
        return self


class PrepareReply(_Reply):
    phase: Literal["preparing", "prepared"]
    report: PrepareReport

    @model_validator(mode="after")
    def _ready_when_prepared(self) -> PrepareReply:
        if self.phase == "prepared" and not self.report.ready:
            raise ValueError("phase prepared with a report that is not ready")
        return self


class StatusReply(_Reply):
    kind: Kind
    instance: StrictStr
    phase: Literal["idle", "preparing", "prepared", "committed", "restored"]
    checkpoint_id: StrictStr | None
    lease_expires_at: StrictFloat | StrictInt | None
    retired_rollouts: Count
    report: PrepareReport


class ManifestObject(_Reply):
    """A participant's manifest as the commit reply carries it (participant extras are extra keys)."""

    schema_version: Literal[1]
    kind: Kind
    instance: StrictStr
    checkpoint_id: StrictStr
    records_file: Annotated[StrictStr, Field(pattern="^" + _RECORDS_FILE.pattern + "$")]
    records_sha256: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]
    record_count: Count


class CommitReply(_Reply):
    phase: Literal["committed"]
    manifest: ManifestObject
    episode_ids: SortedCaptureKeys


class RestoreReply(_Reply):
    phase: Literal["restored"]
    source_checkpoint_id: StrictStr
    restored: SortedCaptureKeys


class ResumeReply(_Reply):
    phase: Literal["idle"]
    idempotent: StrictBool


class RenewReply(_Reply):
    lease_expires_at: StrictFloat | StrictInt


class RetireReply(_Reply):
    """``{retired_count}`` (the design texts), or ``{retired: [keys]}`` (the reference's code versions)."""

    retired_count: Count | None = None
    retired: CaptureKeys | None = None

    @model_validator(mode="after")
    def _either(self) -> RetireReply:
        if self.retired_count is None and self.retired is None:
            raise ValueError("a retire reply carries retired_count (or retired)")
        return self

    @property
    def count(self) -> int:
        return self.retired_count if self.retired_count is not None else len(self.retired or [])


class ForgetReply(_Reply):
    """``{forgotten_count}`` (the design texts), or ``{forgotten: [ids]}`` (the reference's code versions)."""

    forgotten_count: Count | None = None
    forgotten: list[StrictStr] | None = None

    @model_validator(mode="after")
    def _either(self) -> ForgetReply:
        if self.forgotten_count is None and self.forgotten is None:
            raise ValueError("a forget reply carries forgotten_count (or forgotten)")
        return self

    @property
    def count(self) -> int:
        return self.forgotten_count if self.forgotten_count is not None else len(self.forgotten or [])


class _ErrorDetail(BaseModel):
    code: StrictStr
    detail: StrictStr


class _ErrorReply(BaseModel):
    error: _ErrorDetail


class TaskId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: StrictStr = Field(min_length=1)
    task_id: StrictStr = Field(min_length=1)


class RunFailure(BaseModel):
    """A failed episode; ``failure_kind`` and ``stage`` are left out when there is none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_reason: StrictStr = Field(max_length=2000)
    terminal: StrictBool
    failure_kind: StrictStr | None = None
    stage: StrictStr | None = None


class RunReply(BaseModel):
    """An environment ``/run`` reply: exactly one of ``result`` and ``failure``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episode_id: EpisodeRef
    task_id: TaskId
    result: Any = None
    failure: RunFailure | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_outcome(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("result" in data) == ("failure" in data):
            raise ValueError("a /run reply carries exactly one of result and failure")
        return data


# ----------------------------------------------------------------------------- errors


class ReferenceControllerError(RuntimeError):
    """Something a participant answered that the reference controller treats as a failure."""


class ParticipantError(ReferenceControllerError):
    """A non-200 reply; ``code`` is the envelope's ``error.code`` (None without an envelope)."""

    def __init__(self, url: str, route: str, status: int, code: str | None, detail: str) -> None:
        self.url = url
        self.route = route
        self.status = status
        self.code = code
        self.detail = detail
        super().__init__(f"{route} on {url}: {status} {code or '(no error envelope)'}: {detail}")


class ReplyShapeError(ReferenceControllerError):
    """A 200 reply the reference controller could not read."""

    def __init__(self, url: str, route: str, body: Any, problem: str) -> None:
        self.url = url
        self.route = route
        self.body = body
        super().__init__(f"{route} on {url} replied a body of another shape: {problem}; body {body!r}")


class CoordinationFailed(ReferenceControllerError):
    """A fan-out that failed on some servers: ``failures`` maps each server to its error."""

    def __init__(self, operation: str, failures: dict[str, BaseException]) -> None:
        self.operation = operation
        self.failures = dict(sorted(failures.items()))
        listed = "; ".join(f"{url}: {error}" for url, error in self.failures.items())
        super().__init__(f"checkpoint {operation} failed on {len(self.failures)} participant(s): {listed}")


def _parse(model: type[M], url: str, route: str, body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ReplyShapeError(url, route, body, str(exc)) from exc


def _participant_error(url: str, route: str, status: int, raw: bytes) -> ParticipantError:
    try:
        envelope = _ErrorReply.model_validate_json(raw)
    except ValidationError:
        return ParticipantError(url, route, status, None, raw.decode(errors="replace")[:500])
    return ParticipantError(url, route, status, envelope.error.code, envelope.error.detail)


# ----------------------------------------------------------------------------- the controller


@dataclass(frozen=True)
class Member:
    """One participant: its base URL, kind and instance (from its status)."""

    url: str
    kind: Kind
    instance: str


@dataclass(frozen=True)
class SentCall:
    """One control call as sent: where, which route, the body (decoded)."""

    url: str
    route: str
    body: dict[str, Any]


@dataclass
class PrepareOutcome:
    """Whether every stage prepared; the replies of the stages that were called."""

    prepared: bool
    replies: dict[str, PrepareReply]
    #: the kinds called, in order (a stage that is not prepared is the last)
    stages: list[Kind] = field(default_factory=list)

    def blockers(self) -> dict[str, list[str]]:
        """Each server that is not prepared, with the blockers it reported."""
        return {url: reply.report.blockers for url, reply in self.replies.items() if reply.phase != "prepared"}

    def restarts(self) -> set[EpisodeRef]:
        """Episodes some server cannot capture: they start over after a crash."""
        return {EpisodeRef.from_capture_key(key) for reply in self.replies.values() for key in reply.report.restarts}

    def continued(self, episode_ids: Iterable[EpisodeRef]) -> list[EpisodeRef]:
        """The commit scope: ``episode_ids`` without the restarts, in order."""
        restarts = self.restarts()
        return [episode for episode in episode_ids if episode not in restarts]


class ReferenceController:
    """Drives the participants at ``servers`` (base URLs) the way the reference's controller does.

    ``connector_limit`` and ``connector_limit_per_host`` size the control pool (0: no
    limit). :attr:`sent` lists every control call made, in order.
    """

    def __init__(
        self,
        servers: Iterable[str],
        token: str,
        *,
        connector_limit: int = 0,
        connector_limit_per_host: int = 0,
        discover_timeout: float = DISCOVER_TIMEOUT_SECONDS,
    ) -> None:
        self.servers = [url.rstrip("/") for url in servers]
        self.token = token
        self.connector_limit = connector_limit
        self.connector_limit_per_host = connector_limit_per_host
        self.discover_timeout = discover_timeout
        self.members: list[Member] = []
        self.sent: list[SentCall] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ReferenceController:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.connector_limit, limit_per_host=self.connector_limit_per_host)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    @property
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}

    def of_kind(self, *kinds: Kind) -> list[Member]:
        return [member for member in self.members if member.kind in kinds]

    # --- one call

    async def status(self, url: str) -> StatusReply:
        """One server's ``GET status``."""
        route = "status"
        timeout = aiohttp.ClientTimeout(total=self.discover_timeout)
        async with self._client().get(
            f"{url}{CONTROL_PREFIX}/{route}", headers=self._headers, timeout=timeout
        ) as reply:
            raw = await reply.read()
            if reply.status != 200:
                raise _participant_error(url, route, reply.status, raw)
        return _parse(StatusReply, url, route, orjson.loads(raw))

    async def call(self, url: str, route: str, body: dict[str, Any], deadline_ts: float) -> dict[str, Any]:
        """One ``POST <route>`` with ``body``; the reply body of a 200, else :class:`ParticipantError`."""
        return await self._post(url, route, body, orjson.dumps(body), deadline_ts)

    async def _post(
        self, url: str, route: str, body: dict[str, Any], payload: bytes, deadline_ts: float
    ) -> dict[str, Any]:
        self.sent.append(SentCall(url, route, body))
        timeout = aiohttp.ClientTimeout(total=max(deadline_ts - time.time(), 0.0) + REPLY_SLACK_SECONDS)
        async with self._client().post(
            f"{url}{CONTROL_PREFIX}/{route}", data=payload, headers=self._headers, timeout=timeout
        ) as reply:
            raw = await reply.read()
            if reply.status != 200:
                raise _participant_error(url, route, reply.status, raw)
        decoded = orjson.loads(raw)
        if not isinstance(decoded, dict):
            raise ReplyShapeError(url, route, decoded, "not a JSON object")
        return decoded

    async def _fan_out(
        self, members: Sequence[Member], route: str, body: dict[str, Any], deadline_ts: float, model: type[M]
    ) -> dict[str, M]:
        """``route`` on every member at once, the body encoded once; every failure in one error."""
        payload = orjson.dumps(body)

        async def one(member: Member) -> M:
            return _parse(model, member.url, route, await self._post(member.url, route, body, payload, deadline_ts))

        outcomes = await asyncio.gather(*(one(member) for member in members), return_exceptions=True)
        failures: dict[str, BaseException] = {}
        replies: dict[str, M] = {}
        for member, outcome in zip(members, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                failures[member.url] = outcome
            else:
                replies[member.url] = outcome
        if failures:
            raise CoordinationFailed(route, failures)
        return replies

    # --- discover

    async def discover(self) -> list[Member]:
        """Every participant among :attr:`servers`, sorted by (prepare order, URL); 404 is no participant."""
        found: list[Member] = []
        failures: dict[str, BaseException] = {}

        async def probe(url: str) -> None:
            try:
                status = await asyncio.wait_for(self._probe(url), self.discover_timeout)
            except ParticipantError as exc:
                if exc.status != 404:
                    failures[url] = exc
            except Exception as exc:
                failures[url] = exc
            else:
                found.append(Member(url, status.kind, status.instance))

        await asyncio.gather(*(probe(url) for url in self.servers))
        if failures:
            raise CoordinationFailed("discover", failures)
        if not any(member.kind == "model" for member in found):
            raise CoordinationFailed(
                "discover", {"deployment": ReferenceControllerError("no policy model takes part in checkpoints")}
            )
        self.members = sorted(found, key=lambda member: (PREPARE_ORDER.index(member.kind), member.url))
        return self.members

    async def _probe(self, url: str) -> StatusReply:
        """``GET status``, tried again after a connection error, with the reference's fixed pause between tries."""
        for _ in range(DISCOVER_TRIES - 1):
            try:
                return await self.status(url)
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(DISCOVER_PAUSE_SECONDS)
        return await self.status(url)

    # --- the operations

    async def prepare(self, checkpoint_id: str, *, deadline_ts: float) -> PrepareOutcome:
        """Prepare stage by stage; stop at the first stage with a server that is not prepared."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        outcome = PrepareOutcome(prepared=True, replies={})
        for kind in PREPARE_ORDER:
            members = self.of_kind(kind)
            if not members:
                continue
            outcome.stages.append(kind)
            stage = await self._fan_out(members, "prepare", body, deadline_ts, PrepareReply)
            outcome.replies.update(stage)
            if any(reply.phase != "prepared" for reply in stage.values()):
                outcome.prepared = False
                return outcome
        return outcome

    async def renew(self, checkpoint_id: str, *, deadline_ts: float) -> dict[str, RenewReply]:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        return await self._fan_out(self.members, "renew", body, deadline_ts, RenewReply)

    async def commit(
        self,
        checkpoint_id: str,
        checkpoint_dir: str,
        episode_ids: Sequence[EpisodeRef] | None,
        *,
        deadline_ts: float,
        stop: bool = False,
    ) -> dict[str, CommitReply]:
        """Commit everywhere at once; ``episode_ids=None`` leaves the field out (export everything)."""
        body: dict[str, Any] = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
        }
        if episode_ids is not None:
            body["episode_ids"] = [episode.wire() for episode in episode_ids]
        body["stop"] = stop
        return await self._fan_out(self.members, "commit", body, deadline_ts, CommitReply)

    async def restore(
        self, checkpoint_id: str, checkpoint_dir: str, episode_ids: Sequence[EpisodeRef], *, deadline_ts: float
    ) -> dict[str, RestoreReply]:
        """Restore everywhere at once, all or nothing: on failure retire the next attempts, resume, raise."""
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": [episode.wire() for episode in episode_ids],
        }
        try:
            return await self._fan_out(self.members, "restore", body, deadline_ts, RestoreReply)
        except CoordinationFailed:
            cleanup_deadline = max(deadline_ts, time.time() + 30)
            try:
                await self.retire(
                    checkpoint_id, [episode.next_attempt() for episode in episode_ids], deadline_ts=cleanup_deadline
                )
            finally:
                await self.resume(checkpoint_id, deadline_ts=cleanup_deadline)
            raise

    async def resume(self, checkpoint_id: str, *, deadline_ts: float) -> dict[str, ResumeReply]:
        """Resume stage by stage in reverse; every stage is tried, and the failures are raised at the end."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        replies: dict[str, ResumeReply] = {}
        failures: dict[str, BaseException] = {}
        for kind in reversed(PREPARE_ORDER):
            members = self.of_kind(kind)
            if not members:
                continue
            try:
                replies.update(await self._fan_out(members, "resume", body, deadline_ts, ResumeReply))
            except CoordinationFailed as exc:
                failures.update(exc.failures)
        if failures:
            raise CoordinationFailed("resume", failures)
        return replies

    async def retire(
        self, checkpoint_id: str, episode_ids: Sequence[EpisodeRef], *, deadline_ts: float
    ) -> dict[str, RetireReply]:
        """Retire in groups, callers first; no episode: no call."""
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "episode_ids": [episode.wire() for episode in episode_ids],
        }
        return await self._in_retire_order("retire", body, deadline_ts, RetireReply) if episode_ids else {}

    async def forget(
        self, checkpoint_id: str, rollout_ids: Iterable[str], *, deadline_ts: float
    ) -> dict[str, ForgetReply]:
        """Forget in the retire groups; no rollout: no call."""
        rollouts = sorted(set(rollout_ids))
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "rollout_ids": rollouts}
        return await self._in_retire_order("forget", body, deadline_ts, ForgetReply) if rollouts else {}

    async def _in_retire_order(
        self, route: str, body: dict[str, Any], deadline_ts: float, model: type[M]
    ) -> dict[str, M]:
        replies: dict[str, M] = {}
        for kinds in RETIRE_ORDER:
            members = self.of_kind(*kinds)
            if members:
                replies.update(await self._fan_out(members, route, body, deadline_ts, model))
        return replies


# ----------------------------------------------------------------------------- publication


def new_checkpoint_id() -> str:
    """``ckpt-<YYYYmmddTHHMMSS>-<8 hex>``, as rollout collection names its checkpoints."""
    return f"ckpt-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def new_restore_id() -> str:
    """``restore-<12 hex>``: the fresh id a restore runs under."""
    return f"restore-{uuid.uuid4().hex[:12]}"


class CollectionManifest(BaseModel):
    """``collection.json``: the controller's own record of a checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_id: StrictStr
    run_id: StrictStr
    created_at: StrictFloat
    continued: list[EpisodeRef]
    restarted: list[EpisodeRef] = Field(default_factory=list)


class CollectionRoot:
    """A directory of checkpoints, ``<root>/<checkpoint_id>/``, and the ``LATEST`` pointer that publishes one."""

    MANIFEST = "collection.json"
    LATEST = "LATEST"

    def __init__(self, root: Path) -> None:
        self.root = root

    def checkpoint_dir(self, checkpoint_id: str) -> Path:
        return self.root / checkpoint_id

    def publish(self, manifest: CollectionManifest) -> Path:
        """Write the checkpoint's ``collection.json``, then point ``LATEST`` at it (each atomically)."""
        target = self.checkpoint_dir(manifest.checkpoint_id)
        _atomic_write(target / self.MANIFEST, orjson.dumps(manifest.model_dump(mode="json")))
        _atomic_write(self.root / self.LATEST, manifest.checkpoint_id.encode())
        return target

    def latest(self) -> tuple[Path, CollectionManifest] | None:
        """The published checkpoint ``LATEST`` names, with its manifest (None: nothing published)."""
        pointer = self.root / self.LATEST
        if not pointer.exists():
            return None
        target = self.checkpoint_dir(pointer.read_text().strip())
        return target, CollectionManifest.model_validate_json((target / self.MANIFEST).read_bytes())


def _atomic_write(path: Path, payload: bytes) -> None:
    """Temporary file beside ``path``, fsync, rename over it, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# ----------------------------------------------------------------------------- the data side


async def run_episode(
    session: aiohttp.ClientSession, environment_url: str, episode: EpisodeRef, task: dict[str, Any]
) -> RunReply:
    """One environment ``POST /run`` with the reference's body; the parsed reply of a 200."""
    url = environment_url.rstrip("/")
    async with session.post(f"{url}/run", json={"episode_id": episode.wire(), "task": task}) as reply:
        raw = await reply.read()
        if reply.status != 200:
            raise _participant_error(url, "run", reply.status, raw)
    return _parse(RunReply, url, "run", orjson.loads(raw))
