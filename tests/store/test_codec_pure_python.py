"""The whole records codec contract (test_codec.py) once more, with the pure-Python walks.

test_codec.py runs with whatever walks the codec chose (the C ones where they are built);
here every one of its tests runs with the Python ones, which a machine without a C
compiler uses, so both paths stay tested in ``make test``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from gymckpt.store import _walks, codec
from tests.store.test_codec import *  # noqa: F403  (its tests are collected here too, under the fixture below)

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(autouse=True, scope="module")
def pure_python_walks() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "_fast_walk", _walks.fast_path_safe)
        patch.setattr(codec, "_fragment_walk", _walks.with_fragments)
        yield


def test_the_python_walks_are_the_ones_in_use() -> None:
    _, line = codec.encode_record({"episode_id": "p", "v": [float("nan")]})
    assert codec._fast_walk is _walks.fast_path_safe
    assert codec._fragment_walk is _walks.with_fragments
    assert line == b'{"episode_id": "p","v":[NaN]}\n'
