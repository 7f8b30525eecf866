"""What every reference server shares: its config, its app, and its downstream client."""

from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import orjson
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gymckpt import transport
from gymckpt.control.responses import handle_gymckpt_error
from gymckpt.control.settings import (
    CheckpointSettings,
    GymckptSettings,
    did_you_mean,
    misspellings,
    read_yaml_file,
    settings_problems,
)
from gymckpt.errors import DownstreamError, GymckptError, SettingsError
from gymckpt.identity import rollout_path
from gymckpt.participants.install import install_checkpointing
from gymckpt.participants.rollout import SESSION_HEADER, SessionHeaderMiddleware, current_episode
from gymckpt.store.encoded import exact_size
from gymckpt.workers.process import ENV_RUNTIME, ENV_WORKERS, install_worker
from gymckpt.workers.routing import COOKIE_NAME

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from gymckpt.control.participant import Participant
    from gymckpt.control.plane import ControlPlane
    from gymckpt.identity import EpisodeId

__all__ = [
    "HEALTH_PATH",
    "RELAY_HEADER",
    "CookieRelayMiddleware",
    "Downstream",
    "DownstreamError",
    "ServerConfig",
    "add_health_route",
    "build_app",
    "load_server_config",
    "relayed_cookies",
    "server_workers",
]

C = TypeVar("C", bound="ServerConfig")


class ServerConfig(BaseModel):
    """A server's config file: its own fields plus the ``checkpoint:`` block."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    #: the data pool's bound towards downstream servers in all (None or 0: none beyond the bound per host)
    data_connector_limit: int | None = Field(default=None, ge=0)
    #: and per host, per process (None: :func:`~gymckpt.transport.downstream_pool_limit`, the server's
    #: bound shared among its workers; 0: no limit)
    data_connector_limit_per_host: int | None = Field(default=None, ge=0)
    #: per downstream server, by its base URL (in a stack file ``"{resources}": 1000``), a bound of its
    #: own in place of ``data_connector_limit_per_host`` (0: no limit); its calls go on a pool of their own
    data_connector_limit_by_url: dict[str, int] = Field(default_factory=dict)
    #: how long the data pools keep an idle connection, in seconds (None:
    #: :func:`~gymckpt.transport.client_idle_seconds`, 4 s: below stock uvicorn's and vLLM's 5 s keep-alive).
    #: Keep it below the keep-alive of every server this one calls: gymckpt's own keep 75 s
    #: (``GYMCKPT_KEEP_ALIVE``), so a stack of them only may give 30; a connection dropped sooner
    #: is opened again on the next call, at the cost of a TCP handshake on both sides
    data_connector_idle_seconds: float | None = Field(default=None, gt=0)

    @field_validator("data_connector_limit_by_url")
    @classmethod
    def _bounds_by_url(cls, value: dict[str, int]) -> dict[str, int]:
        for url, bound in value.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is no server's base URL (http://host:port)")
            if bound < 0:
                raise ValueError(f"the bound of {url} must be 0 (no limit) or more, not {bound}")
        return {url.rstrip("/"): bound for url, bound in value.items()}


def load_server_config(cls: type[C], source: str | Path | dict[str, Any] | None = None) -> C:
    """Read ``cls`` from a YAML file or dict; ``GYMCKPT_CHECKPOINT__…`` variables override the block.

    Every mistake is one :class:`~gymckpt.errors.SettingsError` (a ``ValueError``) with a
    ``file: key.path: why`` line per problem: an unknown key (a did-you-mean when it looks
    like one of ``cls``'s: ``chekpoint``, ``Checkpoint``), a bad value, a missing field. A
    file YAML cannot parse is ``"<file>: invalid YAML at line L, column C: …"``.
    """
    path = ""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, dict):
        data = dict(source)
    else:
        path = str(source)
        loaded = read_yaml_file(source) or {}
        if not isinstance(loaded, dict):
            raise SettingsError("a server config must be a mapping", path=path)
        data = loaded
    # a key that looks like a field (even where the class allows others) is refused, never ignored
    typos = misspellings(data, cls.model_fields)
    problems = [(key, did_you_mean(meant)) for key, meant in typos.items()]
    data = {key: value for key, value in data.items() if key not in typos}
    given = {"checkpoint": data["checkpoint"]} if "checkpoint" in data else {}
    try:
        data["checkpoint"] = GymckptSettings(**given).checkpoint
    except ValidationError as exc:
        problems.extend(settings_problems(exc, model=GymckptSettings))
        data.pop("checkpoint", None)  # its problems are listed; the rest is checked without it
    try:
        config = cls.model_validate(data)
    except ValidationError as exc:
        problems.extend(settings_problems(exc, model=cls, given_as=set(typos.values())))
        raise SettingsError(problems, path=path) from None
    if problems:
        raise SettingsError(problems, path=path)
    return config


class Downstream:
    """Calls to other servers for an episode, on a data pool of their own.

    The pool is bounded per host (``connector_limit_per_host``: None for
    :func:`~gymckpt.transport.downstream_pool_limit`, 0 for no limit), in all only when
    ``connector_limit`` is set (a shared bound would queue the short calls to one host, a
    resources server's ``/verify``, behind the long ones to another), and closes idle
    connections before the servers' keep-alive ends (:mod:`gymckpt.transport`). A server named
    in ``limit_by_url`` (base URL → bound) gets a pool of its own at that bound: aiohttp's bound
    in all counts the connections in use, not the idle ones kept for another host, so only
    pools of their own bound what a process holds towards each server. A call a
    checkpoint waits for (``awaited``: a wait step's, an agent's ``/close_session``) goes on
    a small pool of its own (:func:`~gymckpt.transport.awaited_pool_limit` per host), so it
    never queues behind the long calls to the same host (an agent's whole rollout) while a
    checkpoint waits for it.

    With checkpointing on, a call made for an episode (given, or the current request's)
    goes to ``/ng-rollout/<capture key><path>``; with it off, to ``<path>`` unchanged with
    the episode named in the ``x-session-id`` header, the reference servers' session.

    A server with several workers names the worker that holds an episode's session in a
    session cookie (:data:`~gymckpt.workers.routing.COOKIE_NAME`): it is kept per episode and
    server and sent back on that episode's later calls there, so they reach that worker. At
    most :attr:`MAX_EPISODE_COOKIES` episodes keep cookies (the least recently used go first);
    :meth:`forget_episode` drops one's when it ends. A call also carries the episode's cookies
    of the other servers in :data:`RELAY_HEADER`, so the server called (an agent) reaches the
    same workers when it calls them for the episode (:class:`CookieRelayMiddleware` takes them).

    A reply is read up to ``reply_limit`` bytes (None: :func:`~gymckpt.transport.data_reply_limit`);
    a longer one fails that call with :class:`~gymckpt.errors.ReplyTooLarge` (a
    :class:`DownstreamError`), read no further.
    """

    MAX_EPISODE_COOKIES = 65_536

    def __init__(
        self,
        *,
        checkpointing: bool,
        connector_limit: int | None = None,
        connector_limit_per_host: int | None = None,
        limit_by_url: dict[str, int] | None = None,
        reply_limit: int | None = None,
        idle_seconds: float | None = None,
    ) -> None:
        self.checkpointing = checkpointing
        self._limits = (connector_limit, connector_limit_per_host)
        #: how long an idle pooled connection is kept (None: the transport's default)
        self._idle_seconds = idle_seconds
        #: base URL → a bound of its own (its calls go on a pool of their own)
        self._limit_by_url = {url.rstrip("/"): bound for url, bound in (limit_by_url or {}).items()}
        if reply_limit is not None and reply_limit <= 0:
            raise ValueError(f"reply_limit must be a positive number of bytes, not {reply_limit}")
        #: the bound of every reply read, in bytes
        self.reply_limit = transport.data_reply_limit() if reply_limit is None else reply_limit
        #: the data pool (False), the awaited lane (True), and the pool of each server bounded on its own (its URL)
        self._sessions: dict[bool | str, aiohttp.ClientSession] = {}
        #: capture key → server base URL → the session cookie's value
        self._cookies: OrderedDict[str, dict[str, str]] = OrderedDict()

    @classmethod
    def of_config(cls, config: ServerConfig, *, checkpointing: bool) -> Downstream:
        """A server's calls out, with the pool settings of its config (``data_connector_*``)."""
        return cls(
            checkpointing=checkpointing,
            connector_limit=config.data_connector_limit,
            connector_limit_per_host=config.data_connector_limit_per_host,
            limit_by_url=config.data_connector_limit_by_url,
            idle_seconds=config.data_connector_idle_seconds,
        )

    def _client(self, awaited: bool = False, base: str = "") -> aiohttp.ClientSession:
        own = None if awaited else self._limit_by_url.get(base.rstrip("/"))
        lane: bool | str = base.rstrip("/") if own is not None else awaited
        session = self._sessions.get(lane)
        if session is None or session.closed:
            # by default bounded per host only: a slow host's calls never queue another host's behind them
            limit, per_host = self._limits
            limit = 0 if limit is None else limit
            per_host = transport.downstream_pool_limit(workers=server_workers()) if per_host is None else per_host
            if awaited:
                limit, per_host = 0, transport.awaited_pool_limit(per_host)
            elif own is not None:
                # a pool of its own: its idle connections are bounded with it, never beside another host's
                limit = per_host = own
            session = self._sessions[lane] = transport.client_session(
                limit=limit,
                limit_per_host=per_host,
                idle_seconds=self._idle_seconds,
                timeout=aiohttp.ClientTimeout(total=None),
                cookie_jar=aiohttp.DummyCookieJar(),  # one jar would mix every episode's sessions
            )
        return session

    def session_cookie(self, base: str, episode: EpisodeId | None) -> str | None:
        """The session cookie a server at ``base`` gave ``episode`` (None: none yet)."""
        if episode is None:
            return None
        held = self._cookies.get(episode.capture_key)
        return None if held is None else held.get(base.rstrip("/"))

    def _keep_cookie(self, base: str, episode: EpisodeId, value: str) -> None:
        key = episode.capture_key
        held = self._cookies.get(key)
        if held is None:
            held = self._cookies[key] = {}
            while len(self._cookies) > self.MAX_EPISODE_COOKIES:
                self._cookies.popitem(last=False)
        else:
            self._cookies.move_to_end(key)
        held[base.rstrip("/")] = value

    def adopt_cookies(self, episode: EpisodeId, cookies: dict[str, str]) -> None:
        """Keep session cookies a caller relayed for ``episode`` (base URL → value)."""
        for base, value in cookies.items():
            self._keep_cookie(base, episode, value)

    def _relayed(self, base: str, episode: EpisodeId) -> str | None:
        held = self._cookies.get(episode.capture_key)
        if not held:
            return None
        others = {other: value for other, value in held.items() if other != base.rstrip("/")}
        return orjson.dumps(others).decode() if others else None

    def forget_episode(self, episode: EpisodeId) -> None:
        """The episode ended: drop the session cookies it was given."""
        self._cookies.pop(episode.capture_key, None)

    def url(self, base: str, path: str, episode: EpisodeId | None = None) -> str:
        """The URL of ``path`` on ``base`` for ``episode`` (or the current request's)."""
        episode = episode if episode is not None else current_episode()
        if self.checkpointing and episode is not None:
            path = rollout_path(episode, path)
        return base.rstrip("/") + path

    async def post(
        self,
        base: str,
        path: str,
        body: Any,
        *,
        episode: EpisodeId | None = None,
        resend: bool = False,
        awaited: bool = False,
        on_sent: Callable[[], None] | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """POST JSON; return the decoded reply and its headers (lower-cased names).

        An error status raises :class:`DownstreamError` (:meth:`~DownstreamError.answered`),
        and so does a call that got no reply (a refused connect, a dropped connection: its
        ``downstream_status`` is 0, the aiohttp error its ``__cause__``). Only with
        ``resend`` is a call whose reused connection the server closed before replying sent
        once more (:func:`gymckpt.transport.request`): a rollout's steps are not safe to
        send twice (a tool call would count twice, a ``/verify`` find its session ended).
        ``awaited`` sends it on the lane of the calls a checkpoint waits for. ``on_sent`` is
        called once the call has its connection, just before it goes out (not while it waits
        for one in a full pool).
        """
        url = self.url(base, path, episode)
        headers = {"Content-Type": "application/json"}
        episode = episode if episode is not None else current_episode()
        if not self.checkpointing and episode is not None:
            headers[SESSION_HEADER] = episode.capture_key  # no rollout prefix: name the session instead
        cookie = self.session_cookie(base, episode)
        if cookie is not None:
            headers["Cookie"] = f"{COOKIE_NAME}={cookie}"
        relayed = self._relayed(base, episode) if episode is not None else None
        if relayed is not None:
            headers[RELAY_HEADER] = relayed
        try:
            async with transport.request(
                self._client(awaited, base),
                "POST",
                url,
                resend=resend,
                on_connected=on_sent,
                data=exact_size(orjson.dumps(body)),  # held while the call is in flight, often for seconds
                headers=headers,
            ) as response:
                stamped = response.cookies.get(COOKIE_NAME)
                if stamped is not None and episode is not None and stamped.value:
                    self._keep_cookie(base, episode, stamped.value)
                status = response.status
                headers = {name.lower(): value for name, value in response.headers.items()}
                raw = await transport.read_bounded(response, self.reply_limit)
        except aiohttp.ClientError as exc:
            raise DownstreamError(f"{url} gave no reply: {type(exc).__name__}: {exc}", url=url) from exc
        if status >= 400:
            raise DownstreamError.answered(url, status, raw)
        return orjson.loads(raw) if raw else {}, headers

    async def close(self) -> None:
        """Close the data pool and the awaited lane."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


#: the session cookies a caller holds for the request's episode on other servers: JSON ``{base URL: value}``
RELAY_HEADER = "x-ng-session-cookies"
#: the most cookies (and bytes) one relay header may carry; a larger one is ignored
_RELAY_MAX_COOKIES, _RELAY_MAX_BYTES = 32, 16_384


def relayed_cookies(value: bytes) -> dict[str, str]:
    """The cookies of a :data:`RELAY_HEADER` value; anything malformed or too large is none."""
    if len(value) > _RELAY_MAX_BYTES:
        return {}
    try:
        cookies = orjson.loads(value)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(cookies, dict) or len(cookies) > _RELAY_MAX_COOKIES:
        return {}
    return {base: cookie for base, cookie in cookies.items() if isinstance(cookie, str) and cookie.isascii()}


class CookieRelayMiddleware:
    """Take the session cookies a caller relayed for the request's episode into ``downstream``."""

    def __init__(self, app: Any, downstream: Downstream) -> None:
        self.app = app
        self.downstream = downstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            value = next((v for name, v in scope["headers"] if name == RELAY_HEADER.encode()), None)
            episode = current_episode() if value is not None else None
            if value is not None and episode is not None:
                self.downstream.adopt_cookies(episode, relayed_cookies(value))
        await self.app(scope, receive, send)


#: every reference server answers ``GET /health`` with ``{"status": "ok"}``, checkpointing on or off
HEALTH_PATH = "/health"


def add_health_route(app: FastAPI) -> None:
    """``GET /health`` → 200 ``{"status": "ok"}``: a probe, never fenced (``UNFENCED_PATHS``)."""

    @app.get(HEALTH_PATH, tags=["health"])
    async def health() -> dict[str, str]:
        return {"status": "ok"}


def server_workers() -> int:
    """How many workers the server of this process runs: N in a worker ``gymckpt serve KIND --workers N``
    started, else 1."""
    if not os.environ.get(ENV_RUNTIME):
        return 1
    try:
        return max(int(os.environ.get(ENV_WORKERS, "1")), 1)
    except ValueError:
        return 1


def _is_one_of_several_workers() -> bool:
    """True in a worker process ``gymckpt serve KIND --workers N`` started (N above 1)."""
    return server_workers() > 1


def build_app(
    title: str,
    config: ServerConfig,
    participant: Participant | None,
    *,
    on_shutdown: list[Callable[[], Any]] | None = None,
    plane: ControlPlane | None = None,
) -> tuple[FastAPI, ControlPlane | None, Downstream]:
    """A FastAPI app with checkpointing installed as ``config`` says, and its downstream client.

    What runs once per server is the control plane (it owns the checkpoint phases and opens
    the stores): pass one made by :func:`~gymckpt.participants.install.create_control_plane`
    as ``plane``, or one is made here. The app, its middleware and its downstream data pool
    are what each worker process has of its own.
    """
    downstream = Downstream.of_config(config, checkpointing=config.checkpoint.enabled)
    closers = [downstream.close, *(on_shutdown or [])]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for close in closers:
            result = close()
            if hasattr(result, "__await__"):
                await result

    app = FastAPI(title=title, lifespan=lifespan)
    add_health_route(app)
    app.add_exception_handler(GymckptError, handle_gymckpt_error)  # every reference server: one error body
    app.add_middleware(CookieRelayMiddleware, downstream=downstream)  # innermost: the episode is known there
    if _is_one_of_several_workers():
        enabled = config.checkpoint.enabled and participant is not None
        plane = install_worker(  # type: ignore[assignment]
            app, participant if enabled else None, config.checkpoint if enabled else None, dict(os.environ)
        )
    elif participant is not None:
        plane = install_checkpointing(app, participant, config.checkpoint, plane=plane)
    if not config.checkpoint.enabled:
        app.add_middleware(SessionHeaderMiddleware)
    if plane is not None:
        closers.append(plane.close)
    return app, plane, downstream
