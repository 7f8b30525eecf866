"""Records with the values that are easy to lose, and type-exact comparison of what came back."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["assert_identical", "same_records", "sample_records"]


def sample_records(count: int, *, prefix: str = "r", payload: int = 200) -> list[dict[str, Any]]:
    """Records with the values that are easy to lose: NaN, infinities, -0.0, big ints, deep nesting."""
    records: list[dict[str, Any]] = []
    for index in range(count):
        record: dict[str, Any] = {
            "episode_id": f"{prefix}{index}",
            "zeta": index,
            "alpha": {"text": "é🙂" + "x" * payload, "ok": True, "none": None, "f": 1.0},
        }
        if index % 5 == 1:
            record["nan"] = float("nan")
            record["inf"] = [float("inf"), float("-inf"), -0.0]
        if index % 7 == 2:
            record["big"] = [2**64, -(2**70) - 1]
        if index % 11 == 3:
            deep: list[Any] = []
            cursor = deep
            for _ in range(300):
                cursor.append([])
                cursor = cursor[0]
            record["deep"] = deep
        records.append(record)
    return records


def same_records(left: list[dict[str, Any]], right: list[dict[str, Any]]) -> bool:
    """Equality that treats NaN as equal to NaN and compares key order and types."""
    return json.dumps(left, allow_nan=True) == json.dumps(right, allow_nan=True) and _types(left) == _types(right)


def assert_identical(expected: Any, actual: Any) -> None:
    """Type-exact deep equality (types, key order, NaN, the sign of -0.0); iterative."""
    stack = [(expected, actual, "$")]
    while stack:
        left, right, path = stack.pop()
        assert type(left) is type(right), f"{path}: {type(left).__name__} came back as {type(right).__name__}"
        if type(left) is dict:
            assert list(left) == list(right), f"{path}: keys or key order differ"
            stack.extend((left[key], right[key], f"{path}[{key!r}]") for key in left)
        elif type(left) is list:
            assert len(left) == len(right), f"{path}: length differs"
            stack.extend(
                (item, other, f"{path}[{index}]") for index, (item, other) in enumerate(zip(left, right, strict=True))
            )
        elif type(left) is float and math.isnan(left):
            assert math.isnan(right), f"{path}: NaN came back as {right!r}"
        elif type(left) is float:
            assert left == right and math.copysign(1.0, left) == math.copysign(1.0, right), f"{path}: {right!r}"
        else:
            assert left == right, f"{path}: {left!r} came back as {right!r}"


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return [(key, _types(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_types(item) for item in value]
    return type(value).__name__
