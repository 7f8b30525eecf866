"""A collection's dataset: one JSON object per line, each a row to run through the environment's ``/run``.

A row's rollout id is its ``_ng_rollout_id`` when it has one (checked at load time: the
reserved attempt suffix ``-a<N>`` is refused), else ``"<task index>-<rollout index>"``
from ``_ng_task_index`` (default: the row's position among the rows) and
``_ng_rollout_index`` (default 0). The task sent to ``/run`` is the row without its
``_ng_*`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gymckpt.errors import InvalidDataset, InvalidRolloutId
from gymckpt.identity import default_rollout_id, validate_rollout_id

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["Row", "load_rows"]

#: the prefix of the fields that say how a row is run, never sent in its task
CONTROL_PREFIX = "_ng_"


@dataclass(frozen=True)
class Row:
    """One dataset row: its rollout id, indexes, task and line number (1-based)."""

    rollout_id: str
    task_index: int
    rollout_index: int
    task: dict[str, Any]
    line: int

    def tagged(self, attempt: int) -> dict[str, Any]:
        """The ``_ng_*`` fields a results line of this row carries."""
        return {
            "_ng_rollout_id": self.rollout_id,
            "_ng_task_index": self.task_index,
            "_ng_rollout_index": self.rollout_index,
            "_ng_attempt_index": attempt,
        }


def _index(row: dict[str, Any], name: str, default: int, path: str, line: int) -> int:
    value = row.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidDataset(f"{name} must be a non-negative integer, got {value!r}", path=path, line=line)
    return value


def load_rows(path: str | Path) -> list[Row]:
    """Every row of the JSONL file at ``path``, checked; blank lines are skipped.

    Raises :class:`~gymckpt.errors.InvalidDataset` naming the file and line: a line that
    is not a JSON object, a bad ``_ng_rollout_id`` (the reserved ``-a<N>`` suffix among
    them), bad indexes, or a rollout id two rows share. ``FileNotFoundError`` if absent.
    """
    name = str(path)
    rows: list[Row] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                value = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise InvalidDataset(f"not valid JSON ({exc})", path=name, line=number) from None
            if not isinstance(value, dict):
                raise InvalidDataset(f"a row must be a JSON object, got {type(value).__name__}", path=name, line=number)
            task_index = _index(value, "_ng_task_index", len(rows), name, number)
            rollout_index = _index(value, "_ng_rollout_index", 0, name, number)
            try:
                if "_ng_rollout_id" in value:
                    rollout_id = validate_rollout_id(value["_ng_rollout_id"])
                else:
                    rollout_id = default_rollout_id(task_index, rollout_index)
            except InvalidRolloutId as exc:
                raise InvalidDataset(f"_ng_rollout_id: {exc.detail}", path=name, line=number) from None
            if rollout_id in seen:
                raise InvalidDataset(
                    f"rollout id {rollout_id!r} is already the id of line {seen[rollout_id]}", path=name, line=number
                )
            seen[rollout_id] = number
            task = {key: item for key, item in value.items() if not key.startswith(CONTROL_PREFIX)}
            rows.append(Row(rollout_id, task_index, rollout_index, task, number))
    return rows
