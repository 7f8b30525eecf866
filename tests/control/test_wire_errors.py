"""One explicit wire-code table (``gymckpt.errors.WIRE_ERRORS``): one class per code, used by the coordinator."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from aiohttp import web

from gymckpt import errors
from gymckpt.control.coordination import Coordinator
from gymckpt.control.routes import CONTROL_PREFIX
from gymckpt.errors import ServerCallFailed


def _classes_defining_a_code() -> list[type[errors.GymckptError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if cls.__module__ == errors.__name__ and issubclass(cls, errors.GymckptError) and "code" in cls.__dict__
    ]


def test_every_class_that_defines_a_code_is_in_the_table_under_it_and_no_code_twice() -> None:
    defining = _classes_defining_a_code()
    codes = [cls.__dict__["code"] for cls in defining]
    duplicates = sorted({code for code in codes if codes.count(code) > 1})
    assert duplicates == [], f"codes defined by more than one class: {duplicates}"
    for cls in defining:
        assert errors.WIRE_ERRORS.get(cls.code) is cls, cls
        assert errors.error_for_code(cls.code) is cls
    assert set(errors.WIRE_ERRORS.values()) == set(defining)
    assert all(code == cls.code for code, cls in errors.WIRE_ERRORS.items())
    assert errors.error_for_code("no_such_code") is None


def test_shared_codes_belong_to_one_base_class_and_subclasses_keep_their_builtins() -> None:
    assert issubclass(errors.ManifestConflict, errors.CheckpointConflict)
    assert issubclass(errors.ManifestConflict, FileExistsError)
    conflict = errors.ManifestConflict("another manifest is there", path="/x/manifest.json")
    assert (conflict.code, conflict.status, conflict.path, str(conflict)) == (
        "checkpoint_conflict",
        409,
        "/x/manifest.json",
        "another manifest is there",
    )
    assert "code" not in errors.ManifestConflict.__dict__
    for sub, builtin in ((errors.NotJSONError, TypeError), (errors.InvalidRecord, ValueError)):
        assert issubclass(sub, errors.InvalidPayload)
        assert issubclass(sub, builtin)
        assert (sub.code, sub.status) == ("invalid_payload", 422)
        assert "code" not in sub.__dict__
    assert (errors.InvalidPayload.code, errors.InvalidPayload.status) == ("invalid_payload", 422)
    assert errors.error_for_code("checkpoint_conflict") is errors.CheckpointConflict
    assert errors.error_for_code("invalid_payload") is errors.InvalidPayload


async def _replying_server() -> tuple[web.AppRunner, str]:
    """A real HTTP server answering ``GET /<code>/…/status`` with that wire error."""

    async def status(request: web.Request) -> web.Response:
        code = request.match_info["code"]
        return web.json_response({"error": {"code": code, "detail": f"the server said {code}"}}, status=409)

    app = web.Application()
    app.router.add_get("/{code}" + CONTROL_PREFIX + "/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("checkpoint_conflict", errors.CheckpointConflict),
        ("invalid_payload", errors.InvalidPayload),
        ("invalid_checkpoint_state", errors.InvalidCheckpointState),
        ("stale_checkpoint", errors.StaleCheckpoint),
        ("storage_error", errors.StorageError),
        ("not_a_gymckpt_code", ServerCallFailed),
    ],
)
def test_the_coordinator_maps_a_reply_code_to_its_one_class(code: str, expected: type) -> None:
    async def scenario() -> None:
        runner, base = await _replying_server()
        try:
            async with Coordinator([f"{base}/{code}"], token="t") as coordinator:
                with pytest.raises(errors.GymckptError) as raised:
                    await coordinator._call(f"{base}/{code}", "status", None, timeout=5.0)
        finally:
            await runner.cleanup()
        assert type(raised.value) is expected
        assert raised.value.wire_code == code  # type: ignore[attr-defined]
        assert f"the server said {code}" in str(raised.value)

    asyncio.run(asyncio.wait_for(scenario(), 20.0))
