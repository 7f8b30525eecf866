"""The harness's reads of the inference backend never queue behind its ``/run`` calls.

At a checkpoint every connection of the trainer's ``/run`` pool can be held by a rollout that
waits at the servers until the crash; the demo then still reads the call log. A real
aiohttp server on 127.0.0.1 stands in for the environment and the inference backend (the
layer under test is the harness's client side), with the ``/run`` pool bounded to one
connection through ``GYMCKPT_POOL_LIMIT``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from gymckpt.stack.harness import RolloutHarness

#: bounds each wait of the test (a read queued behind the held /run would wait until then)
WAIT = 20.0


async def _observed_while_every_run_connection_is_held() -> dict[str, Any]:
    arrived, release = asyncio.Event(), asyncio.Event()

    async def run(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response({"result": {"reward": 1.0}})

    def answer(body: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(body)

        return handler

    app = web.Application()
    app.router.add_post("/run", run)
    app.router.add_get("/calls", answer([{"call_id": "c-0"}]))
    app.router.add_get("/calls/count", answer({"count": 1}))
    app.router.add_get("/turns", answer({"rollouts_by_turn": {"2": 1}}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    stack = SimpleNamespace(servers={}, urls={"environment": base, "inference": base})
    harness = RolloutHarness(stack, "token", request_timeout=WAIT)  # type: ignore[arg-type]
    held = asyncio.create_task(harness.run("0-0", {"index": 0}))
    try:
        async with asyncio.timeout(WAIT):
            await arrived.wait()
            seen = {
                "calls": await harness.model_calls(),
                "count": await harness.model_call_count(),
                "turns": await harness.rollouts_by_turn(),
            }
        release.set()
        seen["run"] = await asyncio.wait_for(held, WAIT)
        return seen
    finally:
        release.set()
        await asyncio.gather(held, return_exceptions=True)
        await harness.detach()
        await runner.cleanup()


def test_the_call_log_and_turns_are_read_while_every_run_connection_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYMCKPT_POOL_LIMIT", "1")
    seen = asyncio.run(_observed_while_every_run_connection_is_held())
    assert seen["calls"] == [{"call_id": "c-0"}]
    assert seen["count"] == 1
    assert seen["turns"] == {"2": 1}
    assert seen["run"]["result"] == {"reward": 1.0}
