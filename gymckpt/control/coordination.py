"""The controller's side: drive every server's control plane in the right order.

Order: prepare environment → model → agent → resources, stopping at the first stage that
is not prepared (the later stages are never called, so their admission stays open);
resume in reverse; commit everywhere at once; restore all or nothing; retire and forget
callers before callees (environment, then agent, then model and resources); renew
everyone. Control calls use their own aiohttp connection pool, so data calls that hold
every connection (parked ``/run`` calls) cannot starve them, and each operation's body is
encoded once. The pool drops idle connections before the servers' keep-alive ends
(:mod:`gymckpt.transport`), and a control call whose reused connection the server closed
before replying is sent once more: every one of them is idempotent with the same body
(:data:`RESENT_OPERATIONS`).

On the wire the Coordinator speaks the reference stack's shapes: episode ids go out as
``{"rollout_id", "attempt"}`` objects, forget sends plain rollout ids, commit sends
``stop``. It reads both gymckpt's and the reference's replies: a commit reply whose
``manifest`` is the manifest object (with or without gymckpt's extra keys), retire and
forget counts or lists, errors in the ``{"error": {"code", "detail"}}`` envelope or
FastAPI's bare ``{"detail": [...]}`` 422.

A restore takes only a published checkpoint, exactly as published: the Coordinator reads
``gym/checkpoint.json`` and sends each server that checks it its manifest's digest
(:mod:`gymckpt.control.restore_source`). Every reply is read within its route's bound
(:data:`~gymckpt.control.replies.CONTROL_REPLY_LIMITS`); a longer one is that server's
failure (:class:`~gymckpt.errors.ReplyTooLarge`).

Every fan-out that fails on some servers raises one :class:`~gymckpt.errors.CoordinationError`
naming each of them; its ``causes`` hold the typed per-server errors (the class of each
server's wire code, with ``server``, ``wire_code`` and ``http_status`` attributes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, TypeVar

from gymckpt import errors, telemetry
from gymckpt.control.coordination_calls import (
    RESENT_OPERATIONS,
    ControlCalls,
    connection_failed,
    encode_body,
    pool_options,
)
from gymckpt.control.coordination_results import (
    DiscoverResult,
    EpisodeLike,
    ParticipantInfo,
    PrepareResult,
    reported_roots,
    runs_to_await,
    scope_keys,
)
from gymckpt.control.models import Phase, PrepareReply
from gymckpt.control.replies import (
    CONTROL_REPLY_LIMITS,
    ParticipantCommit,
    ParticipantRestore,
    counter,
    failed,
    parser,
)
from gymckpt.control.restore_source import RESTORE_CHECKS, read_published, restore_bodies
from gymckpt.identity import EpisodeId, episode_object
from gymckpt.store import open_store
from gymckpt.store.codec import decode_document

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    import aiohttp

    from gymckpt.control.settings import CheckpointSettings, GymckptSettings
    from gymckpt.store import CheckpointIndex

__all__ = [
    "DEFAULT_PROBE_BACKOFF",
    "DEFAULT_PROBE_TIMEOUT",
    "KIND_ORDER",
    "NO_POLICY_MODEL",
    "RESENT_OPERATIONS",
    "Coordinator",
    "DiscoverResult",
    "ParticipantCommit",
    "ParticipantInfo",
    "ParticipantRestore",
    "PrepareResult",
    "runs_to_await",
]

logger = logging.getLogger(__name__)

KIND_ORDER = ("environment", "model", "agent", "resources")
_RETIRE_GROUPS = (("environment",), ("agent",), ("model", "resources"))
#: bound of one server's whole discover probe (every try and pause), as in the reference stack
DEFAULT_PROBE_TIMEOUT = 60.0
#: the first pause between discover tries after a connection error; it doubles up to the cap
DEFAULT_PROBE_BACKOFF = 0.5
DEFAULT_PROBE_BACKOFF_MAX = 5.0
#: the problem discover reports under the key ``"deployment"`` when no model participant answered
NO_POLICY_MODEL = "no policy model takes part in checkpoints"
_DEPLOYMENT = "deployment"
T = TypeVar("T")


class Coordinator(ControlCalls):
    """Drives the control planes of a set of servers (base URLs like ``http://127.0.0.1:8001``).

    Parameters
    ----------
    servers:
        Base URLs of every server taking part.
    token:
        The control bearer token the servers share.
    connector_limit, connector_limit_per_host:
        Size of the reserved control connection pool (0: no limit, as the settings say: a
        fan-out makes one call per server at a time, so the pool holds about one
        connection per server).
    probe_timeout:
        Bound of one server's whole discover probe, every try and pause included, in
        seconds. 60 by default, as in the reference stack: a server just restarted behind
        a kept socket accepts connections at once but answers only once its process has
        started. A server that accepts and stays silent is not tried again.
    probe_retries:
        How many tries a probe makes in all when it cannot connect (or the connection drops).
    probe_backoff, probe_backoff_max:
        The pause after the first failed try; it doubles after each further one, up to the cap.
    storage_options:
        For :meth:`publish` and :meth:`restore`, which write and read ``checkpoint.json`` through the store.
    reply_limits:
        Reply bounds in bytes by operation, overriding
        :data:`~gymckpt.control.replies.CONTROL_REPLY_LIMITS` (a model whose episodes stage very
        many keys may need a larger ``commit``). A longer reply fails that server's call with
        :class:`~gymckpt.errors.ReplyTooLarge`, read no further.
    """

    def __init__(
        self,
        servers: Iterable[str],
        *,
        token: str,
        connector_limit: int = 0,
        connector_limit_per_host: int = 0,
        probe_timeout: float = DEFAULT_PROBE_TIMEOUT,
        probe_retries: int = 3,
        probe_backoff: float = DEFAULT_PROBE_BACKOFF,
        probe_backoff_max: float = DEFAULT_PROBE_BACKOFF_MAX,
        storage_options: dict[str, Any] | None = None,
        reply_limits: Mapping[str, int] | None = None,
    ) -> None:
        if connector_limit < 0 or connector_limit_per_host < 0:
            raise ValueError("control connector limits must be >= 0")
        if probe_backoff < 0 or probe_backoff_max < 0:
            raise ValueError("probe backoff must be >= 0")
        self.servers = [url.rstrip("/") for url in servers]
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._limits = (connector_limit, connector_limit_per_host)
        self.probe_timeout = probe_timeout
        self.probe_retries = probe_retries
        self.probe_backoff = probe_backoff
        self.probe_backoff_max = probe_backoff_max
        self.storage_options = dict(storage_options or {})
        for op, limit in (reply_limits or {}).items():
            if op not in CONTROL_REPLY_LIMITS or type(limit) is not int or limit <= 0:
                raise ValueError(f"reply_limits: {op!r}: {limit!r} is not a positive byte count of a control route")
        #: each operation's reply bound in bytes
        self.reply_limits = {**CONTROL_REPLY_LIMITS, **(reply_limits or {})}
        #: the participants the last discover found, by URL
        self.kinds: dict[str, ParticipantInfo] = {}
        #: servers the last discover found to be no participant (status answered 404)
        self.skipped: list[str] = []
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_settings(
        cls,
        servers: Iterable[str],
        settings: CheckpointSettings | GymckptSettings | Mapping[str, Any],
        **overrides: Any,
    ) -> Coordinator:
        """A coordinator configured from checkpoint settings; ``overrides`` win over them.

        ``settings`` is a :class:`~gymckpt.control.settings.CheckpointSettings` (the
        ``checkpoint:`` block), a :class:`~gymckpt.control.settings.GymckptSettings`, or a
        config mapping. Read from the block: ``control_auth_token`` (the token),
        ``control_connector_limit``, ``control_connector_limit_per_host`` (the control
        pool) and ``storage_options``. A mapping's ``checkpoint:`` block is validated by
        :func:`~gymckpt.control.settings.load_settings`; its top-level
        ``global_aiohttp_control_connector_limit`` and
        ``global_aiohttp_control_connector_limit_per_host`` (the reference stack's names)
        size the pool too, and disagreeing with the block's own value is a ``ValueError``.
        A missing token is a ``ValueError``.
        """
        options = {**pool_options(settings), **overrides}
        if not options.get("token"):
            raise ValueError("checkpoint.control_auth_token is not set: the coordinator needs the servers' token")
        return cls(servers, **options)

    @property
    def connector_limit(self) -> int:
        return self._limits[0]

    @property
    def connector_limit_per_host(self) -> int:
        return self._limits[1]

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _participants(self, kinds: Iterable[str] | None = None) -> list[str]:
        """The discovered participants (of these kinds), in the order of :attr:`servers`."""
        wanted = None if kinds is None else set(kinds)
        found = []
        for url in self.servers:
            if url in self.skipped:
                continue
            info = self.kinds.get(url)
            if info is None:
                raise errors.InvalidPhase(f"{url} was not discovered; call discover() first")
            if wanted is None or info.kind in wanted:
                found.append(url)
        return found

    # --- discover

    async def discover(self, *, require_model: bool = True) -> DiscoverResult:
        """Ask every server for its participant; failures are reported in the result, not raised.

        A server whose status answers 404 is no participant: it is listed in
        ``skipped``. Each probe is bounded by :attr:`probe_timeout`; a connection that
        fails is tried again (:attr:`probe_retries` tries in all) after a pause that
        doubles from :attr:`probe_backoff`. An unknown kind is a problem. When every server
        answered but none is a policy model, ``problems["deployment"]`` says so
        (``require_model=False`` for a coordinator of only some servers). Call
        :meth:`DiscoverResult.raise_for_problems` to raise them all as one error.
        """
        result = DiscoverResult()
        self.kinds = {}
        self.skipped = []
        outcomes = await asyncio.gather(*(self._probe(url) for url in self.servers), return_exceptions=True)
        for url, outcome in zip(self.servers, outcomes, strict=True):
            if isinstance(outcome, ParticipantInfo):
                self.kinds[url] = outcome
                result.participants.append(outcome)
            elif outcome is None:
                self.skipped.append(url)
            elif isinstance(outcome, Exception):
                result._report(url, outcome)
            else:
                raise outcome  # type: ignore[misc]
        self.skipped.sort()
        result.skipped = list(self.skipped)
        result.participants.sort(key=lambda info: (KIND_ORDER.index(info.kind), info.url))
        if require_model and not result.problems and not any(info.kind == "model" for info in result.participants):
            result._report(_DEPLOYMENT, errors.GymckptError(NO_POLICY_MODEL))
        return result

    async def status(self, url: str) -> dict[str, Any]:
        """One server's status reply (within :attr:`probe_timeout`)."""
        return await self._call(url, "status", None, timeout=self.probe_timeout)  # type: ignore[no-any-return]

    async def _probe(self, url: str) -> ParticipantInfo | None:
        """One server's participant, or None when it has none (404); raises why it failed."""
        give_up = time.monotonic() + self.probe_timeout
        tries = max(self.probe_retries, 1)
        for attempt in range(tries):
            try:
                status = await self._call(url, "status", None, timeout=give_up - time.monotonic())
            except errors.GymckptError as exc:
                if getattr(exc, "http_status", None) == 404:
                    return None
                pause = min(self.probe_backoff * 2**attempt, self.probe_backoff_max)
                last_try = attempt + 1 >= tries or time.monotonic() + pause >= give_up
                if last_try or not connection_failed(exc):
                    raise
                await self._pause(pause)
                continue
            kind = status.get("kind")
            if kind not in KIND_ORDER:
                raise failed(url, f"unknown participant kind {kind!r}")
            checks = status.get("restore_checks")
            checked = frozenset(name for name in checks if isinstance(name, str)) if isinstance(checks, list) else ()
            reported, roots = reported_roots(status)
            return ParticipantInfo(url, kind, str(status.get("instance")), frozenset(checked), roots, reported)
        raise AssertionError("unreachable: the last try returns or raises")  # pragma: no cover

    async def _pause(self, seconds: float) -> None:
        """The pause between two discover tries."""
        await asyncio.sleep(seconds)

    # --- operations

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareResult:
        """Prepare kind by kind (environment, model, agent, resources), stopping at the first stage not prepared.

        The stages after it are never called: their admission stays open. Resume
        everyone afterwards either way (the servers never called answer it as a no-op).
        """
        with telemetry.operation("coordinate.prepare", **self._traced(checkpoint_id)) as op:
            encoded = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts})
            replies: dict[str, PrepareReply] = {}
            for kind in KIND_ORDER:
                urls = self._participants([kind])
                with telemetry.step(f"coordinate.prepare.{kind}", participants=len(urls)):
                    stage = await self._fan_out("prepare", urls, encoded, deadline_ts, parser(PrepareReply))
                replies.update(stage)
                if any(reply.phase != Phase.PREPARED for reply in stage.values()):
                    op.set(prepared=False, stopped_at=kind)
                    return PrepareResult(False, replies, stopped_at=kind)
            op.set(prepared=True)
            return PrepareResult(True, replies)

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, dict[str, Any]]:
        """Extend every participant's lease; return each one's reply."""
        with telemetry.operation("coordinate.renew", **self._traced(checkpoint_id)):
            encoded = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts})
            return await self._fan_out("renew", self._participants(), encoded, deadline_ts)

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeLike] | None,
        *,
        stop: bool = False,
    ) -> dict[str, ParticipantCommit]:
        """Commit everywhere concurrently with one scope; return each participant's reply.

        ``episode_ids`` None sends no scope (every live episode is exported, no restored
        state deleted). ``stop``: the controller stops after this checkpoint instead of
        resuming, and the participants free what their exported state holds outside.
        """
        with telemetry.operation("coordinate.commit", **self._traced(checkpoint_id)) as op:
            scope = None if episode_ids is None else [episode_object(key) for key in scope_keys(episode_ids)]
            body = {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "checkpoint_dir": checkpoint_dir,
                "episode_ids": scope,
                "stop": stop,
            }
            if scope is not None:
                op.set(episodes=len(scope))
            replies = await self._fan_out(
                "commit", self._participants(), encode_body(body), deadline_ts, parser(ParticipantCommit)
            )
            op.set(
                records=sum(reply.record_count or 0 for reply in replies.values()),
                bytes=sum(reply.records_bytes or 0 for reply in replies.values()),
            )
            return replies

    async def publish(
        self, checkpoint_dir: str, commits: dict[str, ParticipantCommit], *, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write ``gym/checkpoint.json`` last, create-only, listing every committed manifest.

        Each manifest is read back first and must be the one its commit reported: the same
        sha256 when the reply carries one (gymckpt's servers), else the same JSON object.
        """
        missing = sorted(set(self._participants()) - set(commits))
        if missing:
            raise errors.InvalidPhase(f"publish needs every participant's commit; missing {missing}")

        def write() -> dict[str, Any]:
            store = open_store(checkpoint_dir, **self.storage_options)
            try:
                manifests = [self._read_back(store, reply) for reply in commits.values()]
                return store.publish("", manifests, extra=extra)
            finally:
                store.close()

        return await asyncio.to_thread(write)

    @staticmethod
    def _read_back(store: Any, reply: ParticipantCommit) -> Any:
        manifest = store.read_manifest("", kind=reply.kind, instance=reply.instance)
        if manifest.path != reply.manifest_path:
            raise errors.CheckpointIndexInvalid(
                f"the commit reported its manifest at {reply.manifest_path!r}", path=manifest.path
            )
        if reply.manifest_sha256 is not None:
            same = manifest.sha256 == reply.manifest_sha256
        else:
            same = decode_document(manifest.raw) == reply.manifest
        if not same:
            raise errors.CheckpointIndexInvalid(
                "the stored manifest differs from the one its commit reported", path=manifest.path
            )
        return manifest

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> dict[str, dict[str, Any]]:
        """Resume kind by kind in reverse order (resources, agent, model, environment); return each reply.

        A stage that fails does not stop the others (none should stay closed): every
        failure is raised at the end, as one CoordinationError.
        """
        with telemetry.operation("coordinate.resume", **self._traced(checkpoint_id)):
            encoded = encode_body({"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts})
            replies: dict[str, dict[str, Any]] = {}
            causes: dict[str, BaseException] = {}
            for kind in reversed(KIND_ORDER):
                try:
                    replies.update(await self._fan_out("resume", self._participants([kind]), encoded, deadline_ts))
                except errors.CoordinationError as exc:
                    causes.update(exc.causes)
            if causes:
                raise errors.CoordinationError("resume", causes)
            return replies

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str, episode_ids: Iterable[EpisodeLike]
    ) -> dict[str, ParticipantRestore]:
        """Restore on every server, all or nothing; ``episode_ids`` are the checkpointed attempts.

        Only a published checkpoint is restored, exactly as published: ``gym/checkpoint.json``
        is read first (with :attr:`storage_options`) and every manifest it lists must still
        hash as listed (:func:`~gymckpt.control.restore_source.read_published`; no index is
        :class:`~gymckpt.errors.CheckpointUnpublished`), and each participant must be listed.
        A server that checks them (its status lists ``restore_checks``) is sent its manifest's
        digest and the checkpoint's id, and refuses a manifest replaced since. Either way
        nothing is sent and nothing installed when the checkpoint is not as published.

        On any failure of a server the replacement attempts are retired everywhere, every
        participant is resumed (both by ``max(deadline_ts, now + 30 s)``), and the restore's
        error is raised (a cleanup error is only logged).
        """
        with telemetry.operation("coordinate.restore", **self._traced(checkpoint_id)) as op:
            scope = scope_keys(episode_ids)
            body = {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "checkpoint_dir": checkpoint_dir,
                "episode_ids": [episode_object(key) for key in scope],
            }
            urls = self._participants()
            op.set(episodes=len(scope))
            index = await asyncio.to_thread(self._read_published, checkpoint_dir)
            participants = {url: (self.kinds[url].kind, self.kinds[url].instance) for url in urls}
            checking = {url for url in urls if self.kinds[url].restore_checks.issuperset(RESTORE_CHECKS)}
            bodies = restore_bodies(participants, checking, index, encode_body(body))
            try:
                return await self._fan_out("restore", urls, bodies, deadline_ts, parser(ParticipantRestore))
            except errors.CoordinationError:
                await self._undo_restore(checkpoint_id, deadline_ts, scope)
                raise

    def _read_published(self, checkpoint_dir: str) -> CheckpointIndex:
        """``gym/checkpoint.json`` of ``checkpoint_dir``, its manifests checked (blocking: run off the loop)."""
        store = open_store(checkpoint_dir, **self.storage_options)
        try:
            return read_published(store)
        finally:
            store.close()

    async def _undo_restore(self, checkpoint_id: str, deadline_ts: float, scope: list[str]) -> None:
        replacements = [EpisodeId.from_capture_key(key).next_attempt().capture_key for key in scope]
        cleanup_deadline = max(deadline_ts, time.time() + 30.0)
        try:
            await self.retire(replacements, checkpoint_id=checkpoint_id, deadline_ts=cleanup_deadline)
        except errors.CoordinationError:
            logger.warning("checkpoint %s: retiring the restored attempts failed", checkpoint_id, exc_info=True)
        try:
            await self.resume(checkpoint_id, cleanup_deadline)
        except errors.CoordinationError:
            logger.warning("checkpoint %s: resuming after a failed restore failed", checkpoint_id, exc_info=True)

    async def retire(self, episode_ids: Iterable[EpisodeLike], *, checkpoint_id: str, deadline_ts: float) -> int:
        """Retire attempts everywhere, callers before callees; return the total retired count.

        No episode: no call, 0.
        """
        with telemetry.operation("coordinate.retire", **self._traced(checkpoint_id)) as op:
            keys = scope_keys(episode_ids)
            op.set(episodes=len(keys))
            if not keys:
                return 0
            body = {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "episode_ids": [episode_object(key) for key in keys],
            }
            return await self._in_retire_order(
                "retire", encode_body(body), deadline_ts, counter("retired_count", "retired")
            )

    async def forget(self, rollout_ids: Iterable[str], *, checkpoint_id: str, deadline_ts: float) -> int:
        """End the refusal of these rollouts everywhere, in retire's order; return the total count.

        No rollout: no call, 0.
        """
        with telemetry.operation("coordinate.forget", **self._traced(checkpoint_id)) as op:
            ids = sorted(set(rollout_ids))
            op.set(rollouts=len(ids))
            if not ids:
                return 0
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "rollout_ids": ids}
            return await self._in_retire_order(
                "forget", encode_body(body), deadline_ts, counter("forgotten_count", "forgotten")
            )

    async def _in_retire_order(
        self, op: str, encoded: bytes, deadline_ts: float, count: Callable[[str, str, dict[str, Any]], int]
    ) -> int:
        total = 0
        for group in _RETIRE_GROUPS:
            urls = self._participants(group)
            if urls:
                total += sum((await self._fan_out(op, urls, encoded, deadline_ts, count)).values())
        return total
