"""The codec's exactness walks in C (gymckpt.store._exact) and in Python answer the same.

Two walks decide how a record is written (gymckpt/store/_walks.py): the fast walk (orjson's
line as it is) and the fragment walk (NaN, +/-Infinity and big integers as orjson
Fragments). Both exist twice, compiled and in Python; the compiled ones run where they were
built, the Python ones everywhere else. Here both are run on a table of tricky values and on
generated ones and must agree; then the records codec is run through each pair. The whole
codec contract (test_codec.py) runs with the Python walks once more in
test_codec_pure_python.py.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import math
import os
import shutil
import sys
import sysconfig
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymckpt.errors import NotJSONError, RecordUndecodable
from gymckpt.store import _walks, codec
from gymckpt.store.codec import EXACT_PREFIX, FAST_PREFIX, decode_line, decode_line_and_id, encode_record
from gymckpt.testing.values import assert_identical

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

try:
    from gymckpt.store import _exact  # type: ignore[attr-defined]
except ImportError:  # not built here: the C side of each comparison is skipped
    _exact = None
else:  # configured here too: with GYMCKPT_PURE_PYTHON=1 the codec leaves it alone, these tests still compare
    _exact.configure(_walks.NAN, _walks.INFINITY, _walks.NEGATIVE_INFINITY, _walks.int_fragment)

needs_accelerator = pytest.mark.skipif(_exact is None, reason="gymckpt.store._exact is not built (no C compiler)")


class Walks:
    """One implementation's pair of walks."""

    def __init__(self, name: str, fast: Callable[[object], bool], fragments: Callable[[object], object]) -> None:
        self.name = name
        self.fast = fast
        self.fragments = fragments

    def __repr__(self) -> str:
        return self.name


PYTHON = Walks("python", _walks.fast_path_safe, _walks.with_fragments)
C = Walks("c", _exact.fast_path_safe, _exact.with_fragments) if _exact is not None else None


@pytest.fixture(params=["c", "python"])
def walks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Walks]:
    """Each implementation in turn, installed as the one encode_record uses."""
    chosen = PYTHON if request.param == "python" else C
    if chosen is None:
        pytest.skip("gymckpt.store._exact is not built (no C compiler)")
    monkeypatch.setattr(codec, "_fast_walk", chosen.fast)
    monkeypatch.setattr(codec, "_fragment_walk", chosen.fragments)
    yield chosen


# --- the accelerator is there where it can be


def _c_compiler() -> str | None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which(compiler) if os.path.exists(headers) else None


@pytest.mark.skipif(os.environ.get("GYMCKPT_PURE_PYTHON", "") not in ("", "0"), reason="GYMCKPT_PURE_PYTHON is set")
def test_the_accelerator_is_built_and_used_where_a_c_compiler_exists() -> None:
    if _c_compiler() is None:
        assert not codec.ACCELERATED
        pytest.skip("no C compiler or Python headers here: the pure-Python walks run, tested by the rest of this file")
    assert _exact is not None, (
        "a C compiler is here but gymckpt.store._exact is not built: reinstall (pip install -e .)"
    )
    assert codec.ACCELERATED
    assert codec._fast_walk is _exact.fast_path_safe
    assert codec._fragment_walk is _exact.with_fragments


def test_gymckpt_pure_python_keeps_to_the_python_walks(tmp_path: Any) -> None:
    """GYMCKPT_PURE_PYTHON=1 in a fresh interpreter: the Python walks, and the codec still exact."""
    import subprocess

    program = (
        "from gymckpt.store import _walks, codec\n"
        "assert not codec.ACCELERATED\n"
        "assert codec._fast_walk is _walks.fast_path_safe and codec._fragment_walk is _walks.with_fragments\n"
        "_, line = codec.encode_record({'episode_id': 'x', 'v': float('nan'), 'n': 2**70})\n"
        "print(line.decode(), end='')\n"
    )
    environment = dict(os.environ, GYMCKPT_PURE_PYTHON="1")
    done = subprocess.run([sys.executable, "-c", program], env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"episode_id": "x","v":NaN,"n":1180591620717411303424}\n'


@pytest.mark.parametrize(
    "number",
    [2**64, -(2**63) - 1, 10**4300, 10**4299 + 1, -(10**4301), 10**5000 + 7, 7 * 10**1200 + 10**600, -(2**20000) + 1],
    ids=lambda number: f"{'-' if number < 0 else ''}{number.bit_length()}_bits",
)
def test_int_fragment_writes_every_digit_without_touching_the_digit_limit(number: int) -> None:
    limit = sys.get_int_max_str_digits()
    written = bytes(orjson.dumps([_walks.int_fragment(number)]))[1:-1]
    assert sys.get_int_max_str_digits() == limit
    with codec._exact_context():
        assert written == str(number).encode()
        assert int(written) == number


# --- the table


class Level(enum.IntEnum):
    HIGH = 2


class Flags(enum.IntFlag):
    A = 1


class Weight(float, enum.Enum):
    HEAVY = 2.5


class Color(enum.Enum):
    RED = "red"


class Tag(str):
    pass


class Count(int):
    pass


class Ratio(float):
    pass


class MyDict(dict):
    pass


class MyList(list):
    pass


def nested(levels: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def _cycle_list() -> list[Any]:
    value: list[Any] = [1]
    value.append(value)
    return value


def _cycle_dict() -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    value["self"] = value
    return value


NAN, INF = float("nan"), float("inf")
SHARED = [1, NAN]
#: values a record may hold, as the payload of {"episode_id": "t", "v": value}
TRICKY: dict[str, Any] = {
    "nan": NAN,
    "inf": INF,
    "-inf": -INF,
    "-0.0": -0.0,
    "tiny": 5e-324,
    "huge_float": 1.7976931348623157e308,
    "int64_max": 2**63 - 1,
    "int64_min": -(2**63),
    "uint64_max": 2**64 - 1,
    "2**64": 2**64,
    "below_int64": -(2**63) - 1,
    "googol": 10**100,
    "-googol": -(10**100),
    "past_the_digit_limit": 10**5000 + 7,
    "true": True,
    "false": False,
    "none": None,
    "empty_string": "",
    "non_ascii": "é🙂中",
    "lone_surrogate": "\ud800",
    "empty_list": [],
    "empty_dict": {},
    "ints_summed": list(range(20)),
    "floats_summed": [i / 8 for i in range(20)],
    "floats_nan_last": [*(i / 8 for i in range(20)), NAN],
    "floats_inf_first": [INF, *(i / 8 for i in range(20))],
    "floats_overflowing_sum": [1.7976931348623157e308] * 10,
    "ints_big_last": [*range(20), 2**64],
    "ints_big_cancelling": [2**70, -(2**70), *range(10)],
    "mixed_numbers": [1, 2.5, True, *range(10)],
    "floats_and_a_big_int": [0.5, 2**70, *(i / 8 for i in range(10))],
    "floats_and_a_huge_int": [10**400, *(i / 8 for i in range(10))],
    "bools": [True, False] * 6,
    "int_enums": [Level.HIGH] * 10,
    "int_enum_among_ints": [*range(10), Level.HIGH],
    "int_flags": [Flags.A] * 10,
    "float_enums": [Weight.HEAVY] * 10,
    "enum": Color.RED,
    "int_enum": Level.HIGH,
    "tuple": (1, 2),
    "tuples": [(1, 2)] * 10,
    "set": {1},
    "uuid": uuid.UUID(int=7),
    "datetime": datetime.datetime(2024, 1, 2),
    "bytes": b"x",
    "decimal": decimal.Decimal("1.5"),
    "fragment": orjson.Fragment(b"[1,2]"),
    "str_subclass": Tag("t"),
    "int_subclass": Count(3),
    "int_subclasses": [Count(3)] * 10,
    "float_subclass": Ratio(0.5),
    "dict_subclass": MyDict(a=1),
    "ordered_dict": OrderedDict(a=1),
    "list_subclass": MyList([1]),
    "int_key": {1: "a"},
    "str_subclass_key": {Tag("k"): 1},
    "nan_in_the_middle_of_keys": {"z": 1, "m": NAN, "a": [2**64], "b": "end"},
    "shared_twice": [SHARED, SHARED],
    "deep_253": nested(253),
    "deep_254_nan": nested(253, NAN),
    "deep_255": nested(254),
    "deep_300_nan": nested(299, NAN),
    "cycle_list": _cycle_list(),
    "cycle_dict": _cycle_dict(),
    "messages": [
        {"role": "assistant", "token_ids": list(range(50)), "logprobs": [-i / 1024 for i in range(49)] + [NAN]},
        {"role": "user", "content": "hi", "tool_calls": None, "ts": 1.7e9},
    ],
}


def _record(name: str) -> dict[str, Any]:
    return {"episode_id": "t", "v": TRICKY[name]}


def _orjson_accepts(value: Any) -> bool:
    try:
        orjson.dumps(value, default=codec._refuse, option=codec._ORJSON_OPTIONS)
    except TypeError:
        return False
    return True


def _written(value: object) -> bytes | None:
    """What orjson writes of a fragment walk's result (None: refused, or orjson refuses it)."""
    if value is None:
        return None
    try:
        return orjson.dumps(value, default=codec._refuse, option=codec._ORJSON_OPTIONS)
    except TypeError:
        return b"<orjson refuses>"


def _sharing(original: Any, result: Any) -> Any:
    """Which containers of ``result`` are ``original``'s own (not copied), top-down."""
    if result is original:
        return "same"
    if type(original) is dict and type(result) is dict:
        return {key: _sharing(original[key], result[key]) for key in original}
    if type(original) is list and type(result) is list:
        return [_sharing(old, new) for old, new in zip(original, result, strict=True)]
    return "replaced"


#: the fast walk is asked only of what orjson has just written (encode_record), so only those are compared
WRITTEN_BY_ORJSON = sorted(name for name in TRICKY if _orjson_accepts(_record(name)))


@needs_accelerator
@pytest.mark.parametrize("name", WRITTEN_BY_ORJSON)
def test_both_fast_walks_agree_on_every_value_orjson_writes(name: str) -> None:
    record = _record(name)
    assert _exact.fast_path_safe(record) is _walks.fast_path_safe(record), name


@needs_accelerator
@pytest.mark.parametrize("name", sorted(TRICKY))
def test_both_fragment_walks_agree_on_every_value(name: str) -> None:
    record = _record(name)
    from_c, from_python = _exact.with_fragments(record), _walks.with_fragments(record)
    assert (from_c is None) is (from_python is None), name
    assert (from_c is record) is (from_python is record), name
    assert _written(from_c) == _written(from_python), name
    if from_c is not None:
        assert _sharing(record, from_c) == _sharing(record, from_python), name


EXPECTED_FAST = {
    "-0.0", "tiny", "huge_float", "int64_max", "int64_min", "uint64_max", "true", "false", "none",
    "empty_string", "non_ascii", "empty_list", "empty_dict", "ints_summed", "floats_summed",
    "floats_overflowing_sum", "mixed_numbers", "bools", "deep_253",
}  # fmt: skip
EXPECTED_FRAGMENTED = {
    "nan", "inf", "-inf", "2**64", "below_int64", "googol", "-googol", "past_the_digit_limit",
    "floats_nan_last", "floats_inf_first", "ints_big_last", "ints_big_cancelling", "floats_and_a_big_int",
    "floats_and_a_huge_int", "nan_in_the_middle_of_keys", "shared_twice", "deep_254_nan", "messages",
}  # fmt: skip
#: strings are orjson's to check: the fragment walk passes a lone surrogate on, orjson refuses it
EXPECTED_UNCHANGED = EXPECTED_FAST | {"lone_surrogate"}


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_each_walk_sorts_the_table_as_expected(walks: Walks, name: str) -> None:
    record = _record(name)
    if _orjson_accepts(record):
        assert walks.fast(record) is (name in EXPECTED_FAST), name
    result = walks.fragments(record)
    if name in EXPECTED_UNCHANGED:
        assert result is record, name
    elif name in EXPECTED_FRAGMENTED:
        assert result is not None and result is not record, name
        with codec._exact_context():  # the standard library reads back exactly the record
            assert_identical(record, json.loads(orjson.dumps(result)))
    else:
        assert result is None, name


def test_a_value_that_contains_itself_ends_the_fragment_walk(walks: Walks) -> None:
    for value in (_cycle_list(), _cycle_dict(), {"episode_id": "c", "v": [NAN, _cycle_list()]}):
        assert walks.fragments(value) is None


@needs_accelerator
def test_a_value_that_contains_itself_ends_the_c_fast_walk() -> None:
    """The Python fast walk is asked only of values orjson wrote (no cycle); the C one ends on its own too."""
    for value in (_cycle_list(), _cycle_dict(), {"episode_id": "c", "v": [1, _cycle_list()]}):
        assert _exact.fast_path_safe(value) is False


def test_fragment_walks_leave_the_original_alone(walks: Walks) -> None:
    original = {"episode_id": "o", "a": [1.0, NAN, {"n": 2**70, "k": [INF]}], "b": {"x": "kept"}}
    snapshot = json.dumps(original, allow_nan=True)
    result = walks.fragments(original)
    assert json.dumps(original, allow_nan=True) == snapshot
    assert isinstance(original["a"][1], float) and math.isnan(original["a"][1])
    assert result is not original
    assert result["b"] is original["b"]  # type: ignore[index]  # untouched containers are shared, not copied
    assert list(result) == list(original)  # type: ignore[arg-type]
    assert (
        orjson.dumps(result)
        == b'{"episode_id":"o","a":[1.0,NaN,{"n":1180591620717411303424,"k":[Infinity]}],"b":{"x":"kept"}}'
    )


@needs_accelerator
def test_the_c_walk_reports_a_list_that_changes_size_under_it() -> None:
    """Its big-integer callable runs Python code: a list it changes is an error, never a crash."""
    victim: list[Any] = [2**70, 1, 2]

    def shrinking(number: int) -> orjson.Fragment:
        victim.clear()
        return orjson.Fragment(str(number))

    _exact.configure(_walks.NAN, _walks.INFINITY, _walks.NEGATIVE_INFINITY, shrinking)
    try:
        with pytest.raises(RuntimeError, match="changed size"):
            _exact.with_fragments({"episode_id": "x", "v": victim})
    finally:
        _exact.configure(_walks.NAN, _walks.INFINITY, _walks.NEGATIVE_INFINITY, _walks.int_fragment)
    assert _exact.with_fragments({"episode_id": "x", "v": [2**70]}) is not None


# --- generated values: both implementations, compared

#: JSON values and values that are not quite (enums, tuples, subclasses), at any depth
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
ODD = st.sampled_from([Level.HIGH, Flags.A, Weight.HEAVY, Color.RED, (1,), Tag("t"), Count(1), Ratio(0.5), b"b"])
VALUES = st.recursive(
    st.one_of(SCALARS, SCALARS, SCALARS, ODD),
    lambda children: st.one_of(
        st.lists(children, max_size=12),
        st.dictionaries(st.text(max_size=5), children, max_size=5),
        st.builds(MyDict, st.dictionaries(st.text(max_size=3), children, max_size=2)),
    ),
    max_leaves=60,
)


@needs_accelerator
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES)
def test_both_implementations_agree_on_generated_values(value: Any) -> None:
    record = {"episode_id": "g", "v": value}
    if _orjson_accepts(record):
        assert _exact.fast_path_safe(record) is _walks.fast_path_safe(record)
    from_c, from_python = _exact.with_fragments(record), _walks.with_fragments(record)
    assert (from_c is None) is (from_python is None)
    assert (from_c is record) is (from_python is record)
    assert _written(from_c) == _written(from_python)


# --- the records codec through each pair of walks


@pytest.mark.parametrize(
    "value",
    [NAN, INF, -INF, 2**64, -(2**63) - 1, 10**5000 + 7, [1.5, NAN, -0.0], {"b": INF, "a": [2**70, "é"]}],
    ids=["nan", "inf", "-inf", "2**64", "below_int64", "5001_digits", "list", "dict"],
)
def test_nan_infinities_and_big_integers_are_written_by_orjson_and_read_back_exactly(walks: Walks, value: Any) -> None:
    record = {"episode_id": "ép-1", "first": 1, "v": value, "text": "é🙂\u2028", "last": [True, None]}
    _, line = encode_record(record)
    assert line.startswith(EXACT_PREFIX)
    # orjson's spelling after the exact prefix: compact, UTF-8
    assert b", " not in line[len(EXACT_PREFIX) :] and "é🙂".encode() in line
    assert_identical(record, decode_line(line))
    with codec._exact_context():  # plain JSON: the standard library reads it the same
        assert_identical(record, json.loads(line))
        again = json.loads(line)
    episode_id, decoded = decode_line_and_id(line)
    assert episode_id == "ép-1"
    assert_identical(record, decoded)
    assert encode_record(again)[1] == line  # deterministic


@pytest.mark.parametrize("name", ["int_enums", "int_enum_among_ints", "int_flags", "float_enums", "int_subclasses"])
def test_enums_in_a_long_list_of_numbers_are_refused_by_path(walks: Walks, name: str) -> None:
    """A list of IntEnum members sums like ints and orjson writes them as ints: still refused, by name."""
    for extra in ({}, {"nan": NAN}):
        with pytest.raises(NotJSONError) as raised:
            encode_record({"episode_id": "e", "v": TRICKY[name], **extra})
        assert raised.value.path.startswith("$.v[")


@pytest.mark.parametrize("extra", [{}, {"nan": NAN}, {"big": 2**80}], ids=["alone", "with_nan", "with_big_int"])
@pytest.mark.parametrize(
    "name", ["tuple", "tuples", "enum", "uuid", "fragment", "str_subclass", "dict_subclass", "str_subclass_key"]
)
def test_values_that_are_not_json_are_refused_on_every_path(walks: Walks, name: str, extra: dict[str, Any]) -> None:
    with pytest.raises(NotJSONError) as raised:
        encode_record({"episode_id": "e", "v": TRICKY[name], **extra})
    assert raised.value.episode_id == "e"
    assert raised.value.path.startswith("$.v")


def test_a_lone_surrogate_beside_a_nan_still_takes_the_standard_library(walks: Walks) -> None:
    record = {"episode_id": "s", "v": NAN, "text": "a\udc00b"}
    _, line = encode_record(record)
    assert line.startswith(EXACT_PREFIX) and b"\\udc00" in line and b'"v": NaN' in line  # json.dumps's spelling
    assert_identical(record, decode_line(line))


@pytest.mark.parametrize("levels", [253, 254, 300])
def test_nan_at_depth_round_trips(walks: Walks, levels: int) -> None:
    record = {"episode_id": "d", "v": nested(levels - 1, NAN)}
    _, line = encode_record(record)
    assert line.startswith(EXACT_PREFIX)
    assert_identical(record, decode_line(line))


def test_a_cycle_beside_a_nan_is_named(walks: Walks) -> None:
    with pytest.raises(NotJSONError, match="contains itself"):
        encode_record({"episode_id": "c", "nan": NAN, "v": _cycle_list()})


# --- lines written before the Fragment path, and decode_line_and_id


def _old_exact_line(record: dict[str, Any]) -> bytes:
    """An exact line as gymckpt wrote it before: json.dumps with ", " / ": ", ASCII escapes."""
    return json.dumps(record, ensure_ascii=True, allow_nan=True, separators=(",", ": ")).encode() + b"\n"


@pytest.mark.parametrize(
    "record",
    [
        {"episode_id": "é-1", "v": NAN, "s": "é🙂", "big": -(2**80)},
        {"episode_id": 'q"\\', "v": [INF, -INF, -0.0], "d": {"z": 1, "a": 2}},
        {"episode_id": "\ud800", "v": NAN},
    ],
    ids=["escaped_id", "quoted_id", "surrogate_id"],
)
def test_exact_lines_written_before_read_the_same(record: dict[str, Any]) -> None:
    line = _old_exact_line(record)
    assert line.startswith(EXACT_PREFIX)
    assert_identical(record, decode_line(line))
    episode_id, decoded = decode_line_and_id(line)
    assert episode_id == record["episode_id"]
    assert_identical(record, decoded)
    assert_identical(record, decode_line_and_id(memoryview(line)[:-1])[1])


@pytest.mark.parametrize(
    "line",
    [
        b'{"episode_id":"\\u00e9","v":1}',  # the id spelled with an escape: read from its token
        b'{"episode_id":"a\\/b","v":1}',
        b'{"episode_id":"x","v":[1,2]}',
        b'{"episode_id": "x", "v": NaN}',
    ],
)
def test_decode_line_and_id_agrees_with_reading_the_token_first(line: bytes) -> None:
    episode_id = codec.episode_id_of_line(line)
    assert decode_line_and_id(line) == (episode_id, codec.decode_record(line, episode_id))


@pytest.mark.parametrize(
    "line",
    [
        b'{"episode_id":"a","v":1,"episode_id":"b"}',
        b'{"episode_id": "a", "v": NaN, "episode_id": "b"}',
        b'{"episode_id":"a","episode_id":5}',
        b'{"episode_id":5}',
        b'{"episode_id":"a"',
        b"garbage",
        b'{"v":1,"episode_id":"a"}',
        b'{"episode_id" :"a","v":1}',
    ],
)
def test_decode_line_and_id_refuses_what_the_two_steps_refuse(line: bytes) -> None:
    with pytest.raises(RecordUndecodable) as two_steps:
        codec.decode_record(line, codec.episode_id_of_line(line))
    with pytest.raises(RecordUndecodable) as one_step:
        decode_line_and_id(line)
    assert one_step.value.reason == two_steps.value.reason


def test_fast_lines_start_as_before(walks: Walks) -> None:
    _, line = encode_record({"episode_id": "f", "v": [1, 2.5, "é"]})
    assert line == b'{"episode_id":"f","v":[1,2.5,"\xc3\xa9"]}\n'
    assert line.startswith(FAST_PREFIX)
