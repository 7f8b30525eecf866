"""The records codec contract (gymckpt.store.codec).

Requirement: key order, NaN, +/-Infinity, -0.0, integers beyond 64 bits (both signs), any
string Python's json module writes, nesting 1,000 deep all round-trip type-exactly (bool
stays bool, 1 stays int, 1.0 stays float). A value that is not JSON fails with an error
naming the episode and the path to the value (``$.messages[3].ts``).

Depth is counted the way JSON nests: the record object itself is level 1, so a record
holding 4,095 nested lists is 4,096 levels deep (allowed, MAX_DEPTH) and one more is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import fractions
import json
import math
import re
import sys
import threading
import uuid
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymckpt.errors import InvalidCheckpointState, InvalidRecord, NotJSONError, RecordUndecodable
from gymckpt.store.codec import (
    EXACT_PREFIX,
    FAST_PREFIX,
    MAX_DEPTH,
    check_json,
    decode_line,
    encode_record,
    episode_id_of_line,
    is_exact_line,
)
from gymckpt.testing.values import assert_identical

from .codec_types import Color, Count, Level, MyDict, MyList, Ratio, Tag

# --- helpers


def round_trip(record: dict[str, Any]) -> bytes:
    """Encode, check the line's framing, decode it three ways and compare type-exactly."""
    episode_id, line = encode_record(record)
    assert episode_id == record["episode_id"]
    assert line.endswith(b"\n") and line.count(b"\n") == 1, "a records line is exactly one line"
    assert line.startswith((FAST_PREFIX, EXACT_PREFIX))
    assert is_exact_line(line) is line.startswith(EXACT_PREFIX)
    assert_identical(record, decode_line(line))
    assert_identical(record, decode_line(line[:-1]))
    assert_identical(record, decode_line(memoryview(line)))
    assert episode_id_of_line(line) == record["episode_id"]
    assert episode_id_of_line(memoryview(line)[:-1]) == record["episode_id"]
    return line


def nested(depth: int, container: str, leaf: Any = 1) -> Any:
    """``depth`` nested lists (``[[[leaf]]]``) or dicts (``{"k": {"k": leaf}}``), built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value] if container == "list" else {"k": value}
    return value


def needs_exact_path(value: Any) -> bool:
    """True when a value holds what orjson cannot write exactly (module docstring of codec)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            stack.extend(node.keys())
            stack.extend(node.values())
        elif type(node) is list:
            stack.extend(node)
        elif (
            (type(node) is float and not math.isfinite(node))
            or (type(node) is int and not -(2**63) <= node <= 2**64 - 1)
            or (type(node) is str and any(0xD800 <= ord(char) <= 0xDFFF for char in node))
        ):
            return True
    return False


# --- strategies

#: a high surrogate followed by a low one: JSON's escapes cannot tell it from the astral character
#: it spells, see test_a_high_low_surrogate_pair_round_trips_or_is_refused (kept out of the
#: properties below so they keep guarding everything else)
SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
#: every code point, lone surrogates included (Hypothesis leaves out category Cs by default)
ANY_CHARACTER = st.characters(exclude_categories=())
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TRICKY = st.sampled_from(['"', "\\", "\n", "\r", "\t", "\x00", "\x7f", "\u2028", "\u2029", "/", "é", "🙂", "\ufeff"])
ALPHABET = st.one_of(ANY_CHARACTER, SURROGATE, TRICKY)
TEXT = st.text(alphabet=ALPHABET, max_size=16).filter(lambda text: not SURROGATE_PAIR.search(text))
EDGE_INTS = [0, -1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**100, -(10**100)]
INTS = st.one_of(st.integers(), st.integers(min_value=-(2**400), max_value=2**400), st.sampled_from(EDGE_INTS))
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e16, 1e-320, 5e-324, 1.7976931348623157e308, 0.1]),
)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(TEXT, children, max_size=5)),
    max_leaves=40,
)
EPISODE_IDS = st.text(alphabet=ALPHABET, min_size=1, max_size=24).filter(lambda text: not SURROGATE_PAIR.search(text))
RECORDS = st.builds(
    lambda episode_id, payload, extra: {"episode_id": episode_id, "payload": payload, **extra},
    EPISODE_IDS,
    JSON_VALUES,
    st.dictionaries(TEXT.filter(lambda key: key not in ("episode_id", "payload")), JSON_VALUES, max_size=4),
)


# --- round trips: properties


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RECORDS)
def test_any_json_record_round_trips_type_exactly(record: dict[str, Any]) -> None:
    line = round_trip(record)
    # plain JSON that any reader accepts, with the same meaning
    assert_identical(record, json.loads(line))
    # deterministic: the same record gives the same bytes
    assert encode_record(record)[1] == line


@settings(max_examples=300, deadline=None)
@given(RECORDS)
def test_exact_path_is_used_exactly_when_the_record_needs_it(record: dict[str, Any]) -> None:
    """NaN, infinities, integers beyond 64 bits and lone surrogates go the exact way (else orjson
    would write null or refuse); every other shallow record takes the fast path."""
    _, line = encode_record(record)
    expected = EXACT_PREFIX if needs_exact_path(record) else FAST_PREFIX
    assert line.startswith(expected), line[:40]


@settings(max_examples=300, deadline=None)
@given(EPISODE_IDS, st.booleans())
def test_episode_id_of_line_reads_any_id(episode_id: str, exact: bool) -> None:
    record: dict[str, Any] = {"episode_id": episode_id, "x": float("nan") if exact else 1}
    _, line = encode_record(record)
    assert is_exact_line(line) is (exact or needs_exact_path(record))
    assert episode_id_of_line(line) == json.loads(line)["episode_id"] == episode_id
    assert episode_id_of_line(memoryview(line)[:-1]) == episode_id


# --- round trips: the listed cases


@pytest.mark.parametrize("container", ["list", "dict"])
def test_nesting_1000_deep_round_trips(container: str) -> None:
    record = {"episode_id": "deep", "value": nested(1000, container, leaf=2**70)}
    line = round_trip(record)
    assert line.startswith(EXACT_PREFIX)  # deeper than orjson writes


@pytest.mark.parametrize("container", ["list", "dict"])
def test_mixed_nesting_1000_deep_round_trips(container: str) -> None:
    value: Any = [1.0, -0.0]
    for level in range(1000):
        value = {"k": value, "n": level} if (level % 2 == 0) == (container == "dict") else [value, True]
    round_trip({"episode_id": "mixed", "value": value})


@pytest.mark.parametrize("total_depth", [253, 254, 255, 256])
def test_depths_around_the_fast_path_limit_round_trip(total_depth: int) -> None:
    round_trip({"episode_id": "edge", "value": nested(total_depth - 1, "list")})


@pytest.mark.parametrize("container", ["list", "dict"])
def test_max_depth_is_allowed_and_one_more_is_refused_by_path(container: str) -> None:
    limit_before = sys.getrecursionlimit()
    allowed = {"episode_id": "d", "a": nested(MAX_DEPTH - 1, container, leaf="end")}
    assert MAX_DEPTH == 4096
    assert check_json(allowed) == MAX_DEPTH
    round_trip(allowed)

    refused = {"episode_id": "d", "a": nested(MAX_DEPTH, container, leaf="end")}
    with pytest.raises(NotJSONError) as raised:
        encode_record(refused)
    step = "[0]" if container == "list" else ".k"
    # the first container below the limit: the record is level 1, $.a level 2, ...
    assert raised.value.path == "$.a" + step * (MAX_DEPTH - 1)
    assert raised.value.episode_id == "d"
    assert "4096" in str(raised.value)
    assert sys.getrecursionlimit() == limit_before


def test_deep_records_leave_the_recursion_limit_as_it_was() -> None:
    before = sys.getrecursionlimit()
    _, line = encode_record({"episode_id": "d", "a": nested(3000, "list")})
    decode_line(line)
    assert sys.getrecursionlimit() == before


def test_deep_records_encode_and_decode_concurrently() -> None:
    """The recursion headroom is interpreter-wide: threads must take turns, not undo each other's."""
    before = sys.getrecursionlimit()
    record = {"episode_id": "deep", "a": nested(MAX_DEPTH - 1, "dict", leaf=float("inf"))}
    failures: list[BaseException] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        try:
            barrier.wait(timeout=30)
            for _ in range(3):
                _, line = encode_record(record)
                assert_identical(record, decode_line(line))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert sys.getrecursionlimit() == before


@pytest.mark.parametrize("number", [2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**100, -(10**100), 2**1000 + 1])
def test_integers_of_any_size_round_trip_as_int(number: int) -> None:
    record = {"episode_id": "ints", "n": number, "in_list": [number, {"deep": number}]}
    line = round_trip(record)
    decoded = decode_line(line)
    assert type(decoded["n"]) is int and decoded["n"] == number
    assert type(decoded["in_list"][1]["deep"]) is int
    if not -(2**63) <= number <= 2**64 - 1:
        assert line.startswith(EXACT_PREFIX)


def test_a_big_integer_is_never_decoded_as_a_float() -> None:
    big = 2**64 + 1  # a float would read back as 18446744073709551616.0
    _, line = encode_record({"episode_id": "e", "n": big, "m": -(2**63) - 3})
    decoded = decode_line(line)
    assert type(decoded["n"]) is int and decoded["n"] == big
    assert type(decoded["m"]) is int and decoded["m"] == -(2**63) - 3


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        float("-inf"),
        -0.0,
        [float("nan"), float("inf"), float("-inf"), -0.0, 0.0],
        {"nan": float("nan"), "inf": {"pos": float("inf"), "neg": float("-inf")}, "zero": -0.0},
    ],
    ids=["nan", "inf", "-inf", "-0.0", "list", "dict"],
)
def test_non_finite_floats_and_negative_zero_round_trip(value: Any) -> None:
    record = {"episode_id": "floats", "v": value, "wrapped": [{"v": value}]}
    round_trip(record)


def test_negative_zero_keeps_its_sign_on_the_fast_path() -> None:
    _, line = encode_record({"episode_id": "z", "v": -0.0})
    assert line.startswith(FAST_PREFIX)
    assert math.copysign(1.0, decode_line(line)["v"]) == -1.0


def test_types_stay_exact() -> None:
    record = {"episode_id": "t", "b": True, "f": False, "one": 1, "one_float": 1.0, "zero": 0, "none": None, "s": "1"}
    round_trip(record)
    decoded = decode_line(encode_record(record)[1])
    assert [type(decoded[key]) for key in record] == [str, bool, bool, int, float, int, type(None), str]


def test_key_order_is_preserved() -> None:
    record = {"episode_id": "o", "zeta": 1, "alpha": {"z": 1, "b": 2, "a": 3, "": 4, "10": 5, "9": 6}, "mid": 0}
    decoded = decode_line(round_trip(record))
    assert list(decoded) == ["episode_id", "zeta", "alpha", "mid"]
    assert list(decoded["alpha"]) == ["z", "b", "a", "", "10", "9"]
    exact = dict(record, nan=float("nan"))
    decoded_exact = decode_line(round_trip(exact))
    assert list(decoded_exact) == ["episode_id", "zeta", "alpha", "mid", "nan"]
    assert list(decoded_exact["alpha"]) == ["z", "b", "a", "", "10", "9"]


@pytest.mark.parametrize(
    "text",
    ["\ud800", "\udfff", "a\udc00b", "\udfff\ud800", "\ud83d", "🙂\ud83d", "\ud800\ud800", '"\\\n\x00\u2028', "é" * 3],
)
def test_lone_surrogates_and_escapes_round_trip(text: str) -> None:
    record = {"episode_id": "s", text: text, "list": [text, {text: [text]}]}
    line = round_trip(record)
    if any(0xD800 <= ord(char) <= 0xDFFF for char in text):
        assert line.startswith(EXACT_PREFIX)


@pytest.mark.parametrize("where", ["value", "key", "episode_id"])
def test_a_high_low_surrogate_pair_round_trips_or_is_refused(where: str) -> None:
    """Two lone surrogates that happen to form a pair are a string Python's json writes
    (``"\\ud83d\\ude42"``), but JSON reads that escape as the one character U+1F642.
    The codec must keep them apart or refuse the value by name, never change it silently."""
    text = "a\ud83d\ude42b"  # two code points between a and b, not the emoji
    assert len(text) == 4
    record: dict[str, Any]
    if where == "value":
        record = {"episode_id": "e", "s": text}
    elif where == "key":
        record = {"episode_id": "e", "m": {text: 1, "a\U0001f642b": 2}}  # JSON would merge the two keys
    else:
        record = {"episode_id": text, "v": 1}
    try:
        _, line = encode_record(record)
    except NotJSONError as exc:
        assert exc.path in ("$.s", "$.m", "$", "$.episode_id")
        return
    assert_identical(record, decode_line(line))
    assert episode_id_of_line(line) == record["episode_id"]


def test_lone_surrogate_episode_id_round_trips() -> None:
    record = {"episode_id": "ep-\udc80", "v": 1}
    line = round_trip(record)
    assert episode_id_of_line(line) == "ep-\udc80"


def test_the_same_record_encodes_to_the_same_bytes() -> None:
    for record in (
        {"episode_id": "a", "x": [1, 2.5, "é", None, True]},
        {"episode_id": "b", "x": [float("nan"), 2**70, "\ud800"]},
        {"episode_id": "c", "x": nested(600, "dict")},
    ):
        first = encode_record(record)
        second = encode_record(json.loads(json.dumps(record)))  # an equal but separately built record
        assert first == second


def test_line_prefixes_name_the_decoder() -> None:
    _, fast = encode_record({"episode_id": "f", "x": 1.5, "y": "é", "z": 2**64 - 1})
    assert fast.startswith(b'{"episode_id":"')
    assert not is_exact_line(fast)
    for special in (float("nan"), float("inf"), 2**64, -(2**63) - 1, "\ud800", nested(300, "list")):
        _, exact = encode_record({"episode_id": "x", "v": special})
        assert exact.startswith(b'{"episode_id": '), special
        assert is_exact_line(exact)


# --- values that are not JSON


@dataclasses.dataclass
class Point:
    x: int = 1


NOT_JSON = {
    "datetime": datetime.datetime(2024, 1, 2, 3, 4, 5),
    "date": datetime.date(2024, 1, 2),
    "bytes": b"raw",
    "bytearray": bytearray(b"raw"),
    "memoryview": memoryview(b"raw"),
    "set": {1, 2},
    "empty_set": set(),
    "frozenset": frozenset({"a"}),
    "tuple": (1, 2),
    "empty_tuple": (),
    "decimal": decimal.Decimal("1.5"),
    "fraction": fractions.Fraction(1, 3),
    "complex": 1 + 2j,
    "uuid": uuid.UUID(int=7),
    "enum": Color.RED,
    "int_enum": Level.HIGH,
    "str_subclass": Tag("tagged"),
    "int_subclass": Count(3),
    "float_subclass": Ratio(0.5),
    "dict_subclass": MyDict(a=1),
    "ordered_dict": OrderedDict(a=1),
    "list_subclass": MyList([1]),
    "dataclass": Point(),
    "object": object(),
    "type": int,
    "function": len,
    "range": range(3),
}


@pytest.mark.parametrize("name", sorted(NOT_JSON))
def test_not_json_value_is_named_by_episode_and_path(name: str) -> None:
    value = NOT_JSON[name]
    record = {"episode_id": "e1", "messages": [{}, {}, {}, {"ts": value}]}
    with pytest.raises(NotJSONError) as raised:
        encode_record(record)
    error = raised.value
    assert isinstance(error, TypeError)
    assert error.episode_id == "e1"
    assert error.path == "$.messages[3].ts"
    assert "$.messages[3].ts" in str(error) and "'e1'" in str(error)


@pytest.mark.parametrize("name", ["datetime", "tuple", "int_enum", "str_subclass", "set"])
def test_not_json_value_is_named_on_the_exact_path_too(name: str) -> None:
    """The same refusal when the rest of the record needs the exact encoder."""
    record = {"episode_id": "e2", "nan": float("nan"), "big": 2**80, "deep": {"list": [0, NOT_JSON[name]]}}
    with pytest.raises(NotJSONError) as raised:
        encode_record(record)
    assert (raised.value.episode_id, raised.value.path) == ("e2", "$.deep.list[1]")


def test_not_json_value_directly_under_the_record() -> None:
    with pytest.raises(NotJSONError) as raised:
        encode_record({"episode_id": "top", "when": datetime.datetime.now()})
    assert (raised.value.episode_id, raised.value.path) == ("top", "$.when")


@pytest.mark.parametrize("key", [1, 1.5, None, True, (1, 2), b"k", Tag("k")], ids=repr)
def test_a_key_that_is_not_a_string_is_refused_naming_its_dict(key: Any) -> None:
    record = {"episode_id": "e1", "meta": {"ok": 1, key: "v"}}
    with pytest.raises(NotJSONError) as raised:
        encode_record(record)
    assert raised.value.episode_id == "e1"
    assert raised.value.path == "$.meta"
    assert repr(key) in str(raised.value)


@pytest.mark.parametrize(
    ("key", "path"),
    [
        ("key with space", '$.m["key with space"]'),
        ("3", '$.m["3"]'),
        ("a-b", '$.m["a-b"]'),
        ('quo"te', '$.m["quo\\"te"]'),
        ("", '$.m[""]'),
        ("ok_name", "$.m.ok_name"),
        ("é", "$.m.é"),
    ],
)
def test_paths_quote_keys_that_are_not_identifiers(key: str, path: str) -> None:
    with pytest.raises(NotJSONError) as raised:
        encode_record({"episode_id": "e1", "m": {key: {1, 2}}})
    assert raised.value.path == path


PATH_STEPS = st.lists(st.one_of(st.integers(min_value=0, max_value=3), TEXT), max_size=6)


def _path_text(steps: list[int | str]) -> str:
    path = "$"
    for step in steps:
        if isinstance(step, int):
            path += f"[{step}]"
        elif step.isidentifier():
            path += f".{step}"
        else:
            path += f"[{json.dumps(step, ensure_ascii=False)}]"
    return path


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=8), PATH_STEPS, st.sampled_from(sorted(NOT_JSON)), JSON_VALUES)
def test_any_misplaced_value_is_named_by_its_path(
    episode_id: str, steps: list[int | str], name: str, filler: Any
) -> None:
    value: Any = NOT_JSON[name]
    for step in reversed(steps):
        if isinstance(step, int):
            value = [filler] * step + [value, filler]
        else:
            value = {"_before": filler, step: value} if step != "_before" else {step: value}
    record = {"episode_id": episode_id, "root": value}
    with pytest.raises(NotJSONError) as raised:
        encode_record(record)
    assert raised.value.episode_id == episode_id
    assert raised.value.path == _path_text(["root", *steps])


@pytest.mark.parametrize(
    "record",
    [
        [("episode_id", "x")],
        ("episode_id", "x"),
        None,
        "episode_id",
        OrderedDict(episode_id="x"),
        MyDict(episode_id="x"),
        {},
        {"id": "x"},
        {"payload": 1, "episode_id": "x"},
        {"episode_id": ""},
        {"episode_id": 1},
        {"episode_id": None},
        {"episode_id": b"x"},
        {"episode_id": ["x"]},
        {"episode_id": Tag("x")},
    ],
    ids=repr,
)
def test_malformed_records_are_invalid(record: Any) -> None:
    with pytest.raises(InvalidRecord) as raised:
        encode_record(record)
    assert isinstance(raised.value, ValueError)


# --- decoding


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"\n",
        b"not json",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'"episode_id"',
        b"null",
        b'{"a": 1}',
        b'{"payload": 1, "episode_id": "x"}',
        b"{}",
        b'{"episode_id":"x"',
        b'{"episode_id": "x"',
        b'{"episode_id":"x"} trailing',
        b'{"episode_id": "x"} trailing',
        b'{"episode_id":"x","v":NaN}',  # NaN on the fast path is not what the encoder writes
        b'{"episode_id": "\xff"}',
        b'{"episode_id":"\xff"}',
        b'{"episode_id": "x", "v": [1, 2}',
    ],
    ids=repr,
)
def test_decode_line_refuses_garbage(line: bytes) -> None:
    with pytest.raises(RecordUndecodable) as raised:
        decode_line(line)
    assert isinstance(raised.value, InvalidCheckpointState)


def test_decode_line_refuses_nesting_beyond_what_it_can_read() -> None:
    before = sys.getrecursionlimit()
    too_deep_exact = b'{"episode_id": "x", "v": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    with pytest.raises(RecordUndecodable):
        decode_line(too_deep_exact)
    too_deep_fast = b'{"episode_id":"x","v":' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    with pytest.raises(RecordUndecodable):
        decode_line(too_deep_fast)
    assert sys.getrecursionlimit() == before


@pytest.mark.parametrize(
    "episode_id",
    ['with "quotes"', "back\\slash", "new\nline", "tab\there", "\x00nul", "é🙂中", "\ud800", "a/b", "\\u0041", "}{,"],
)
def test_episode_id_of_line_agrees_with_json(episode_id: str) -> None:
    for record in ({"episode_id": episode_id, "v": 1}, {"episode_id": episode_id, "v": float("inf")}):
        _, line = encode_record(record)
        assert episode_id_of_line(line) == json.loads(line)["episode_id"] == episode_id


@pytest.mark.parametrize(
    "line",
    [
        b'{"id":"x"}',
        b'{"episode_id":1}',
        b'{"episode_id":"unterminated',
        b'{"episode_id":"\\x"}',
        b'{"episode_id":"\xff"}',
        b"garbage",
        b"",
    ],
    ids=repr,
)
def test_episode_id_of_line_refuses_lines_without_an_id_string(line: bytes) -> None:
    with pytest.raises(RecordUndecodable):
        episode_id_of_line(line)


def test_episode_id_of_line_reads_hand_written_json() -> None:
    """Any JSON writer's spelling of the id (escaped or not) is read like json.loads reads it."""
    for line in (
        b'{"episode_id":"\\u00e9\\ud83d\\ude42","v":1}',
        b'{"episode_id": "caf\xc3\xa9", "v": 1}',
        b'{"episode_id":"\\"\\\\\\/\\b\\f\\n\\r\\t"}',
    ):
        assert episode_id_of_line(line) == json.loads(line)["episode_id"]
