"""encode_document writes exactly ``json.dumps(document, indent=2)`` (plus a newline), by either path.

Manifests and checkpoint indexes are compared byte for byte on a retry, also against
files an earlier gymckpt wrote, so the orjson shortcut (documents without floats, ASCII
strings) must never change a byte.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gymckpt.errors import NotJSONError
from gymckpt.store.codec import decode_document, encode_document


def reference(document: Any) -> bytes:
    return json.dumps(document, indent=2, ensure_ascii=True, allow_nan=True).encode("ascii") + b"\n"


ASCII = st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=12)
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    ASCII,
    ANY_TEXT,
)
DOCUMENTS = st.dictionaries(
    st.one_of(ASCII, ANY_TEXT),
    st.recursive(
        SCALARS,
        lambda children: st.one_of(st.lists(children, max_size=12), st.dictionaries(ASCII, children, max_size=4)),
        max_leaves=30,
    ),
    max_size=6,
)
PLAIN = st.dictionaries(
    ASCII,
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), ASCII),
        lambda children: st.one_of(st.lists(children, max_size=12), st.dictionaries(ASCII, children, max_size=4)),
        max_leaves=30,
    ),
    max_size=6,
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(DOCUMENTS, PLAIN))
def test_encode_document_writes_what_json_dumps_writes(document: dict[str, Any]) -> None:
    assert encode_document(document) == reference(document)


def test_every_ascii_character_is_escaped_as_json_dumps_escapes_it() -> None:
    text = "".join(chr(code) for code in range(128))
    for document in ({"t": text}, {text: 1}, {"t": text[:127]}, {"ids": [chr(code) for code in range(128)] * 2}):
        assert encode_document(document) == reference(document)


def test_a_manifest_like_document_reads_back() -> None:
    document = {
        "schema_version": 1,
        "kind": "environment",
        "records_bytes": 2**40,
        "episode_ids": sorted(f"{index // 8}-{index % 8}" for index in range(5000)),
        "nested": {"empty": {}, "list": [], "deep": [[["x"]]], "big": 2**70, "none": None},
    }
    data = encode_document(document)
    assert data == reference(document)
    assert decode_document(data) == document


@pytest.mark.parametrize("value", [(1, 2), {1, 2}, b"x", float("nan")], ids=["tuple", "set", "bytes", "nan"])
def test_what_json_cannot_hold_is_refused_and_nan_is_written(value: Any) -> None:
    document = {"a": 1, "v": [value]}
    if value != value:  # NaN: written as json.dumps writes it
        assert encode_document(document) == reference(document)
        return
    with pytest.raises(NotJSONError) as raised:
        encode_document(document)
    assert raised.value.path == "$.v[0]"
