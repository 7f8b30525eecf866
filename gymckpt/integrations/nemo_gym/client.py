"""NeMo Gym's ``ServerClient``, as its agents use it, for the rollout the agent serves.

:class:`CheckpointedServerClient` is NeMo Gym's client with two things added:

- every call made while serving a rollout carries its prefix (``/ng-rollout/<capture
  key>/…``), so a checkpointed server knows whose call it is (``unprefixed_servers`` are
  called as they are);
- inside an agent activation (:mod:`gymckpt.integrations.nemo_gym.agent`) each call is an
  episode step journaled with its reply (:mod:`gymckpt.integrations.nemo_gym.journal`): a
  model call is a ``replay`` step, a tool call a ``wait`` step, ``/seed_session`` a replay
  step and ``/verify`` what the resources server said on its seed reply. After a restore
  the journaled calls are answered from the journal. A call to the agent's own server
  (NeMo Gym's ``SimpleAgent.run`` calls its own ``/v1/responses``) runs in this process,
  inside the same activation, whatever worker would have taken it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_gym.server_utils import ServerClient
from pydantic import BaseModel, PrivateAttr

from gymckpt.identity import rollout_path
from gymckpt.integrations.nemo_gym.config import MODELS, RESOURCES
from gymckpt.integrations.nemo_gym.context import IN_PROCESS_KEY, active_activation
from gymckpt.integrations.nemo_gym.journal import RecordedResponse, entry_of, request_digest
from gymckpt.participants.rollout import current_episode
from gymckpt.participants.steps import StepMode
from gymckpt.workers.routing import COOKIE_NAME as ROUTING_COOKIE

if TYPE_CHECKING:
    from gymckpt.integrations.nemo_gym.context import ActiveActivation

__all__ = ["VERIFY_HEADER", "CheckpointedServerClient"]

#: the resources server's seed reply says whether its /verify may run again after a crash
VERIFY_HEADER = "x-ng-checkpoint-verify"


class CheckpointedServerClient(ServerClient):
    """NeMo Gym's ServerClient that sends the rollout prefix and journals an agent's calls (module notes)."""

    _own_name: str = PrivateAttr(default="")
    _checkpointing: bool = PrivateAttr(default=False)
    _unprefixed: frozenset[str] = PrivateAttr(default=frozenset())
    _app: Any = PrivateAttr(default=None)

    def configure(self, *, own_name: str, checkpointing: bool, unprefixed: list[str], app: Any = None) -> None:
        """Which server this is, whether checkpointing is on, whom to call unprefixed, the app for own calls."""
        self._own_name = own_name
        self._checkpointing = checkpointing
        self._unprefixed = frozenset(unprefixed)
        self._app = app

    def _server_type(self, server_name: str) -> str:
        entry = self.global_config_dict.get(server_name)
        return str(next(iter(entry.keys()))) if entry is not None and len(entry) == 1 else ""

    def _mode(self, server_name: str, path: str, active: ActiveActivation) -> StepMode:
        kind = self._server_type(server_name)
        if kind == MODELS or (kind == RESOURCES and path == "/seed_session"):
            return StepMode.REPLAY
        if kind == RESOURCES and path == "/verify" and active.verify_modes.get(server_name) == "replay":
            return StepMode.REPLAY
        return StepMode.WAIT  # a tool call, a wait verify, another agent: the checkpoint waits for it

    async def request(self, server_name: str, url_path: str, method: str, **kwargs: Any) -> Any:
        """NeMo Gym's call, prefixed for the rollout; inside an activation a journaled step."""
        if isinstance(kwargs.get("json"), BaseModel):
            kwargs["json"] = kwargs["json"].model_dump(exclude_unset=True)  # as NeMo Gym sends it
        active = active_activation()
        if active is not None and server_name == self._own_name and self._app is not None:
            return await self._in_process(url_path, method, kwargs)
        episode = current_episode()
        path = url_path
        if self._checkpointing and episode is not None and server_name not in self._unprefixed:
            path = rollout_path(episode, url_path)
        if active is None:
            return await super().request(server_name, path, method, **kwargs)
        digest = request_digest(server_name, method, url_path, kwargs.get("json"))
        _keep_routing_cookie(kwargs, active.routing_cookies.get(server_name))
        url = f"{self._base(server_name)}{path}"
        journaled = active.journal.replayed(digest, server_name, url_path)
        if journaled is not None:
            reply = RecordedResponse.from_entry(url, method, journaled)
            self._noted(server_name, url_path, reply, active)
            return reply

        async def send() -> tuple[RecordedResponse, dict[str, Any]]:
            response = await ServerClient.request(self, server_name, path, method, **kwargs)
            try:
                body = await response.read()
            finally:
                response.release()
            headers = [(str(name), str(value)) for name, value in response.headers.items()]  # multidict names are istr
            recorded = RecordedResponse(url, method, response.status, headers, body)
            return recorded, entry_of(digest, server_name, url_path, response.status, headers, body)

        reply, _ = await active.activation.step(
            self._mode(server_name, url_path, active), send, boundary=lambda result: active.journal.record(result[1])
        )
        self._noted(server_name, url_path, reply, active)
        return reply

    @staticmethod
    def _noted(server_name: str, path: str, reply: RecordedResponse, active: ActiveActivation) -> None:
        """What a reply says for the activation's later calls: the verify mode, the worker holding the session."""
        if path == "/seed_session":
            active.verify_modes[server_name] = reply.headers.get(VERIFY_HEADER, "wait")
        routing = reply.cookies.get(ROUTING_COOKIE)
        if routing is not None and routing.value:
            active.routing_cookies[server_name] = routing.value

    def _base(self, server_name: str) -> str:
        from nemo_gym.global_config import get_first_server_config_dict

        return self._build_server_base_url(get_first_server_config_dict(self.global_config_dict, server_name))

    async def _in_process(self, url_path: str, method: str, kwargs: dict[str, Any]) -> RecordedResponse:
        """A call to this very server: through its app in this task (the same activation, the same worker)."""
        import orjson

        body = orjson.dumps(kwargs["json"]) if kwargs.get("json") is not None else b""
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        cookie = _cookie_header(kwargs.get("cookies"))
        if cookie:
            headers.append((b"cookie", cookie.encode("latin-1")))
        path, _, query = url_path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method.upper(),
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
            "state": {},
            IN_PROCESS_KEY: True,
        }
        sent = {"done": False}

        async def receive() -> dict[str, Any]:
            if sent["done"]:
                return {"type": "http.disconnect"}
            sent["done"] = True
            return {"type": "http.request", "body": body, "more_body": False}

        reply: dict[str, Any] = {"status": 500, "headers": [], "body": bytearray()}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                reply["status"] = message["status"]
                reply["headers"] = [
                    (name.decode("latin-1"), value.decode("latin-1")) for name, value in message.get("headers", [])
                ]
            elif message["type"] == "http.response.body":
                reply["body"].extend(message.get("body", b""))

        await self._app(scope, receive, send)
        return RecordedResponse(
            f"http://in-process{url_path}", method, reply["status"], reply["headers"], bytes(reply["body"])
        )


def _keep_routing_cookie(kwargs: dict[str, Any], routing: str | None) -> None:
    """Send the routing cookie a server gave the rollout, where the agent passes only its own cookies on.

    NeMo Gym's agents pass on the cookies of the last reply; a server with several workers
    sets gymckpt's routing cookie only on the first, so the later calls would reach any worker.
    """
    if routing is None:
        return
    cookies = {name: getattr(value, "value", value) for name, value in (kwargs.get("cookies") or {}).items()}
    cookies.setdefault(ROUTING_COOKIE, routing)
    kwargs["cookies"] = cookies


def _cookie_header(cookies: Any) -> str:
    """A ``Cookie`` header from what NeMo Gym passes as ``cookies=`` (a mapping of names to values or morsels)."""
    if not cookies:
        return ""
    parts = []
    for name, value in cookies.items():
        parts.append(f"{name}={getattr(value, 'value', value)}")
    return "; ".join(parts)
