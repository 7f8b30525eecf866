"""JSON on the data routes (gymckpt.servers.json_body): orjson where its bytes are the standard library's, else json."""

from __future__ import annotations

import json
import math
import random
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gymckpt.servers.json_body import FastJSONResponse, canonical_json, parse_json
from gymckpt.servers.model import canonical_prompt


def stdlib(value: Any, *, ensure_ascii: bool = False) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii).encode()


TRICKY = [
    [{"role": "user", "content": 'héllo \u2028 \x00 \x1f \x7f "quoted" back\\slash 😀'}],
    {"b": 1, "a": {"é": 1, "z": 2, "e": 3, "\uffff": 0, "😀": 1, "": None}},
    [1e16, 1e-05, 0.0001, 1.5e-07, -8.02e-09, 5e-324, 1.7976931348623157e308, 0.1 + 0.2, -0.0, 123.0],
    [float("nan"), float("inf"), -float("inf")],
    [2**64, -(2**63) - 1, 2**63 - 1],
    {"n": None, "t": True, "f": False, "nested": [[[{"x": [1, 2.5, "3"]}]]]},
    "0.00001 is text, 1e-6 too",
]


@pytest.mark.parametrize("value", TRICKY)
@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_canonical_json_is_the_standard_librarys_bytes(value: Any, ensure_ascii: bool) -> None:
    assert canonical_json(value, ensure_ascii=ensure_ascii) == stdlib(value, ensure_ascii=ensure_ascii)


def test_canonical_json_of_many_floats_is_the_standard_librarys() -> None:
    rng = random.Random(27)
    floats = []
    for index in range(20_000):
        if index % 2:
            value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        else:
            value = rng.random() * 10 ** rng.randint(-12, 20)
        if math.isfinite(value):
            floats.append(value)
    for chunk in range(0, len(floats), 50):
        part = floats[chunk : chunk + 50]
        assert canonical_json({"v": part}) == stdlib({"v": part})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_canonical_json_matches_the_standard_library_on_any_value(value: Any) -> None:
    try:
        expected = stdlib(value)
    except UnicodeEncodeError:  # a lone surrogate: neither writes it
        return
    assert canonical_json(value) == expected


def test_the_model_prompt_is_the_canonical_json_of_its_input() -> None:
    items = [{"role": "user", "content": "ünïcode", "z": 1, "a": [0.5, 1e-7]}]
    assert canonical_prompt(items) == stdlib(items).decode()


def test_parse_json_reads_what_orjson_would_change() -> None:
    assert math.isnan(parse_json(b'{"x": NaN}')["x"])
    assert parse_json(b"[123456789012345678901234567890]") == [123456789012345678901234567890]
    assert parse_json(b'{"a": [1, "b"]}') == {"a": [1, "b"]}
    with pytest.raises(ValueError):
        parse_json(b"{not json")


def test_fast_json_response_writes_big_integers_too() -> None:
    assert json.loads(FastJSONResponse({"a": [1, "é"]}).body) == {"a": [1, "é"]}
    assert json.loads(FastJSONResponse({"big": 2**70}).body) == {"big": 2**70}
