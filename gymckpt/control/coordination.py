"""The controller's side: drive every server's control plane in the right order.

Order: prepare environment → model → agent → resources; resume in reverse; commit
everywhere at once; restore all or nothing; retire and forget callers before callees
(environment, then agent, then model and resources); renew everyone. Control calls use
their own aiohttp connection pool, so data calls that hold every connection (parked
``/run`` calls) cannot starve them, and each fan-out body is encoded once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from gymckpt import errors
from gymckpt.control.models import CommitReply, PrepareReply, RestoreReply
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.store import open_store

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = [
    "KIND_ORDER",
    "Coordinator",
    "DiscoverResult",
    "ParticipantInfo",
    "PrepareResult",
    "runs_to_await",
]

KIND_ORDER = ("environment", "model", "agent", "resources")
_RETIRE_GROUPS = (("environment",), ("agent",), ("model", "resources"))
#: extra seconds a call may take past its deadline so the server's own deadline reply arrives
_REPLY_SLACK = 5.0


@dataclass(frozen=True)
class ParticipantInfo:
    """One server's participant, as discover found it."""

    url: str
    kind: str
    instance: str


@dataclass
class DiscoverResult:
    """Participants that answered, and servers that did not (with why)."""

    participants: list[ParticipantInfo] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class PrepareResult:
    """Every participant's prepare reply."""

    replies: dict[str, PrepareReply]

    @property
    def ready(self) -> bool:
        """True when every participant is prepared."""
        return all(reply.report.ready and reply.phase == "prepared" for reply in self.replies.values())

    def blockers(self) -> dict[str, list[str]]:
        """Blocking capture keys per server (each list capped by the server at 100)."""
        return {url: reply.report.blockers for url, reply in self.replies.items() if reply.report.blocker_count}

    def restarts(self) -> set[str]:
        """Every rollout some server cannot capture: never exported; after a crash it starts over."""
        return {key for reply in self.replies.values() for key in reply.report.restarts}

    def continued(self, episode_ids: Iterable[str]) -> list[str]:
        """The commit scope: the episodes the controller continues, restarts left out."""
        restarts = self.restarts()
        return sorted({key for key in episode_ids if key not in restarts})


def runs_to_await(outstanding: Iterable[str], *, committed: Iterable[str], restarts: Iterable[str]) -> list[str]:
    """The outstanding ``/run`` calls to wait for before building the checkpoint's rollout set.

    Only those whose episode is neither committed nor a restart: restarts keep running
    through the checkpoint, and committed episodes continue from their records.
    """
    skip = set(committed) | set(restarts)
    return sorted(key for key in outstanding if key not in skip)


class Coordinator:
    """Drives the control planes of a set of servers (base URLs like ``http://127.0.0.1:8001``).

    Parameters
    ----------
    servers:
        Base URLs of every server taking part.
    token:
        The control bearer token the servers share.
    connector_limit, connector_limit_per_host:
        Size of the reserved control connection pool (0: no limit).
    probe_timeout, probe_retries:
        Bound discover: each probe's timeout and how many connection attempts it makes.
    storage_options:
        For :meth:`publish`, which writes ``checkpoint.json`` through the store.
    """

    def __init__(
        self,
        servers: Iterable[str],
        *,
        token: str,
        connector_limit: int = 0,
        connector_limit_per_host: int = 0,
        probe_timeout: float = 5.0,
        probe_retries: int = 3,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if connector_limit < 0 or connector_limit_per_host < 0:
            raise ValueError("control connector limits must be >= 0")
        self.servers = [url.rstrip("/") for url in servers]
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._limits = (connector_limit, connector_limit_per_host)
        self.probe_timeout = probe_timeout
        self.probe_retries = probe_retries
        self.storage_options = dict(storage_options or {})
        self.kinds: dict[str, ParticipantInfo] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            limit, per_host = self._limits
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=per_host)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def close(self) -> None:
        """Close the control connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- one call

    async def _call(self, url: str, op: str, body: bytes | None, *, timeout: float) -> dict[str, Any]:
        endpoint = f"{url}{CONTROL_PREFIX}/{op}"
        client_timeout = aiohttp.ClientTimeout(total=max(timeout, 0.1))
        try:
            if body is None:
                response_cm = self._client().get(endpoint, timeout=client_timeout)
            else:
                response_cm = self._client().post(endpoint, data=body, timeout=client_timeout)
            async with response_cm as response:
                raw = await response.read()
                status = response.status
        except TimeoutError as exc:
            raise errors.ServerCallFailed(f"{url}: {op} got no reply within {timeout:.1f} s") from exc
        except aiohttp.ClientError as exc:
            raise errors.ServerCallFailed(f"{url}: {op} failed: {exc}") from exc
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.ServerCallFailed(f"{url}: {op} replied {status} with a body that is not JSON") from exc
        if status >= 400:
            error = payload.get("error", {}) if isinstance(payload, dict) else {}
            code = str(error.get("code", "unknown"))
            cls = errors.error_for_code(code) or errors.ServerCallFailed
            raised = cls(f"{url}: {op}: {error.get('detail', raw[:200])}")
            raised.server = url  # type: ignore[attr-defined]
            raised.wire_code = code  # type: ignore[attr-defined]
            raise raised
        return payload  # type: ignore[no-any-return]

    async def _fan_out(self, urls: Iterable[str], op: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The same encoded body to every server at once; raise the first failure after all settle."""
        urls = list(urls)
        encoded = orjson.dumps(body)
        timeout = body["deadline_ts"] - time.time() + _REPLY_SLACK
        outcomes = await asyncio.gather(
            *(self._call(url, op, encoded, timeout=timeout) for url in urls), return_exceptions=True
        )
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failures:
            raise failures[0]
        return dict(zip(urls, outcomes, strict=True))  # type: ignore[arg-type]

    def _by_kind(self, kinds: Iterable[str]) -> list[str]:
        wanted = set(kinds)
        return [url for url in self.servers if self._kind(url) in wanted]

    def _kind(self, url: str) -> str:
        info = self.kinds.get(url)
        if info is None:
            raise errors.InvalidPhase(f"{url} was not discovered; call discover() first")
        return info.kind

    # --- operations

    async def discover(self) -> DiscoverResult:
        """Ask every server for its participant; servers that fail are reported, not waited on."""
        result = DiscoverResult()

        async def probe(url: str) -> None:
            last = ""
            for _attempt in range(max(self.probe_retries, 1)):
                try:
                    status = await self._call(url, "status", None, timeout=self.probe_timeout)
                except errors.ServerCallFailed as exc:
                    last = str(exc)
                    if "no reply within" in last:
                        break  # it accepted the connection and stayed silent: retrying only waits longer
                    continue
                except errors.GymckptError as exc:
                    last = str(exc)
                    break
                kind = status.get("kind")
                if kind not in KIND_ORDER:
                    last = f"{url}: unknown participant kind {kind!r}"
                    break
                info = ParticipantInfo(url, kind, str(status.get("instance")))
                self.kinds[url] = info
                result.participants.append(info)
                return
            result.problems[url] = last

        await asyncio.gather(*(probe(url) for url in self.servers))
        result.participants.sort(key=lambda info: (KIND_ORDER.index(info.kind), info.url))
        return result

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareResult:
        """Prepare kind by kind: environment, model, agent, resources."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        replies: dict[str, PrepareReply] = {}
        for kind in KIND_ORDER:
            answered = await self._fan_out(self._by_kind([kind]), "prepare", body)
            replies.update({url: PrepareReply.model_validate(reply) for url, reply in answered.items()})
        return PrepareResult(replies)

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> None:
        """Extend every participant's lease."""
        await self._fan_out(self.servers, "renew", {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts})

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str, episode_ids: Iterable[str]
    ) -> dict[str, CommitReply]:
        """Commit everywhere concurrently with one scope."""
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": sorted(set(episode_ids)),
        }
        answered = await self._fan_out(self.servers, "commit", body)
        return {url: CommitReply.model_validate(reply) for url, reply in answered.items()}

    async def publish(
        self, checkpoint_dir: str, commits: dict[str, CommitReply], *, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write ``gym/checkpoint.json`` last, create-only, listing every committed manifest."""
        missing = sorted(set(self.servers) - set(commits))
        if missing:
            raise errors.InvalidPhase(f"publish needs every server's commit; missing {missing}")

        def write() -> dict[str, Any]:
            store = open_store(checkpoint_dir, **self.storage_options)
            try:
                manifests = []
                for reply in commits.values():
                    manifest = store.read_manifest("", kind=reply.kind, instance=reply.instance)
                    if manifest.sha256 != reply.manifest_sha256:
                        raise errors.CheckpointIndexInvalid(
                            "the stored manifest differs from the one its commit reported", path=manifest.path
                        )
                    manifests.append(manifest)
                return store.publish("", manifests, extra=extra)
            finally:
                store.close()

        return await asyncio.to_thread(write)

    async def resume(self, checkpoint_id: str, deadline_ts: float) -> None:
        """Resume kind by kind in reverse order: resources, agent, model, environment."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        failure: BaseException | None = None
        for kind in reversed(KIND_ORDER):
            try:
                await self._fan_out(self._by_kind([kind]), "resume", body)
            except errors.GymckptError as exc:
                failure = failure or exc  # keep resuming the others: none should stay closed
        if failure is not None:
            raise failure

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: str, episode_ids: Iterable[str]
    ) -> dict[str, RestoreReply]:
        """Restore on every server, all or nothing.

        On any failure the replacement attempts are retired everywhere, every participant
        is resumed, and the restore's error is raised (not a cleanup error).
        """
        scope = sorted(set(episode_ids))
        body = {
            "checkpoint_id": checkpoint_id,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": scope,
        }
        try:
            answered = await self._fan_out(self.servers, "restore", body)
        except BaseException as failure:
            replacements = [capture_key(rollout, attempt + 1) for rollout, attempt in map(split_capture_key, scope)]
            cleanup_deadline = max(deadline_ts, time.time() + 30.0)
            try:
                if replacements:
                    await self.retire(replacements, checkpoint_id=checkpoint_id, deadline_ts=cleanup_deadline)
            except errors.GymckptError:
                pass  # the restore's error is the one to raise
            try:
                await self.resume(checkpoint_id, cleanup_deadline)
            except errors.GymckptError:
                pass
            raise failure
        return {url: RestoreReply.model_validate(reply) for url, reply in answered.items()}

    async def retire(self, episode_ids: Iterable[str], *, checkpoint_id: str, deadline_ts: float) -> int:
        """Retire attempts everywhere, callers before callees; return the total retired count."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "episode_ids": sorted(set(episode_ids))}
        total = 0
        for group in _RETIRE_GROUPS:
            answered = await self._fan_out(self._by_kind(group), "retire", body)
            total += sum(reply["retired_count"] for reply in answered.values())
        return total

    async def forget(self, rollout_ids: Iterable[str], *, checkpoint_id: str, deadline_ts: float) -> int:
        """End the refusal of these rollouts everywhere, in retire's order; return the total count."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "rollout_ids": sorted(set(rollout_ids))}
        total = 0
        for group in _RETIRE_GROUPS:
            answered = await self._fan_out(self._by_kind(group), "forget", body)
            total += sum(reply["forgotten_count"] for reply in answered.values())
        return total
