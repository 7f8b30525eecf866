"""Generation cuts and the capture ledger, through a model server and the real fake backend.

The backend runs under uvicorn in the test's loop (a small token delay); ``backend.pause()``
holds every generation before its next token, so a call stays exactly mid-way while a
checkpoint cuts it. "A crash" is the first model server's app closing with the call
unanswered; the restore runs on a fresh model server against the same backend (it
survives, as in the e2e suite), and the replacement call must give the uncut reply while
the backend generates only the tokens after the cut.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from gymckpt.servers.inference import InferenceConfig, build_inference_app, cut_staging_key
from gymckpt.store import open_store
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.time import bounded, until

from .model_support import TIMEOUT, inference_server, model_server, run

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from gymckpt.servers.inference import InferenceBackend

MAX_TOKENS = 40
QUESTION = [{"role": "user", "content": "How far?"}]
REQUEST: dict[str, Any] = {"model": "policy", "input": QUESTION}


@asynccontextmanager
async def backend(*, token: str | None = None) -> AsyncIterator[tuple[str, InferenceBackend]]:
    config = InferenceConfig(
        token_delay_seconds=0.002,
        checkpoint={"enabled": False, "control_auth_token": token} if token else {"enabled": False},
    )
    app = build_inference_app(config)
    async with serve_in_loop(app) as url:
        try:
            yield url, app.state.backend
        finally:
            app.state.backend.resume()


async def _mid_way(inference: InferenceBackend, call_id: str, tokens: int) -> int:
    """Pause the backend once ``call_id`` has at least ``tokens`` tokens; the prefix it holds then."""
    await inference.wait_until(lambda: (inference.progress(call_id) or 0) >= tokens, TIMEOUT)
    inference.pause()
    progress = inference.progress(call_id)
    assert progress is not None and progress < MAX_TOKENS
    return progress


@asynccontextmanager
async def restored_server(url: str, ckpt: str) -> AsyncIterator[Any]:
    """A fresh model server on which checkpoint ``c1`` of rollout ``r`` was restored and resumed."""
    async with model_server(url, max_tokens=MAX_TOKENS) as fresh:
        assert (
            await fresh.control("restore", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
        ).status_code == 200
        assert (await fresh.control("resume", checkpoint_id="c1")).status_code == 200
        yield fresh


async def checkpoint_a_delivered_call(url: str, ckpt: str) -> dict[str, Any]:
    """Rollout ``r`` makes one call, delivered; checkpoint ``c1`` commits ``r``; its reply."""
    async with model_server(url, max_tokens=MAX_TOKENS) as model:
        delivered = (await model.respond("r", REQUEST)).json()
        assert (await model.control("prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
        committed = await model.control("commit", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
        assert committed.json()["staging_keys"] == ["__calls__/r:0"]
    return delivered


def test_a_cut_generation_continues_on_a_fresh_server_with_the_uncut_tokens(tmp_path: Path) -> None:
    async def main() -> None:
        ckpt = str(tmp_path / "ck")
        async with backend() as (url, inference):
            async with model_server(url, max_tokens=MAX_TOKENS) as reference:
                uncut = (await reference.respond("ref", REQUEST)).json()
            async with model_server(url, max_tokens=MAX_TOKENS) as model:
                call = asyncio.create_task(model.respond("r", REQUEST))
                prefix = await _mid_way(inference, "r:0", 5)
                prepared = (await model.control("prepare", checkpoint_id="c1")).json()
                assert prepared["phase"] == "prepared"
                assert prepared["report"]["counts"]["cut"] == 1
                assert prepared["report"]["counts"]["cut_failed"] == 0
                committed = (
                    await model.control("commit", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
                ).json()
                key = cut_staging_key("r", "r:0")
                assert committed["record_count"] == 1
                assert committed["staging_keys"] == [key]
                assert committed["staging_keys_by_episode"] == {"r": [key]}
                inference.resume()
                # the cut froze the generation at its prefix: nothing past it is generated before the "crash"
                assert inference.progress("r:0") == prefix
                call.cancel()  # the crash: nobody will read this reply
                await asyncio.gather(call, return_exceptions=True)
            await inference.wait_until(lambda: inference.progress("r:0") is None, TIMEOUT)  # abandoned
            assert not any(entry["call_id"] == "r:0" for entry in inference.calls)
            async with model_server(url, max_tokens=MAX_TOKENS) as fresh:
                restored = await fresh.control("restore", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
                assert restored.json()["restored"] == ["r-a1"], restored.text
                status = (await fresh.control("resume", checkpoint_id="c1")).json()
                assert status["phase"] == "idle"
                continued = await bounded(fresh.respond("r-a1", REQUEST))
                assert continued.status_code == 200, continued.text
                assert continued.json() == uncut
                (logged,) = [entry for entry in inference.calls if entry["call_id"] == "r-a1:0"]
                assert (logged["continued_from"], logged["generated"]) == (prefix, MAX_TOKENS - prefix)
                assert logged["tokens"] == next(e for e in inference.calls if e["call_id"] == "ref:0")["tokens"]
                assert fresh.participant.restored_cuts == {}  # used up once delivered
                assert [row["model_call_id"] for row in fresh.participant.ledger["r-a1"]] == ["r-a1:0"]

    run(main)


def test_a_constrained_call_is_never_cut(tmp_path: Path) -> None:
    async def main() -> None:
        async with backend() as (url, inference), model_server(url, max_tokens=MAX_TOKENS) as model:
            tools = [{"type": "function", "name": "add"}]
            call = asyncio.create_task(model.respond("r", {**REQUEST, "tools": tools, "tool_choice": "required"}))
            await _mid_way(inference, "r:0", 3)
            prepared = (await model.control("prepare", checkpoint_id="c1")).json()
            counts = prepared["report"]["counts"]
            assert (counts["cut"], counts["cut_skipped"], counts["cut_failed"]) == (0, 1, 0)
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r"]
            )
            assert committed.json()["record_count"] == 0
            assert not any(key.startswith("__generation_cut__") for key in inference.staged)
            inference.resume()
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            assert (await bounded(call)).status_code == 200

    run(main)


def test_a_cut_that_fails_leaves_the_call_held_and_the_checkpoint_valid(tmp_path: Path) -> None:
    async def main() -> None:
        # the backend wants another token: its cut route answers 401, so the cut fails
        async with backend(token="another") as (url, inference), model_server(url, max_tokens=MAX_TOKENS) as model:
            call = asyncio.create_task(model.respond("r", REQUEST))
            await _mid_way(inference, "r:0", 3)
            prepared = (await model.control("prepare", checkpoint_id="c1")).json()
            assert prepared["phase"] == "prepared" and prepared["report"]["ready"] is True
            assert prepared["report"]["counts"]["cut_failed"] == 1
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r"]
            )
            assert committed.status_code == 200 and committed.json()["record_count"] == 0
            inference.resume()
            await model.participant.wait_until(lambda: model.participant.counts()["held"] == 1, TIMEOUT)
            assert not call.done()  # held until resume, as without cuts
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            assert (await bounded(call)).status_code == 200

    run(main)


def test_the_ledger_keeps_delivered_calls_and_lists_their_staging_keys(tmp_path: Path) -> None:
    async def main() -> None:
        async with backend() as (url, _), model_server(url, max_tokens=4) as model:
            for _ in range(2):
                assert (await model.respond("r", REQUEST)).status_code == 200
            assert (await model.respond("other", REQUEST)).status_code == 200
            assert (await model.control("prepare", checkpoint_id="c1")).json()["phase"] == "prepared"
            committed = (
                await model.control(
                    "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r"]
                )
            ).json()
            # one episode in scope: its rows (the same call id twice: one staged key), none of "other"
            assert committed["record_count"] == 1
            assert committed["staging_keys"] == ["__calls__/r:0"]
            assert committed["staging_keys_by_episode"] == {"r": ["__calls__/r:0"]}

    run(main)


def test_a_generation_completed_while_held_is_kept_whole_and_never_generated_again(tmp_path: Path) -> None:
    async def main() -> None:
        ckpt = str(tmp_path / "ck")
        # the cut fails (the backend wants another token), so the generation is not frozen and completes
        async with backend(token="another") as (url, inference):
            async with model_server(url, max_tokens=MAX_TOKENS) as model:
                call = asyncio.create_task(model.respond("r", REQUEST))
                prefix = await _mid_way(inference, "r:0", 5)
                counts = (await model.control("prepare", checkpoint_id="c1")).json()["report"]["counts"]
                assert (counts["cut"], counts["cut_failed"]) == (0, 1)
                inference.resume()  # the generation completes while admission is closed: its reply is held
                participant = model.participant
                await participant.wait_until(lambda: participant.counts()["held"] == 1, TIMEOUT)
                committed = (
                    await model.control("commit", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
                ).json()
                assert committed["staging_keys"] == ["__calls__/r:0"]  # the whole generation, not the cut prefix
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
            async with restored_server(url, ckpt) as fresh:
                assert (await bounded(fresh.respond("r-a1", REQUEST))).status_code == 200
                (logged,) = [entry for entry in inference.calls if entry["call_id"] == "r-a1:0"]
                assert (logged["continued_from"], logged["generated"]) == (MAX_TOKENS, 0)
                assert prefix < MAX_TOKENS

    run(main)


def test_a_cut_whose_staged_tokens_are_gone_is_generated_again_and_nothing_is_lost(tmp_path: Path) -> None:
    """The backend restarted (its token store is lost): the continuation is refused, the call is made whole."""

    async def main() -> None:
        ckpt = str(tmp_path / "ck")
        async with backend() as (url, inference):
            async with model_server(url, max_tokens=MAX_TOKENS) as reference:
                uncut = (await reference.respond("ref", REQUEST)).json()
            async with model_server(url, max_tokens=MAX_TOKENS) as model:
                call = asyncio.create_task(model.respond("r", REQUEST))
                await _mid_way(inference, "r:0", 5)
                assert (await model.control("prepare", checkpoint_id="c1")).json()["report"]["counts"]["cut"] == 1
                await model.control("commit", checkpoint_id="c1", checkpoint_dir=ckpt, episode_ids=["r"])
                inference.resume()
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
            inference.delete_staged([cut_staging_key("r", "r:0")])
            async with restored_server(url, ckpt) as fresh:
                continued = await bounded(fresh.respond("r-a1", REQUEST))
                assert continued.status_code == 200, continued.text
                assert continued.json() == uncut
                (logged,) = [entry for entry in inference.calls if entry["call_id"] == "r-a1:0"]
                assert (logged["continued_from"], logged["generated"]) == (0, MAX_TOKENS)

    run(main)


def test_a_call_the_backend_had_not_seen_at_prepare_is_cut_at_commit(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            inference_server(token_delay_seconds=0.002) as inference,
            model_server(inference.url, max_tokens=MAX_TOKENS) as model,
        ):
            inference.gate.close()  # the call's /generate waits in front of the backend
            call = asyncio.create_task(model.respond("r", REQUEST))
            await inference.gate.until(lambda gate: gate.arrivals == 1)
            counts = (await model.control("prepare", checkpoint_id="c1")).json()["report"]["counts"]
            assert (counts["cut"], counts["cut_failed"]) == (0, 1)  # the backend did not know it yet
            inference.gate.open()
            prefix = await _mid_way(inference.backend, "r:0", 2)
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r"]
            )
            assert committed.json()["staging_keys"] == [cut_staging_key("r", "r:0")]
            (record,) = open_store(str(tmp_path / "ck")).read_participant("", kind="model", instance="model-0")
            assert record["generation_cuts"][0]["continuation"]["prefix_token_count"] == prefix
            assert model.participant.counts()["cut"] == 1
            inference.backend.resume()
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            assert (await bounded(call)).status_code == 200  # released at resume, delivered

    run(main)


def test_a_delivered_response_asked_for_again_after_a_restore_is_replayed_not_generated(tmp_path: Path) -> None:
    """The response left the model server, but the agent's checkpoint predates its arrival: the
    replacement asks the same request again and gets the recorded response from its staged tokens."""

    async def main() -> None:
        ckpt = str(tmp_path / "ck")
        other = {"model": "policy", "input": [{"role": "user", "content": "How near?"}]}
        async with backend() as (url, inference):
            delivered = await checkpoint_a_delivered_call(url, ckpt)
            async with restored_server(url, ckpt) as fresh:
                replayed = await bounded(fresh.respond("r-a1", REQUEST))
                assert replayed.status_code == 200, replayed.text
                assert replayed.json() == delivered
                (logged,) = [entry for entry in inference.calls if entry["call_id"] == "r-a1:0"]
                assert (logged["continued_from"], logged["generated"]) == (MAX_TOKENS, 0)
                # the lineage keeps the one row of that response; the next request is generated and appended
                assert [row["model_call_id"] for row in fresh.participant.ledger["r-a1"]] == ["r:0"]
                assert (await bounded(fresh.respond("r-a1", other))).status_code == 200
                assert [entry["generated"] for entry in inference.calls if entry["call_id"] == "r-a1:0"] == [
                    0,
                    MAX_TOKENS,
                ]
                assert [row["model_call_id"] for row in fresh.participant.ledger["r-a1"]] == ["r:0", "r-a1:0"]
                assert fresh.participant.status_extra()["replayed_calls"] == 1
                # a row replays once: the same request again is a new call
                assert (await bounded(fresh.respond("r-a1", REQUEST))).json() == delivered
                assert inference.calls[-1]["generated"] == MAX_TOKENS

    run(main)


def test_a_replay_whose_staged_tokens_are_gone_is_generated_again_and_replaces_the_row(tmp_path: Path) -> None:
    async def main() -> None:
        ckpt = str(tmp_path / "ck")
        async with backend() as (url, inference):
            delivered = await checkpoint_a_delivered_call(url, ckpt)
            inference.delete_staged(["__calls__/r:0"])
            async with restored_server(url, ckpt) as fresh:
                again = await bounded(fresh.respond("r-a1", REQUEST))
                assert again.status_code == 200, again.text
                assert again.json() == delivered  # the backend is deterministic: the same tokens, generated
                (logged,) = [entry for entry in inference.calls if entry["call_id"] == "r-a1:0"]
                assert (logged["continued_from"], logged["generated"]) == (0, MAX_TOKENS)
                assert [row["model_call_id"] for row in fresh.participant.ledger["r-a1"]] == ["r-a1:0"]
                assert fresh.participant.status_extra()["replayed_calls"] == 0

    run(main)


def test_a_call_waiting_for_a_connection_to_the_backend_is_not_cut_and_its_episode_exports_nothing(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with (
            inference_server(token_delay_seconds=0.002) as inference,
            model_server(inference.url, max_tokens=MAX_TOKENS, data_connector_limit_per_host=1) as model,
        ):
            first = asyncio.create_task(model.respond("r1", REQUEST))
            prefix = await _mid_way(inference.backend, "r1:0", 2)  # r1 holds the pool's one connection
            second = asyncio.create_task(model.respond("r2", REQUEST))
            participant = model.participant
            await until(lambda: [call.state.value for call in participant.calls_of("r2")] == ["in_flight"])
            assert [call.sent for call in participant.calls_of("r2")] == [False]
            assert [call.sent for call in participant.calls_of("r1")] == [True]
            counts = (await model.control("prepare", checkpoint_id="c1")).json()["report"]["counts"]
            assert (counts["cut"], counts["cut_failed"]) == (1, 0)  # the backend was asked about r1 alone
            committed = await model.control(
                "commit", checkpoint_id="c1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["r1", "r2"]
            )
            assert committed.json()["episode_ids"] == ["r1"]  # r2 had nothing: it is called again after a crash
            (record,) = open_store(str(tmp_path / "ck")).read_participant("", kind="model", instance="model-0")
            assert record["generation_cuts"][0]["continuation"]["prefix_token_count"] == prefix
            inference.backend.resume()
            assert (await model.control("resume", checkpoint_id="c1")).status_code == 200
            replies = [await bounded(first), await bounded(second)]
            assert [reply.status_code for reply in replies] == [200, 200]
            assert [call.sent for call in participant.calls_of("r2")] == []  # delivered and ended

    run(main)
