"""An app that answers which episode its request ran as, behind the rollout-prefix middleware.

Served by tests/participants/test_rollout_keepalive.py in a real uvicorn process:
``uvicorn --factory tests.participants.keepalive_app:app``.
"""

from __future__ import annotations

from typing import Any

import orjson

from gymckpt.participants.rollout import RolloutPrefixMiddleware, current_episode


async def episode_echo(scope: Any, receive: Any, send: Any) -> None:
    """Read the whole body, then reply ``{"episode": <capture key or null>, "received": <bytes>}``."""
    assert scope["type"] == "http"
    received, more = 0, True
    while more:
        message = await receive()
        received += len(message.get("body", b""))
        more = message.get("more_body", False)
    episode = current_episode()
    body = orjson.dumps({"episode": episode.capture_key if episode else None, "received": received})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def app() -> Any:
    """The factory uvicorn calls."""
    return RolloutPrefixMiddleware(episode_echo)
