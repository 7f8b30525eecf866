"""What a reader takes of bytes it did not write: bounded lines, documents under a budget, no key twice.

Memory of a read must follow what the manifest allows, not what lies on disk:

- **Records lines.** gymckpt's writer records the size of its largest line in the manifest
  (``max_record_bytes``, newline included); a reader holds no line longer than that. A
  manifest without it (an older gymckpt's, or the reference's) allows :data:`MAX_LINE_BYTES`,
  or the file's claimed size when smaller. A longer line is damage
  (:class:`~gymckpt.errors.RecordTooLong`); the reader keeps hashing past it without holding
  it, so a file that is damaged as a whole (a crash that left zeros) is reported by its digest.
- **Documents** (manifests, ``gym/checkpoint.json``). Their size is checked before they are
  read (:func:`read_document_bytes`), and what decoding would cost is estimated from a few
  byte counts before a byte is decoded (:func:`document_cost`); a document estimated over
  :data:`DOCUMENT_BUDGET` is refused (:class:`~gymckpt.errors.DocumentTooComplex`).
- **Keys.** JSON decoders keep the last of two equal keys, other readers the first, so a
  document or record holding a key twice means different things to different readers: it is
  damage. :func:`keys_repeated` finds one in a decoded record without a second parse;
  :func:`unique_pairs` refuses one while a document is decoded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from gymckpt.errors import DocumentTooComplex, FileTooLarge, NotRegularFile

if TYPE_CHECKING:
    from gymckpt.store.backend import StorageBackend

__all__ = [
    "DOCUMENT_BUDGET",
    "MAX_LINE_BYTES",
    "RepeatedKey",
    "check_document_cost",
    "document_cost",
    "keys_repeated",
    "line_limit",
    "read_document_bytes",
    "unique_pairs",
]

#: the longest records line (newline included) read where the manifest names no ``max_record_bytes``
MAX_LINE_BYTES = 64 << 20

#: the most a manifest or checkpoint.json may cost decoded, as :func:`document_cost` estimates it.
#: gymckpt's manifest of 1,000,000 episode ids of 18 characters (24.8 MiB) is estimated at 118 MiB
#: (read_manifest peaks 136 MiB above its baseline, its bytes and the ids' tuple included); ids of
#: up to about 80 characters fit. A 60 MiB manifest of ``[],[],…`` is estimated at 2.6 GiB and
#: refused, having cost its bytes (60 MiB).
DOCUMENT_BUDGET = 256 << 20

# what one of each costs decoded, in bytes (CPython 3.11, 64-bit; measured with tracemalloc,
# rounded up): a list with its over-allocation; a dict with its key table; a str object without
# its characters; a reference in a container; a number object (int or float) beyond the cached ones
_LIST = 80
_DICT = 200
_STRING = 64
_REFERENCE = 8
_NUMBER = 32


def line_limit(max_record_bytes: int | None, records_bytes: int | None) -> int:
    """The longest records line (newline included) a reader holds for a manifest claiming these.

    ``max_record_bytes`` where the manifest has it (what its writer measured); otherwise
    :data:`MAX_LINE_BYTES`, or ``records_bytes`` when smaller.
    """
    if max_record_bytes is not None:
        return max_record_bytes
    return MAX_LINE_BYTES if records_bytes is None else min(MAX_LINE_BYTES, records_bytes)


def document_cost(data: bytes) -> int:
    """An estimate, from byte counts alone, of what decoding ``data`` as JSON costs in memory.

    A bound from above for every document: each ``[`` and ``{`` is taken for a container, each
    pair of quotes for a string, each ``,`` and ``:`` for one more value (outside strings or
    not); the text is decoded whole before it is parsed and the strings hold its characters,
    a byte each for ASCII (gymckpt writes its documents so, as the reference does) and up to
    four otherwise, or where ``\\u`` escapes may decode to wide characters. Measured documents
    cost 0.4-0.8 of it.
    """
    lists = data.count(b"[")
    dicts = data.count(b"{")
    strings = data.count(b'"') // 2
    values = data.count(b",") + data.count(b":") + lists + dicts + 1
    numbers = max(0, values - strings - lists - dicts)
    ascii_text = data.isascii()
    text = len(data) if ascii_text else 4 * len(data)
    characters = len(data) if ascii_text and b"\\u" not in data else 4 * len(data)
    containers = _LIST * lists + _DICT * dicts
    return text + characters + containers + _STRING * strings + _REFERENCE * values + _NUMBER * numbers


def check_document_cost(data: bytes, *, path: str = "", participant: str = "", what: str = "document") -> None:
    """Raise :class:`DocumentTooComplex` when :func:`document_cost` of ``data`` passes :data:`DOCUMENT_BUDGET`."""
    cost = document_cost(data)
    if cost > DOCUMENT_BUDGET:
        raise DocumentTooComplex(
            f"{what} of {len(data)} bytes would cost about {cost >> 20} MiB decoded, over the parse budget of "
            f"{DOCUMENT_BUDGET >> 20} MiB: refused undecoded",
            path=path,
            participant=participant,
        )


def read_document_bytes(
    backend: StorageBackend, path: str, limit: int, *, participant: str = "", what: str = "document"
) -> bytes:
    """The bytes of a small file, refused unread when the storage says it is over ``limit``.

    The read itself stops after ``limit`` + 1 bytes, so a file that grew after it was measured
    is refused as well, having cost no more than that. Raises :class:`FileTooLarge`,
    ``FileNotFoundError``, and the backend's :class:`NotRegularFile` naming ``participant``.
    """
    try:
        size = backend.size(path)
        if size > limit:
            raise FileTooLarge(
                f"{what} has {size} bytes, more than {limit}: refused unread", path=path, participant=participant
            )
        parts: list[bytes] = []
        taken = 0
        # first the size measured and a byte more (growth shows): a file that kept its size is one read, not joined
        request = size + 1
        with backend.open_read(path) as stream:
            while taken <= limit and (part := stream.read(request)):
                parts.append(part)
                taken += len(part)
                request = min(limit + 1 - taken, 1 << 20)
    except NotRegularFile as exc:
        raise NotRegularFile(exc.reason, path=exc.path or path, participant=participant) from exc
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > limit:
        raise FileTooLarge(
            f"{what} grew past {limit} bytes while it was read: refused", path=path, participant=participant
        )
    return data


class RepeatedKey(ValueError):
    """A JSON object holds ``key`` twice (raised while a document is decoded)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object")
        self.key = key


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: the object as a dict, refusing a key it holds twice."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(key)
            seen.add(key)
    return document


def _dict_keys(record: dict[str, Any]) -> int:
    """How many keys the dicts in ``record`` hold together."""
    total = 0
    stack: list[Any] = [record]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            total += len(node)
            items = node.values()
        else:
            items = node
            if len(node) > 16:
                kinds = set(map(type, node))
                if dict not in kinds and list not in kinds:
                    continue  # a list of numbers or strings: no keys under it
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append(item)
    return total


def _colons_in_strings(record: dict[str, Any]) -> int:
    """How many ``:`` the keys and strings in ``record`` hold together."""
    total = 0
    stack: list[Any] = [record]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            for key in node:
                total += key.count(":")
            items = node.values()
        else:
            items = node
        for item in items:
            kind = type(item)
            if kind is str:
                total += item.count(":")
            elif kind is dict or kind is list:
                stack.append(item)
    return total


def keys_repeated(data: bytes, record: dict[str, Any]) -> bool | None:
    """Whether the JSON text ``data`` holds a key twice in one object, given what it decoded to.

    False for a line orjson writes back byte for byte from its record (every fast line gymckpt
    writes): a repeated key would be missing from the record. Otherwise True or False when the
    counts decide: a text's keys are its colons outside strings, and its decoded dicts hold as
    many keys exactly when no object repeated one (a repeated key drops at least itself). None
    when they cannot decide cheaply (a ``:`` escaped as ``\\u003a``): the caller decodes again
    with :func:`unique_pairs`.
    """
    try:
        again = orjson.dumps(record)
    except TypeError:
        again = b""  # an integer beyond 64 bits: counted below
    if again and data.startswith(again) and data[len(again) :] in (b"", b"\n"):
        return False
    colons = data.count(b":")
    keys = _dict_keys(record)
    if keys == colons:
        return False  # keys <= keys in the text <= colons: equal throughout
    if b"\\u003a" in data or b"\\u003A" in data:
        return None
    return keys != colons - _colons_in_strings(record)
