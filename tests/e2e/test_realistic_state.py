"""Scenario (a) of issue 27, short: realistic rollout state through a checkpoint, a SIGKILL and a restore.

Real processes (one worker per Gym server), a few hundred rollouts with the default
:class:`~gymckpt.stack.harness.StateSizes` (prompts, tool outputs, 96-token generations
with logprobs, reasoning in the conversation), the checkpoint taken by turn (once most
rollouts in flight are past their first turn), every Gym server SIGKILLed, restored and
continued. No timing is asserted: only what was carried and that every result is the
uninterrupted run's.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console

from gymckpt.demo import run_demo
from gymckpt.demo.launch import TurnTrigger
from gymckpt.demo.report import EXIT_OK
from gymckpt.servers.token_codec import TOKEN_ENCODING, unpack_logprobs, unpack_token_ids
from gymckpt.store import open_store

if TYPE_CHECKING:
    from pathlib import Path

ROLLOUTS = 240
#: the reference's bytes per exported rollout (issue 27): environment 0.9, agent 1.9, model 2.7 KB
REFERENCE_BYTES = {"environment": 900, "agent": 1900, "model": 2700}


def _records(directory: str, kind: str, scope: list[str]) -> dict[str, dict[str, Any]]:
    store = open_store(directory)
    try:
        (entry,) = [entry for entry in store.read_index("").participants if entry.kind == kind]
        return {
            record["episode_id"]: record
            for record in store.read_participant("", kind=kind, instance=entry.instance, scope=scope)
        }
    finally:
        store.close()


def test_realistic_state_is_checkpointed_by_turn_restored_and_continued_identically(tmp_path: Path) -> None:
    buffer = io.StringIO()
    out = Console(file=buffer, width=200, color_system=None)
    outcome = run_demo(
        rollouts=ROLLOUTS,
        store_url=str(tmp_path / "ckpts"),
        console=out,
        logs_dir=tmp_path,
        workers=1,
        restore_workers=1,
        checkpoint_turn=TurnTrigger(turn=2, share=0.5),
        timeout=300.0,
    )
    assert outcome.exit_code == EXIT_OK, (outcome.error, buffer.getvalue())

    # nothing lost, every continued result the uninterrupted run's
    assert outcome.lost == [] and outcome.differing == []
    assert outcome.continued == outcome.exported
    finished = outcome.finished_before, outcome.continued, outcome.restarted, outcome.started_after_restore
    assert sum(len(keys) for keys in finished) == ROLLOUTS
    assert outcome.mean_reward == outcome.reference_mean_reward == 1.0
    # checkpointed by turn: most of the exported rollouts were past their first turn
    exported = outcome.exported
    assert len(exported) >= ROLLOUTS // 3, buffer.getvalue()
    assert outcome.exported_past_first_turn >= len(exported) // 2, (outcome.stages, buffer.getvalue())
    # no completed model call generated again from its first token
    assert outcome.held_from_first_token == 0
    assert outcome.tokens_generated_again <= 0.05 * outcome.tokens_in_flight

    # what the records hold: the task, the conversation, the ledger's token ids and logprobs
    directory = outcome.checkpoint_dir
    environment = _records(directory, "environment", exported)
    agent = _records(directory, "agent", exported)
    model = _records(directory, "model", exported)
    assert all(outcome.bytes_by_participant.get(f"{kind}/{kind}", 0) > 0 for kind in REFERENCE_BYTES)
    for key in exported:
        index = int(key.split("-")[0])
        assert environment[key]["task"]["task_id"]["task_id"] == f"task-{index}"
        assert environment[key]["task"]["task_input"]["prompt"].startswith(f"count for task {index}.")

    def messages(key: str) -> list[dict[str, Any]]:
        """The exported conversation (none: the agent had no session, or no boundary, yet)."""
        return ((agent.get(key) or {}).get("boundary") or {}).get("messages") or []

    past = [key for key in exported if any(message.get("role") == "tool" for message in messages(key))]
    assert len(past) == outcome.exported_past_first_turn - sum(
        count for label, count in outcome.stages.items() if label in ("verifying", "verified")
    )
    # a rollout past its first turn carries at least the reference's bytes per exported rollout,
    # participant by participant (the mean over all exported ones depends on when the trigger fired)
    assert past, buffer.getvalue()
    for kind, records in (("environment", environment), ("agent", agent), ("model", model)):
        mean = sum(len(orjson.dumps(records[key])) for key in past) / len(past)
        assert mean >= REFERENCE_BYTES[kind], (kind, mean, len(past))

    for key in past:
        conversation = messages(key)
        kinds = [message.get("type") or message.get("role") for message in conversation]
        assert kinds[:4] == ["user", "reasoning", "function_call", "tool"], kinds
        assert len(conversation[3]["content"]) > 320  # the tool output (JSON of its reply)
        rows = model[key]["rows"]
        for row in rows or [None]:
            assert row is not None and row["encoding"] == TOKEN_ENCODING
            assert len(unpack_token_ids(row["token_ids"])) == len(unpack_logprobs(row["logprobs"])) == row["tokens"]
