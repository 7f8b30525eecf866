"""The whole records codec contract (test_codec.py) once more, on the pure-Python path.

test_codec.py runs with whatever the codec chose (the C walk and exact encoder where they are
built); here every one of its tests runs with the Python walk and no compiled encoder
(``json.dumps`` writes every exact line), as on a machine without a C compiler, so both
paths stay tested in ``make test``. The spies below prove the Python functions are the ones
that ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.store import _walks, codec
from tests.store.test_codec import *  # noqa: F403  (its tests are collected here too, under the fixture below)

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(autouse=True, scope="module")
def pure_python_walks() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "_fast_walk", _walks.fast_path_safe)
        patch.setattr(codec, "_exact_encoder", None)
        patch.setattr(codec, "_encode_line", None)
        patch.setattr(codec, "_decode_fast_line", None)
        yield


def test_the_python_path_is_the_one_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[object] = []
    dumped: list[object] = []
    real_walk, real_line = _walks.fast_path_safe, codec._exact_line

    def walk(value: object) -> bool:
        walked.append(value)
        return real_walk(value)

    def line(record: dict[str, Any], depth: int) -> bytes:
        dumped.append(record)
        return real_line(record, depth)

    monkeypatch.setattr(codec, "_fast_walk", walk)
    monkeypatch.setattr(codec, "_exact_line", line)
    fast = {"episode_id": "f", "v": [1.5]}
    exact = {"episode_id": "p", "v": [float("nan")]}
    assert codec.encode_record(fast)[1] == b'{"episode_id":"f","v":[1.5]}\n'
    assert codec.encode_record(exact)[1] == b'{"episode_id": "p","v": [NaN]}\n'
    assert walked == [fast, exact]
    assert dumped == [exact]  # json.dumps wrote the exact line
