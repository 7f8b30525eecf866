"""The codec's compiled helpers (gymckpt.store._exact) and their Python twins answer the same.

Two things decide how a record is written: the fast walk (orjson's line as it is, or not)
and, for a record orjson cannot write exactly, the exact line: ``json.dumps`` with ASCII
escapes and ``": "`` after keys, the bytes gymckpt has always written for it. Each exists
compiled (``fast_path_safe``, ``exact_line``) and in Python (``_walks.fast_path_safe``,
``json.dumps`` itself); the compiled ones run where they were built. Here both are run on a
table of tricky values and on generated ones and must agree byte for byte; then the records
codec is run through each, and the bytes of a few exact lines are pinned as literals. The
whole codec contract (test_codec.py) runs with the Python ones once more in
test_codec_pure_python.py.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import os
import shutil
import struct
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

from .codec_types import Color, Count, Level, MyDict, MyList, Ratio, Tag

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

try:
    from gymckpt.store import _exact  # type: ignore[attr-defined]
except ImportError:  # not built here: the C side of each comparison is skipped
    _exact = None

if _exact is not None:  # configured here too: with GYMCKPT_PURE_PYTHON=1 the codec leaves it alone
    _exact.configure_encoder(orjson.dumps, codec._refuse, codec._LINE_OPTIONS)
    _exact.configure_decoder(orjson.loads)

needs_accelerator = pytest.mark.skipif(_exact is None, reason="gymckpt.store._exact is not built (no C compiler)")


class Implementation:
    """One implementation's fast walk and exact encoder (None: json.dumps writes every exact line)."""

    def __init__(
        self, name: str, fast: Callable[[object], bool], exact: Callable[[object], bytes | None] | None
    ) -> None:
        self.name = name
        self.fast = fast
        self.exact = exact

    def __repr__(self) -> str:
        return self.name


PYTHON = Implementation("python", _walks.fast_path_safe, None)
C = Implementation("c", _exact.fast_path_safe, _exact.exact_line) if _exact is not None else None


@pytest.fixture(params=["c", "python"])
def walks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Implementation]:
    """Each implementation in turn, installed as the one encode_record uses."""
    chosen = PYTHON if request.param == "python" else C
    if chosen is None:
        pytest.skip("gymckpt.store._exact is not built (no C compiler)")
    monkeypatch.setattr(codec, "_fast_walk", chosen.fast)
    monkeypatch.setattr(codec, "_exact_encoder", chosen.exact)
    monkeypatch.setattr(codec, "_encode_line", None if chosen.exact is None else _exact.encode_line)
    monkeypatch.setattr(codec, "_append_lines", None if chosen.exact is None else _exact.append_lines)
    monkeypatch.setattr(codec, "_decode_fast_line", None if chosen.exact is None else _exact.decode_line)
    monkeypatch.setattr(codec, "_decode_fast_lines", None if chosen.exact is None else _exact.decode_lines)
    yield chosen


def _old_exact_line(record: object) -> bytes:
    """An exact line as gymckpt has always written it: json.dumps with "," / ": ", ASCII escapes."""
    with codec._exact_context():
        return json.dumps(record, ensure_ascii=True, allow_nan=True, separators=(",", ": ")).encode() + b"\n"


# --- the accelerator is there where it can be


def _c_compiler() -> str | None:
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    return shutil.which(compiler) if os.path.exists(headers) else None


@pytest.mark.skipif(os.environ.get("GYMCKPT_PURE_PYTHON", "") not in ("", "0"), reason="GYMCKPT_PURE_PYTHON is set")
def test_the_accelerator_is_built_and_used_where_a_c_compiler_exists() -> None:
    if _c_compiler() is None:
        assert not codec.ACCELERATED
        pytest.skip("no C compiler or Python headers here: the pure-Python path runs, tested by the rest of this file")
    assert _exact is not None, (
        "a C compiler is here but gymckpt.store._exact is not built: reinstall (pip install -e .)"
    )
    assert codec.ACCELERATED
    assert codec._fast_walk is _exact.fast_path_safe
    assert codec._exact_encoder is _exact.exact_line
    assert codec._encode_line is _exact.encode_line
    assert codec._append_lines is _exact.append_lines
    assert codec._decode_fast_line is _exact.decode_line
    assert codec._decode_fast_lines is _exact.decode_lines


def test_gymckpt_pure_python_keeps_to_python(tmp_path: Any) -> None:
    """GYMCKPT_PURE_PYTHON=1 in a fresh interpreter: the Python walk, json.dumps, the same bytes."""
    import subprocess

    program = (
        "from gymckpt.store import _walks, codec\n"
        "assert not codec.ACCELERATED\n"
        "assert codec._fast_walk is _walks.fast_path_safe and codec._exact_encoder is None\n"
        "assert codec._encode_line is codec._decode_fast_line is codec._append_lines is codec._decode_fast_lines is None\n"
        "_, line = codec.encode_record({'episode_id': 'x', 'v': float('nan'), 'n': 2**70})\n"
        "print(line.decode(), end='')\n"
    )
    environment = dict(os.environ, GYMCKPT_PURE_PYTHON="1")
    done = subprocess.run([sys.executable, "-c", program], env=environment, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"episode_id": "x","v": NaN,"n": 1180591620717411303424}\n'


# --- the table


class Flags(enum.IntFlag):
    A = 1


class Weight(float, enum.Enum):
    HEAVY = 2.5


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
    "surrogate_pair": "a\ud83d\ude42b",
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


#: the fast walk is asked only of what orjson has just written (encode_record), so only those are compared
WRITTEN_BY_ORJSON = sorted(name for name in TRICKY if _orjson_accepts(_record(name)))


@needs_accelerator
@pytest.mark.parametrize("name", WRITTEN_BY_ORJSON)
def test_both_fast_walks_agree_on_every_value_orjson_writes(name: str) -> None:
    record = _record(name)
    assert _exact.fast_path_safe(record) is _walks.fast_path_safe(record), name


EXPECTED_FAST = {
    "-0.0", "tiny", "huge_float", "int64_max", "int64_min", "uint64_max", "true", "false", "none",
    "empty_string", "non_ascii", "empty_list", "empty_dict", "ints_summed", "floats_summed",
    "floats_overflowing_sum", "mixed_numbers", "bools", "deep_253",
}  # fmt: skip
#: what the C encoder leaves to json.dumps: not exactly JSON, deeper than 254 levels, a cycle,
#: more digits than the interpreter converts at once
LEFT_TO_PYTHON = {
    "past_the_digit_limit", "int_enums", "int_enum_among_ints", "int_flags", "float_enums", "enum",
    "int_enum", "tuple", "tuples", "set", "uuid", "datetime", "bytes", "decimal", "fragment",
    "str_subclass", "int_subclass", "int_subclasses", "float_subclass", "dict_subclass", "ordered_dict",
    "list_subclass", "int_key", "str_subclass_key", "deep_255", "deep_300_nan", "cycle_list", "cycle_dict",
    "surrogate_pair",
}  # fmt: skip


@pytest.mark.parametrize("name", WRITTEN_BY_ORJSON)
def test_each_fast_walk_sorts_the_table_as_expected(walks: Implementation, name: str) -> None:
    assert walks.fast(_record(name)) is (name in EXPECTED_FAST), name


@needs_accelerator
@pytest.mark.parametrize("name", sorted(TRICKY))
def test_the_c_exact_line_is_json_dumps_byte_for_byte(name: str) -> None:
    record = _record(name)
    line = _exact.exact_line(record)
    if name in LEFT_TO_PYTHON:
        assert line is None, name
    else:
        assert line == _old_exact_line(record), name


def test_a_value_that_contains_itself_ends_the_c_walks() -> None:
    if _exact is None:
        pytest.skip("gymckpt.store._exact is not built (no C compiler)")
    for value in (_cycle_list(), _cycle_dict(), {"episode_id": "c", "v": [1, _cycle_list()]}):
        assert _exact.fast_path_safe(value) is False
        assert _exact.exact_line(value) is None


def test_the_c_exact_line_leaves_the_digit_limit_alone() -> None:
    if _exact is None:
        pytest.skip("gymckpt.store._exact is not built (no C compiler)")
    limit = sys.get_int_max_str_digits()
    assert _exact.exact_line([10**4299 + 1]) == _old_exact_line([10**4299 + 1])
    assert _exact.exact_line([10**4300]) is None  # 4,301 digits: json.dumps writes it, with the limit lifted
    assert sys.get_int_max_str_digits() == limit


def _python_encode(record: dict[str, Any]) -> tuple[str, bytes] | str:
    """encode_record on the Python path with the C walk and exact_line (no encode_line), or the error's name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "_encode_line", None)
        patch.setattr(codec, "_fast_walk", _exact.fast_path_safe)
        patch.setattr(codec, "_exact_encoder", _exact.exact_line)
        try:
            return encode_record(record)
        except (NotJSONError, codec.InvalidRecord) as exc:
            return type(exc).__name__


def _assert_encode_line_agrees(record: Any) -> None:
    encoded = _exact.encode_line(record)
    if encoded is not None:
        assert encoded == _python_encode(record)


@needs_accelerator
@pytest.mark.parametrize("name", sorted(TRICKY))
def test_encode_line_is_encode_record_in_one_call(name: str) -> None:
    record = _record(name)
    _assert_encode_line_agrees(record)
    if name in EXPECTED_FAST:
        assert _exact.encode_line(record) == ("t", orjson.dumps(record, option=codec._LINE_OPTIONS))


@needs_accelerator
@pytest.mark.parametrize(
    "record",
    [
        {"v": 1, "episode_id": "late"},
        {"episode_id": ""},
        {"episode_id": 5},
        {},
        {"episode_id": Tag("t")},
        ("episode_id", "x"),
        {"episode_id": "big", "v": 2**70},
        {"episode_id": "tuple", "v": (1,)},
    ],
    ids=["id_not_first", "empty_id", "int_id", "empty", "str_subclass_id", "tuple", "big_int", "tuple_value"],
)
def test_encode_line_leaves_the_rest_to_python(record: Any) -> None:
    """No leading id, or a record orjson refuses: the Python code decides (and raises what it must)."""
    assert _exact.encode_line(record) is None


@needs_accelerator
def test_encode_line_calls_orjson_as_python_does() -> None:
    """orjson matches keyword names by identity: a call it refused would leave every record to Python."""
    record = {"episode_id": "k", "v": [1, 2.5, "é"], "n": None}
    assert _exact.encode_line(record) == ("k", b'{"episode_id":"k","v":[1,2.5,"\xc3\xa9"],"n":null}\n')
    assert _exact.encode_line({"episode_id": "k", "v": NAN}) == ("k", b'{"episode_id": "k","v": NaN}\n')


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


def _plain_json(value: Any) -> bool:
    """Exactly JSON types with str keys, no surrogate pair: what the C encoder must write itself."""
    kind = type(value)
    if kind is dict:
        return all(type(key) is str and _plain_json(key) and _plain_json(item) for key, item in value.items())
    if kind is list:
        return all(_plain_json(item) for item in value)
    if kind is str:
        return not codec._surrogate_pair_problem(value)
    return value is None or kind in (bool, int, float)


@needs_accelerator
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES)
def test_both_implementations_agree_on_generated_values(value: Any) -> None:
    record = {"episode_id": "g", "v": value}
    if _orjson_accepts(record):
        assert _exact.fast_path_safe(record) is _walks.fast_path_safe(record)
    line = _exact.exact_line(record)
    if _plain_json(value):
        assert line == _old_exact_line(record)
    else:
        assert line is None
    _assert_encode_line_agrees(record)


def _doubles(seed: int, count: int) -> list[float]:
    """Doubles from random bits, decimals of every length, dyadic fractions and float32 values."""
    import random

    rng = random.Random(seed)
    values: list[float] = []
    for _ in range(count):
        values.append(struct.unpack("<d", rng.randbytes(8))[0])
        values.append(round(rng.uniform(-1e6, 1e6), rng.randint(0, 12)))
        values.append(rng.randint(-(2**40), 2**40) / 2 ** rng.randint(0, 60))
        values.append(struct.unpack("<f", rng.randbytes(4))[0])
        values.append(rng.choice([1, -1]) * rng.randint(1, 999_999) * 10.0 ** rng.randint(-25, 25))
    return values


#: where float.__repr__ switches to an exponent, and the short path's edges
FLOAT_EDGES = [
    1e-4, 0.00010000000000000002, 9.999999999999999e-05, 1e-5, 0.1, 0.5, 1.0, 9.5, 123456789012345.0,
    999999999999999.9, 1e15, 1e15 + 1, 1e16, 1e16 - 2, 1e17, 2**53, 2**53 + 2, 0.1 + 0.2, 1 / 3, 2 / 3,
    5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.0, -0.0, 100.0, 1e22, 1e23,
]  # fmt: skip


@needs_accelerator
@pytest.mark.parametrize("seed", range(4))
def test_the_c_float_spelling_is_float_repr(seed: int) -> None:
    values = _doubles(seed, 20_000) + FLOAT_EDGES + [-value for value in FLOAT_EDGES]
    values = [value for value in values if value == value]  # NaN is spelled apart
    for start in range(0, len(values), 500):
        chunk = values[start : start + 500]
        if _exact.exact_line(chunk) != _old_exact_line(chunk):
            wrong = next(value for value in chunk if _exact.exact_line([value]) != _old_exact_line([value]))
            pytest.fail(f"{wrong!r}: {_exact.exact_line([wrong])!r}, json.dumps writes {_old_exact_line([wrong])!r}")


@needs_accelerator
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec=None), max_size=40))
def test_the_c_string_escapes_are_json_dumps(text: str) -> None:
    line = _exact.exact_line([text, {text: text}])
    if codec._surrogate_pair_problem(text):
        assert line is None
    else:
        assert line == _old_exact_line([text, {text: text}])


# --- the records codec through each implementation

#: records whose exact lines are pinned: the bytes gymckpt 0.x (before the C encoder) wrote for them,
#: spelled out from json.dumps's format ("," between items, ": " after keys, ASCII escapes, repr floats)
PINNED = [
    ({"episode_id": "a", "x": float("nan")}, b'{"episode_id": "a","x": NaN}\n'),
    (
        {"episode_id": "b", "v": [1.5, float("inf"), -float("inf"), -0.0, 1e16, 1e-07, 0.1, 2**64, -(2**63) - 1]},
        b'{"episode_id": "b","v": [1.5,Infinity,-Infinity,-0.0,1e+16,1e-07,0.1,18446744073709551616,'
        b"-9223372036854775809]}\n",
    ),
    (
        {"episode_id": "c\u00e9", "n": {"k": 2**72 + 12345, "z": None, "t": True}, "s": "caf\u00e9 \U0001f642\x7f\x01\n\"\\/"},
        b'{"episode_id": "c\\u00e9","n": {"k": 4722366482869645226041,"z": null,"t": true},'
        b'"s": "caf\\u00e9 \\ud83d\\ude42\\u007f\\u0001\\n\\"\\\\/"}\n',
    ),
    (
        {"episode_id": "d", "m": [{"role": "assistant", "logprobs": [-0.0009765625, -15.9990234375, float("nan")]}],
         "ts": 1700000123.4567, "e": {}, "l": []},
        b'{"episode_id": "d","m": [{"role": "assistant","logprobs": [-0.0009765625,-15.9990234375,NaN]}],'
        b'"ts": 1700000123.4567,"e": {},"l": []}\n',
    ),
]  # fmt: skip


@pytest.mark.parametrize(("record", "expected"), PINNED, ids=["nan", "numbers", "big_int_escapes", "nested"])
def test_exact_lines_are_the_bytes_gymckpt_always_wrote(
    walks: Implementation, record: dict[str, Any], expected: bytes
) -> None:
    """A commit retried after an upgrade hashes the same: the exact path's bytes never change."""
    episode_id, line = encode_record(record)
    assert line == expected
    assert line == _old_exact_line(record)
    assert episode_id == record["episode_id"]
    assert_identical(record, decode_line(line))


@pytest.mark.parametrize(
    "value",
    [NAN, INF, -INF, 2**64, -(2**63) - 1, 10**5000 + 7, [1.5, NAN, -0.0], {"b": INF, "a": [2**70, "é"]}],
    ids=["nan", "inf", "-inf", "2**64", "below_int64", "5001_digits", "list", "dict"],
)
def test_nan_infinities_and_big_integers_are_written_as_json_dumps_and_read_back_exactly(
    walks: Implementation, value: Any
) -> None:
    record = {"episode_id": "ép-1", "first": 1, "v": value, "text": "é🙂\u2028", "last": [True, None]}
    limit = sys.get_int_max_str_digits()
    _, line = encode_record(record)
    assert sys.get_int_max_str_digits() == limit
    assert line.startswith(EXACT_PREFIX)
    assert line == _old_exact_line(record)
    assert_identical(record, decode_line(line))
    with codec._exact_context():  # plain JSON: the standard library reads it the same
        again = json.loads(line)
    assert_identical(record, again)
    episode_id, decoded = decode_line_and_id(line)
    assert episode_id == "ép-1"
    assert_identical(record, decoded)
    assert encode_record(again)[1] == line  # deterministic


@pytest.mark.parametrize("name", ["int_enums", "int_enum_among_ints", "int_flags", "float_enums", "int_subclasses"])
def test_enums_in_a_long_list_of_numbers_are_refused_by_path(walks: Implementation, name: str) -> None:
    """A list of IntEnum members sums like ints and orjson writes them as ints: still refused, by name."""
    for extra in ({}, {"nan": NAN}):
        with pytest.raises(NotJSONError) as raised:
            encode_record({"episode_id": "e", "v": TRICKY[name], **extra})
        assert raised.value.path.startswith("$.v[")


@pytest.mark.parametrize("extra", [{}, {"nan": NAN}, {"big": 2**80}], ids=["alone", "with_nan", "with_big_int"])
@pytest.mark.parametrize(
    "name",
    [
        "tuple",
        "tuples",
        "enum",
        "uuid",
        "fragment",
        "str_subclass",
        "dict_subclass",
        "str_subclass_key",
        "surrogate_pair",
    ],
)
def test_values_that_are_not_json_are_refused_on_every_path(
    walks: Implementation, name: str, extra: dict[str, Any]
) -> None:
    with pytest.raises(NotJSONError) as raised:
        encode_record({"episode_id": "e", "v": TRICKY[name], **extra})
    assert raised.value.episode_id == "e"
    assert raised.value.path.startswith("$.v")


def test_a_lone_surrogate_beside_a_nan_is_escaped(walks: Implementation) -> None:
    record = {"episode_id": "s", "v": NAN, "text": "a\udc00b"}
    _, line = encode_record(record)
    assert line == b'{"episode_id": "s","v": NaN,"text": "a\\udc00b"}\n'
    assert_identical(record, decode_line(line))


@pytest.mark.parametrize("levels", [253, 254, 300])
def test_nan_at_depth_round_trips(walks: Implementation, levels: int) -> None:
    record = {"episode_id": "d", "v": nested(levels - 1, NAN)}
    _, line = encode_record(record)
    assert line == _old_exact_line(record)
    assert_identical(record, decode_line(line))


def test_a_cycle_beside_a_nan_is_named(walks: Implementation) -> None:
    with pytest.raises(NotJSONError, match="contains itself"):
        encode_record({"episode_id": "c", "nan": NAN, "v": _cycle_list()})


# --- lines written before, and decode_line_and_id


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


def test_fast_lines_start_as_before(walks: Implementation) -> None:
    _, line = encode_record({"episode_id": "f", "v": [1, 2.5, "é"]})
    assert line == b'{"episode_id":"f","v":[1,2.5,"\xc3\xa9"]}\n'
    assert line.startswith(FAST_PREFIX)


def _python_decode(line: bytes | memoryview) -> tuple[str, dict[str, Any]] | str:
    """decode_line_and_id on the Python path, or the reason it refuses the line."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "_decode_fast_line", None)
        try:
            return decode_line_and_id(line)
        except RecordUndecodable as exc:
            return exc.reason


LINES = [
    b'{"episode_id":"a","v":1}',
    b'{"episode_id":"a","v":1}\n',
    '{"episode_id":"é🙂","v":[1,2.5]}'.encode(),
    b'{"episode_id":"\\u00e9","v":1}',
    b'{"episode_id":"a\\"b","v":1}',
    b'{"episode_id":"a\\/b","v":1}',
    b'{"episode_id":"a","v":1,"episode_id":"b"}',
    b'{"episode_id":"a","episode_id":5}',
    b'{"episode_id":"ab","v":1}',
    b'{"episode_id":"a"',
    b'{"episode_id":""}',
    b'{"episode_id":"a"}',
    b'{"episode_id": "a","v": NaN}',
    b'{"episode_id":"a","v":NaN}',
    b'{"episode_id":"\xff","v":1}',
    b'{"episode_id":"a","v":1}garbage',
    b"garbage",
    b"",
]


@needs_accelerator
@pytest.mark.parametrize("line", LINES)
def test_decode_line_is_decode_line_and_id_in_one_call(line: bytes) -> None:
    for spelled in (line, memoryview(line), memoryview(b"xx" + line + b"yy")[2 : 2 + len(line)]):
        pair = _exact.decode_line(spelled)
        if pair is not None:
            assert pair == _python_decode(spelled)
            assert type(pair[0]) is str


def test_decode_line_answers_fast_lines_itself() -> None:
    if _exact is None:
        pytest.skip("gymckpt.store._exact is not built (no C compiler)")
    assert _exact.decode_line(b'{"episode_id":"a","v":[1,2.5]}') == ("a", {"episode_id": "a", "v": [1, 2.5]})
    assert _exact.decode_line('{"episode_id":"é","v":1}'.encode()) == ("é", {"episode_id": "é", "v": 1})
    for left in (b'{"episode_id":"a","v":1,"episode_id":"b"}', b'{"episode_id": "a","v": NaN}', b"garbage"):
        assert _exact.decode_line(left) is None


@needs_accelerator
@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), VALUES)
def test_decode_line_agrees_on_generated_lines(episode_id: str, value: Any) -> None:
    try:
        line = orjson.dumps({"episode_id": episode_id, "v": value}, option=codec._ORJSON_OPTIONS)
    except TypeError:
        return
    pair = _exact.decode_line(line)
    if pair is not None:
        assert pair == _python_decode(line)
