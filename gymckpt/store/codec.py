"""The records codec: one JSON object per line, exact for every value JSON can hold.

Fast path: orjson, after one cheap type walk that finds what orjson would get wrong
(NaN and infinities, which it writes as ``null``; tuples, enums and UUIDs, which it
converts silently). Exact path, for records that hold NaN, +/-Infinity, integers beyond
64 bits, lone surrogates or nesting deeper than orjson accepts: the standard library's
``json.dumps`` format (``", "``-less items, ``": "`` after keys, ASCII escapes), the bytes
gymckpt has always written for such a record, so a commit retried after an upgrade hashes
the same. A compiled encoder writes those bytes where it is built; ``json.dumps`` itself
writes what it leaves (and everything without it).

A line from the exact path starts with ``{"episode_id": `` (a space after the colon);
a fast line starts with ``{"episode_id":"``. The decoder picks its decoder from that
prefix alone, so a big integer is never read back as a float by orjson. Both are plain
JSON that any reader accepts.

The type walk and the compiled encoder live in :mod:`gymckpt.store._walks` (C where a C
compiler worked at install); :data:`ACCELERATED` says whether the C ones run
(``GYMCKPT_PURE_PYTHON=1`` keeps to Python).

Reference-format records (read only, :func:`reference_episode_id_of_line` and
:func:`decode_reference_record`) are ``json.dumps`` lines: ``", "`` and ``": "``
separators, ``\\uXXXX`` escapes, ``NaN`` literals, and an episode id object
``{"episode_id": {"rollout_id": "r", "attempt": 0}, ...}``. They are always read by the
standard library's decoder, and their episode id is handed on as its capture key (``r``,
``r-aN``), so the layers above see one form. gymckpt's own lines never take that path.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import orjson

from gymckpt.errors import DuplicateKey, InvalidRecord, NotJSONError, RecordUndecodable
from gymckpt.identity import episode_key
from gymckpt.store import _walks
from gymckpt.store._walks import ACCELERATED
from gymckpt.store.bounds import RepeatedKey, check_document_cost, keys_repeated, unique_pairs

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "ACCELERATED",
    "MAX_DEPTH",
    "check_json",
    "decode_document",
    "decode_line",
    "decode_line_and_id",
    "decode_record",
    "decode_reference_record",
    "encode_document",
    "encode_record",
    "episode_id_of_line",
    "is_exact_line",
    "reference_episode_id_of_line",
    "rekeyed_line",
]

#: deepest nesting a record may have; deeper values are refused by name
MAX_DEPTH = 4096
EXACT_PREFIX = b'{"episode_id": '
FAST_PREFIX = b'{"episode_id":"'
#: a reference line whose episode id is an object
OBJECT_PREFIX = b'{"episode_id": {'
#: how far into a reference line its episode id object is looked for before the whole line is decoded
_OBJECT_HEAD = 1024

_ORJSON_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_SUBCLASS
_LINE_OPTIONS = _ORJSON_OPTIONS | orjson.OPT_APPEND_NEWLINE
#: what orjson writes before a record's episode id: ``{"episode_id":``
_FAST_HEAD = len(FAST_PREFIX) - 1
#: what encode_record uses (gymckpt.store._walks): the C walk and encoder where built, else the
#: Python walk and no encoder (json.dumps writes every exact line)
_fast_walk = _walks.FAST_WALK
_exact_encoder = _walks.EXACT_LINE
_SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
_EPISODE_ID_TOKEN = re.compile(rb'\{"episode_id": ?"((?:[^"\\]|\\.)*)"', re.DOTALL)


def _refuse(value: object) -> object:
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


#: encode_record's common case in one C call (the same answer, or None where the Python code decides);
#: None without the accelerator
_encode_line: Callable[[object], tuple[str, bytes] | None] | None = None
#: records.write_records' loop over records _encode_line writes (see _exact.c); None without the accelerator
_append_lines: Callable[..., tuple[int, bool, object]] | None = None
#: decode_line_and_id's common case (a fast line) in one C call, likewise
_decode_fast_line: Callable[[bytes | memoryview], tuple[str, dict[str, Any]] | None] | None = None
#: records.read_records' loop over a chunk's fast lines (see _exact.c); None without the accelerator
_decode_fast_lines: Callable[[bytes, int, int, list[str]], tuple[list[dict[str, Any]], int]] | None = None
if _walks.ACCELERATOR is not None:
    _walks.ACCELERATOR.configure_encoder(orjson.dumps, _refuse, _LINE_OPTIONS)
    _walks.ACCELERATOR.configure_decoder(orjson.loads)
    _encode_line = _walks.ACCELERATOR.encode_line
    _append_lines = _walks.ACCELERATOR.append_lines
    _decode_fast_line = _walks.ACCELERATOR.decode_line
    _decode_fast_lines = _walks.ACCELERATOR.decode_lines


def _exact_path_safe(value: object, *, check_strings: bool) -> int | None:
    """The nesting depth when the exact encoder can write ``value`` faithfully, else None.

    Like :func:`check_json` without building paths (which only the error needs);
    ``check_strings`` looks for surrogate pairs, needed only where orjson refused a string.
    """
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    pop = stack.pop
    push = stack.append
    pair = _SURROGATE_PAIR.search
    while stack:
        node, depth = pop()
        if depth > deepest:
            if depth > MAX_DEPTH:
                return None
            deepest = depth
        if type(node) is dict:
            for key, item in node.items():
                if type(key) is not str or (check_strings and pair(key)):
                    return None
                kind = type(item)
                if kind is dict or kind is list:
                    push((item, depth + 1))
                elif kind is str:
                    if check_strings and pair(item):
                        return None
                elif not (kind is int or kind is float or item is None or kind is bool):
                    return None
        else:
            for item in node:  # type: ignore[attr-defined]
                kind = type(item)
                if kind is dict or kind is list:
                    push((item, depth + 1))
                elif kind is str:
                    if check_strings and pair(item):
                        return None
                elif not (kind is int or kind is float or item is None or kind is bool):
                    return None
    return deepest


def _path_join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if isinstance(key, str) and key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _surrogate_pair_problem(text: str) -> bool:
    """True for a high surrogate followed by a low one: JSON's ``\\ud83d\\ude42`` reads back as one
    astral character, so such a string cannot round-trip and is refused."""
    return _SURROGATE_PAIR.search(text) is not None


def _cycle_path(value: object, root: str) -> str | None:
    """The path of the first container that holds one of its own ancestors, or None."""
    on_path: set[int] = set()
    stack: list[tuple[object, str, bool]] = [(value, root, False)]
    while stack:
        node, path, leaving = stack.pop()
        if leaving:
            on_path.discard(id(node))
            continue
        if type(node) is not dict and type(node) is not list:
            continue
        if id(node) in on_path:
            return path
        on_path.add(id(node))
        stack.append((node, path, True))
        items = node.items() if type(node) is dict else enumerate(node)  # type: ignore[union-attr, arg-type]
        stack.extend((item, _path_join(path, key), False) for key, item in items)
    return None


def check_json(value: object, *, episode_id: str | None = None, root: str = "$") -> int:
    """Raise :class:`NotJSONError` naming the first value JSON cannot hold; return the depth.

    Accepts exactly dict (string keys), list, str, int, float (NaN and infinities
    included), bool and None; refuses subclasses, tuples, sets, bytes, datetimes,
    strings holding a surrogate pair as two code points, and nesting deeper than
    :data:`MAX_DEPTH`. Values are visited in document order.
    """
    where = f"episode {episode_id!r}: " if episode_id is not None else ""

    def refuse(detail: str, path: str) -> NotJSONError:
        return NotJSONError(f"{where}{detail}", episode_id=episode_id, path=path)

    deepest = 0
    stack: list[tuple[object, str, int]] = [(value, root, 0)]
    while stack:
        node, path, depth = stack.pop()
        kind = type(node)
        if kind is dict or kind is list:
            depth += 1
            if depth > MAX_DEPTH:
                cycle = _cycle_path(value, root)
                if cycle is not None:
                    raise refuse(f"value at {cycle} contains itself (a reference cycle JSON cannot hold)", cycle)
                raise refuse(f"value at {path} nests deeper than {MAX_DEPTH} levels", path)
            deepest = max(deepest, depth)
            children: list[tuple[object, str, int]] = []
            if kind is dict:
                for key, item in node.items():  # type: ignore[attr-defined]
                    if type(key) is not str:
                        raise refuse(f"key {key!r} ({type(key).__name__}) at {path} is not a string", path)
                    if _surrogate_pair_problem(key):
                        raise refuse(f"key {key!r} at {path} holds a surrogate pair JSON would merge", path)
                    children.append((item, _path_join(path, key), depth))
            else:
                children.extend((item, _path_join(path, index), depth) for index, item in enumerate(node))  # type: ignore[arg-type]
            stack.extend(reversed(children))
        elif kind is str:
            if _surrogate_pair_problem(node):  # type: ignore[arg-type]
                raise refuse(f"string at {path} holds a surrogate pair JSON would merge into one character", path)
        elif not (kind is int or kind is float or kind is bool or node is None):
            raise refuse(
                f"value at {path} is a {kind.__name__}, not JSON "
                "(allowed: dict with str keys, list, str, int, float, bool, None)",
                path,
            )
    return deepest


_EXACT_LOCK = threading.Lock()


@contextmanager
def _exact_context(depth: int = MAX_DEPTH) -> Iterator[None]:
    """Let the standard library's recursive C encoder and decoder reach ``depth`` levels and
    convert integers of any size (a default process refuses more than 4,300 digits).

    Both limits are interpreter-wide, so exact work takes turns instead of changing them
    under each other's feet.
    """
    with _EXACT_LOCK:
        recursion = sys.getrecursionlimit()
        digits = sys.get_int_max_str_digits()
        sys.setrecursionlimit(recursion + depth + 100)
        sys.set_int_max_str_digits(0)
        try:
            yield
        finally:
            sys.set_int_max_str_digits(digits)
            sys.setrecursionlimit(recursion)


def _exact_dumps(value: object, depth: int, **options: Any) -> str:
    """``json.dumps`` that reaches ``depth`` and writes integers of any size."""
    if depth < 200:
        try:
            return json.dumps(value, ensure_ascii=True, allow_nan=True, **options)
        except ValueError:
            pass  # an integer beyond the process's digit limit: again, without the limit
    with _exact_context(depth):
        return json.dumps(value, ensure_ascii=True, allow_nan=True, **options)


def _exact_line(record: dict[str, Any], depth: int) -> bytes:
    return _exact_dumps(record, depth, separators=(",", ": ")).encode("ascii") + b"\n"


def _leading_episode_id(record: object) -> str:
    if type(record) is not dict:
        raise InvalidRecord(f"a record must be a dict, got {type(record).__name__}")
    for key in record:  # type: ignore[union-attr]
        value = record[key]  # type: ignore[index]
        if key != "episode_id":
            raise InvalidRecord(f"a record's first key must be 'episode_id', got {key!r}")
        if type(value) is not str or not value:
            raise InvalidRecord(f"a record's episode_id must be a non-empty str, got {value!r}")
        return value
    raise InvalidRecord("a record must not be empty: its first key is 'episode_id'")


def encode_record(record: dict[str, Any]) -> tuple[str, bytes]:
    """Return ``(episode_id, line)`` for one record; the line ends with a newline.

    Raises :class:`InvalidRecord` for a record without a leading ``episode_id`` and
    :class:`NotJSONError` (naming the episode and the path) for a value JSON cannot hold,
    a value that contains itself included.
    """
    if _encode_line is not None:
        encoded = _encode_line(record)
        if encoded is not None:
            return encoded
    episode_id = _leading_episode_id(record)
    # orjson first: it stops at 255 levels, so a value that contains itself ends here
    try:
        line = orjson.dumps(record, default=_refuse, option=_LINE_OPTIONS)
    except TypeError:
        strings_clean = False  # a big integer, a lone surrogate, deep nesting, a cycle, or not JSON
    else:
        if _fast_walk(record):
            return episode_id, line
        strings_clean = True  # NaN or an infinity (or a type orjson converts): orjson vouched for the strings
        del line
    if _exact_encoder is not None:
        line = _exact_encoder(record)  # json.dumps's bytes, or None for what it leaves to json.dumps
        if line is not None:
            return episode_id, line
    depth = _exact_path_safe(record, check_strings=not strings_clean)
    if depth is None:
        check_json(record, episode_id=episode_id)  # raises, naming the first bad value
        raise AssertionError("unreachable: check_json accepted what the exact path refused")  # pragma: no cover
    return episode_id, _exact_line(record, depth)


def is_exact_line(line: bytes | memoryview) -> bool:
    """True for a line the exact path wrote (it must be read by the exact decoder)."""
    return bytes(line[: len(EXACT_PREFIX)]) == EXACT_PREFIX


def decode_line(line: bytes | memoryview) -> dict[str, Any]:
    """Decode one records line (with or without its newline) into its record.

    A line holding a key twice in one object is damage (decoders keep the last, other readers the first).
    """
    data = line if type(line) is bytes else bytes(line)
    try:
        if data[:15] == EXACT_PREFIX:
            try:
                record = json.loads(data)
            except (ValueError, RecursionError):  # an integer beyond the digit limit, or deep: again, without limits
                with _exact_context():
                    record = json.loads(data)
        else:
            record = orjson.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise RecordUndecodable(f"line is not JSON: {exc}") from exc
    if type(record) is not dict or next(iter(record), None) != "episode_id":
        raise RecordUndecodable("line is not a JSON object whose first key is 'episode_id'")
    _refuse_repeated_keys(data, record)
    return record


def _refuse_repeated_keys(data: bytes, record: dict[str, Any]) -> None:
    """Raise :class:`RecordUndecodable` when an object of the line ``data`` holds a key twice, naming it."""
    repeated = keys_repeated(data, record)
    if repeated is False:
        return
    try:
        with _exact_context():  # the line decoded before, big integers and deep nesting included
            json.loads(data, object_pairs_hook=unique_pairs)
    except RepeatedKey as exc:
        raise RecordUndecodable(f"line holds the key {exc.key!r} twice in one object") from exc
    except (ValueError, RecursionError):
        pass
    if repeated:
        raise RecordUndecodable("line holds a key twice in one object")


def decode_line_and_id(line: bytes | memoryview) -> tuple[str, dict[str, Any]]:
    """``(episode_id, record)`` of a records line: :func:`episode_id_of_line` and :func:`decode_record`
    in one, with the same checks and errors.

    The id is taken from the decoded record and confirmed by comparing the line's leading
    token with the id as orjson writes it (what gymckpt writes); a line that spells it
    another way has its token read as :func:`episode_id_of_line` does.
    """
    if _decode_fast_line is not None:
        pair = _decode_fast_line(line)
        if pair is not None:
            return pair
    try:
        record = decode_line(line)
    except RecordUndecodable:
        episode_id_of_line(line)  # a line without a leading id string says so first, as before
        raise
    named = record["episode_id"]
    head = line[:15]
    start = 15 if head == EXACT_PREFIX else _FAST_HEAD if head == FAST_PREFIX else 0
    if start and type(named) is str:
        try:
            token = orjson.dumps(named)
        except TypeError:  # a lone surrogate: the token decides below
            pass
        else:
            if line[start : start + len(token)] == token:
                return named, record
    episode_id = episode_id_of_line(line)
    _check_named(record, episode_id)
    return episode_id, record


def _check_named(record: dict[str, Any], episode_id: str) -> None:
    if record["episode_id"] != episode_id:
        raise RecordUndecodable(
            f"line of episode {episode_id!r} names episode {record['episode_id']!r} too (the key 'episode_id' twice)"
        )


def decode_record(line: bytes | memoryview, episode_id: str) -> dict[str, Any]:
    """Decode a records line whose leading ``episode_id`` token read ``episode_id``.

    A line whose object names another episode id later (a decoder keeps the last one) is
    damage, so a record is always the episode its line starts with. The same id twice
    decodes to the same record and is not looked for: finding it would mean scanning every
    byte of every line again (about a fifth of a restore's decoding).
    """
    record = decode_line(line)
    _check_named(record, episode_id)
    return record


def episode_id_of_line(line: bytes | memoryview) -> str:
    """Read the leading episode_id of a line without decoding the rest of it."""
    match = _EPISODE_ID_TOKEN.match(line)
    if match is None:
        raise RecordUndecodable("line does not start with an episode_id string")
    raw = match.group(1)
    try:
        return json.loads(b'"' + raw + b'"') if b"\\" in raw else raw.decode("utf-8")
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordUndecodable(f"line's episode_id is not a JSON string: {exc}") from exc


def rekeyed_line(line: bytes, episode_id: str) -> bytes:
    """``line`` (one of gymckpt's records lines) with its leading episode id token replaced by ``episode_id``:
    the record decoded from the result is the line's, its ``episode_id`` (first key) ``episode_id``.

    Copies the line once and decodes nothing. Raises :class:`RecordUndecodable` for a line that
    does not start with an episode id string.
    """
    match = _EPISODE_ID_TOKEN.match(line)
    if match is None:
        raise RecordUndecodable("line does not start with an episode_id string")
    if line[:15] == EXACT_PREFIX:
        token = json.dumps(episode_id).encode("ascii")  # the exact path's escapes
    else:
        try:
            token = orjson.dumps(episode_id)
        except TypeError:  # a lone surrogate
            token = json.dumps(episode_id).encode("ascii")
    return b"".join((line[: match.start(1) - 1], token, line[match.end() :]))


def _reference_key(value: object) -> str:
    """The capture key of a reference record's ``episode_id`` (an object, or a key string)."""
    try:
        return episode_key(value)
    except ValueError as exc:
        raise RecordUndecodable(f"line's episode_id {value!r} is not an episode id: {exc}") from exc


#: every digit as ``0``, everything else as a space: a run of 19 zeros after it is 19 digits in a row,
#: which may be an integer beyond 64 bits (orjson would read it as a float). Found in a few ms per
#: MB of digits, where a regex takes ten times longer.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_LONG_DIGIT_RUN = b"0" * 19


def _decode_exact(data: bytes | memoryview) -> object:
    """A reference line decoded exactly: NaN, big integers and deep nesting included.

    orjson when it is exact (it refuses NaN, infinities, lone surrogates and deep nesting,
    and only integers beyond 64 bits would lose digits, so a line with 19 digits in a row
    goes to the stdlib decoder); the stdlib decoder otherwise.
    """
    data = bytes(data)
    if data.translate(_DIGITS_AS_ZEROS).find(_LONG_DIGIT_RUN) < 0:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # the stdlib decides: it reads what orjson refuses, or refuses it too
    try:
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            with _exact_context():  # an integer beyond the digit limit, or deep nesting: again, without limits
                return json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise RecordUndecodable(f"line is not JSON: {exc}") from exc


def _decode_reference_line(line: bytes | memoryview) -> dict[str, Any]:
    data = line if type(line) is bytes else bytes(line)
    record = _decode_exact(data)
    if type(record) is not dict or "episode_id" not in record:
        raise RecordUndecodable("line is not a JSON object with an 'episode_id'")
    _refuse_repeated_keys(data, record)
    return record


def reference_episode_id_of_line(line: bytes | memoryview) -> str:
    """The capture key a reference-format line names, reading as little of the line as it can.

    An ``{"episode_id": {...}`` line has its object decoded on its own; a line with a key
    string is read like gymckpt's; any other line (an ``episode_id`` that is not the first
    key) is decoded whole.
    """
    if line[:16] == OBJECT_PREFIX:
        head = bytes(line[15:_OBJECT_HEAD])
        end = head.find(b"}")
        if end >= 0:
            try:
                value = orjson.loads(head[: end + 1])  # an attempt beyond 64 bits is refused either way
            except ValueError:
                pass  # a "}" inside a string, or damage: the whole line decides
            else:
                return _reference_key(value)
    elif line[:15] == EXACT_PREFIX or line[:15] == FAST_PREFIX:
        return _reference_key(episode_id_of_line(line))
    return _reference_key(_decode_reference_line(line)["episode_id"])


def decode_reference_record(line: bytes | memoryview, episode_id: str) -> dict[str, Any]:
    """Decode a reference-format line that :func:`reference_episode_id_of_line` read as ``episode_id``.

    The record's ``episode_id`` becomes that capture key, in its place among the keys; a
    line whose object names another episode later is damage, as in :func:`decode_record`.
    """
    record = _decode_reference_line(line)
    named = _reference_key(record["episode_id"])
    if named != episode_id:
        raise RecordUndecodable(
            f"line of episode {episode_id!r} names episode {named!r} too (the key 'episode_id' twice)"
        )
    record["episode_id"] = episode_id
    return record


def _floatless(value: object) -> bool:
    """True when ``value`` holds only dicts, lists, str, int, bool and None (no float), at most
    :data:`gymckpt.store._walks.MAX_LEVELS` deep: a document orjson writes as ``json.dumps`` does, when ASCII."""
    stack = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if level > _walks.MAX_LEVELS:
            return False
        items = node.values() if type(node) is dict else node  # type: ignore[attr-defined]
        if type(items) is list and len(items) > _walks.SUMMED_LIST and list(map(type, items)).count(str) == len(items):
            continue  # a long list of strings (a manifest's episode ids)
        for item in items:  # type: ignore[attr-defined]
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, level + 1))
            elif not (kind is str or kind is int or kind is bool or item is None):
                return False
    return True


def encode_document(document: dict[str, Any]) -> bytes:
    """Encode a small document (manifest, checkpoint index) as exact, indented, ASCII JSON.

    The output depends only on the document, so a retried write compares bytes. It is the
    standard library's ``json.dumps(document, indent=2)``; orjson writes the same bytes, faster,
    for a document without floats whose strings are ASCII without DEL (which ``json.dumps``
    escapes), and does when it can.
    """
    if type(document) is dict and _floatless(document):
        try:
            data = orjson.dumps(document, default=_refuse, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
        except TypeError:
            pass  # an integer beyond 64 bits, a key that is not a str, a lone surrogate
        else:
            if data.isascii() and b"\x7f" not in data:
                return data
    kind = type(document)
    depth = _exact_path_safe(document, check_strings=True) if kind is dict or kind is list else None
    if depth is None:
        depth = check_json(document)  # raises, naming the first value JSON cannot hold
    return _exact_dumps(document, depth, indent=2).encode("ascii") + b"\n"


def decode_document(data: bytes, *, path: str = "", participant: str = "", what: str = "document") -> object:
    """Decode a JSON document: one :func:`encode_document` wrote, or any other encoding of it
    (the reference's sorted keys, ``indent=1``, no trailing newline). Raises ``ValueError``, and
    (naming ``path``) :class:`~gymckpt.errors.DocumentTooComplex` before decoding one over the
    parse budget (:mod:`gymckpt.store.bounds`) and :class:`~gymckpt.errors.DuplicateKey`.
    """
    check_document_cost(data, path=path, participant=participant, what=what)
    try:
        with _exact_context():
            return json.loads(data, object_pairs_hook=unique_pairs)
    except RepeatedKey as exc:
        raise DuplicateKey(
            f"{what} holds the key {exc.key!r} twice in one object", path=path, participant=participant
        ) from exc
    except RecursionError as exc:
        raise ValueError(f"nesting deeper than {MAX_DEPTH} levels") from exc
