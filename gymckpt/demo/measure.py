"""What the full demo reads back after the fact: where the exported rollouts stood, and which model calls were redone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gymckpt.demo.report import count_stages, stage_label
from gymckpt.identity import split_capture_key
from gymckpt.store import open_store

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = [
    "GenerationTokens",
    "generation_tokens",
    "held_model_calls",
    "read_stages",
    "redone_model_calls",
    "stages_at_checkpoint",
]


def redone_model_calls(
    before: list[dict[str, Any]], after: list[dict[str, Any]], exported: Iterable[str]
) -> tuple[int, int]:
    """``(completed, redone)``: model calls of exported rollouts completed before the crash, and those made again.

    ``before`` is the inference backend's call log before the restore, ``after`` the whole
    log after the rollouts continued. A call id is ``"<capture key>:<tool results so far>"``;
    the replacement attempt's call for the same turn has the same rollout and count.
    """
    wanted = set(exported)

    def turn(call: dict[str, Any]) -> tuple[str, str] | None:
        key, _, count = str(call.get("call_id", "")).rpartition(":")
        if not key:
            return None
        rollout, _ = split_capture_key(key)
        return (rollout, count) if rollout in wanted else None

    earlier = {turn(call) for call in before} - {None}
    completed = sum(1 for call in before if turn(call) is not None)
    redone = sum(1 for call in after[len(before) :] if turn(call) in earlier)
    return completed, redone


@dataclass(frozen=True)
class GenerationTokens:
    """What the calls after a restore did with the generations in flight at the checkpoint (tokens)."""

    #: tokens of the calls that replaced a generation in flight at the checkpoint
    in_flight: int = 0
    #: of those, tokens a cut had kept (the backend continued after them)
    kept: int = 0
    #: tokens generated a second time: the replacement of a generation that had completed before the crash
    generated_again: int = 0
    #: replacements of a generation completed before the crash that started again from its first token
    from_first_token: int = 0


def _turn(call: dict[str, Any], wanted: set[str]) -> tuple[str, str] | None:
    key, _, count = str(call.get("call_id", "")).rpartition(":")
    if not key:
        return None
    rollout, _ = split_capture_key(key)
    return (rollout, count) if rollout in wanted else None


def generation_tokens(
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    exported: Iterable[str],
    held_calls: Iterable[str] | None = None,
) -> GenerationTokens:
    """Tokens kept by cuts and generated again, from the backend's log (``continued_from``, ``generated``).

    A call after the restore replaced a generation in flight at the checkpoint when it
    continued a cut or replayed a response (``continued_from`` > 0), or when its turn had
    completed before the crash. Its ``generated`` tokens count as generated a second time
    when that turn's generation had completed before the crash and the checkpoint held it
    (``held_calls``, the model call ids of
    :func:`held_model_calls`; default: every call of ``before``). A turn whose generation
    reached the backend only after the export belongs to no checkpoint: generating it
    again is not counted.
    """
    wanted = set(exported)
    earlier = {turn for call in before if (turn := _turn(call, wanted)) is not None}
    ids = (str(call.get("call_id", "")) for call in before) if held_calls is None else held_calls
    held = {turn for call_id in ids if (turn := _turn({"call_id": call_id}, wanted)) is not None}
    in_flight = kept = again = first = 0
    for call in after[len(before) :]:
        turn = _turn(call, wanted)
        if turn is None:
            continue
        continued = int(call.get("continued_from") or 0)
        if continued == 0 and turn not in earlier and turn not in held:
            continue  # a turn the rollout had not reached: a new call, not a replacement
        in_flight += len(call.get("tokens") or [])
        kept += continued
        if turn in held:
            first += continued == 0  # the checkpoint kept tokens of it, yet it started over
            if turn in earlier:  # its generation had completed before the crash
                again += int(call.get("generated", len(call.get("tokens") or [])) or 0)
    return GenerationTokens(in_flight=in_flight, kept=kept, generated_again=again, from_first_token=first)


def held_model_calls(
    checkpoint_dir: str, storage_options: dict[str, Any], exported: list[str], completed: list[dict[str, Any]]
) -> set[str]:
    """The model call ids a checkpoint held of the exported rollouts: what a restore must not generate again.

    ``completed`` is the backend's log read before prepare (those generations had ended);
    the model records add each ledger row's call and each cut that kept a token. Blocking
    (it reads the store); raises whatever reading raises.
    """
    held = {str(call.get("call_id", "")) for call in completed}
    store = open_store(checkpoint_dir, **storage_options)
    try:
        for entry in store.read_index("").participants:
            if entry.kind != "model":
                continue
            for record in store.read_participant("", kind=entry.kind, instance=entry.instance, scope=exported):
                held.update(str(row.get("model_call_id")) for row in record.get("rows", []))
                held.update(
                    str(cut.get("model_call_id"))
                    for cut in record.get("generation_cuts", [])
                    if int(cut.get("continuation", {}).get("prefix_token_count") or 0) > 0
                )
    finally:
        store.close()
    return held


def stages_at_checkpoint(checkpoint_dir: str, storage_options: dict[str, Any], exported: list[str]) -> dict[str, int]:
    """Where each exported rollout stood (label → count), from its environment and agent records.

    Blocking (it reads the store); raises whatever reading raises.
    """
    store = open_store(checkpoint_dir, **storage_options)
    try:
        index = store.read_index("")
        records: dict[str, dict[str, dict[str, Any]]] = {}
        for entry in index.participants:
            if entry.kind in ("environment", "agent"):
                rows = store.read_participant("", kind=entry.kind, instance=entry.instance, scope=exported)
                records[entry.kind] = {row["episode_id"]: row for row in rows}
    finally:
        store.close()
    environment, agent = records.get("environment", {}), records.get("agent", {})
    return count_stages(stage_label(environment.get(key), agent.get(key)) for key in exported)


async def read_stages(
    checkpoint_dir: str, storage_options: dict[str, Any], exported: list[str], progress: Callable[[str], None]
) -> dict[str, int]:
    """:func:`stages_at_checkpoint` off the event loop, for a demo's progress line and table.

    Only a figure: a failure to read them is said in one progress line (the rollouts then count
    as none past their first turn) and never fails the demo.
    """
    if not exported:
        return {}
    try:
        return await asyncio.to_thread(stages_at_checkpoint, checkpoint_dir, storage_options, exported)
    except Exception as exc:
        progress(
            f"where the exported rollouts stood could not be read (counted as none past the first turn): "
            f"{type(exc).__name__}: {exc}"
        )
        return {}
