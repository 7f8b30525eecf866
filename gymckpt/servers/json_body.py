"""JSON on the reference servers' data routes: bodies read, canonical JSON and replies written with orjson.

The data routes carry whole conversations (an agent posts the conversation so far to the
policy model every turn), so parsing, hashing and replying are per-request costs that
saturate a server's event loop at scale. Here they run on orjson, with the standard
library as the fallback wherever orjson's result would differ:

- :func:`read_json` parses with :mod:`json` (exact: orjson would read an integer beyond 64
  bits as a float), without FastAPI's validation of the whole body.
- :func:`canonical_json` gives exactly ``json.dumps(value, sort_keys=True,
  separators=(",", ":"))`` encoded as UTF-8 (``ensure_ascii`` as asked): orjson writes the same
  bytes (both sort keys by code point, escape the same characters and print floats as the
  shortest round-trip repr) except for floats below 1e-4 (``1e-06`` against ``1e-6``),
  ``NaN``/``Infinity`` (orjson writes ``null``) and what orjson refuses (integers beyond
  64 bits, non-string keys); such values take the standard library's path.
- :class:`FastJSONResponse` writes a reply with orjson (the standard library for what
  orjson refuses).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import orjson
from starlette.responses import Response

from gymckpt.errors import InvalidRequest

if TYPE_CHECKING:
    from starlette.requests import Request

__all__ = ["FastJSONResponse", "canonical_json", "parse_json", "read_json", "read_json_object"]

#: output where orjson's bytes may differ from the standard library's: a float with a negative
#: exponent (``1e-6`` against ``1e-06``) or below 1e-4 written in full (``0.00001`` against ``1e-05``)
_DIVERGENT_FLOAT = re.compile(rb"[0-9]e-|(?:^|[:\[,])-?0\.0000")


def _may_diverge(out: bytes) -> bool:
    """True when orjson's ``out`` may hold a float the standard library writes otherwise (or a NaN it wrote
    as ``null``). Substring tests first: the regex alone costs more than orjson's whole encoding."""
    if b"null" in out:
        return True
    if b"e-" not in out and b"0.0000" not in out:
        return False
    return _DIVERGENT_FLOAT.search(out) is not None


def _stdlib_canonical(value: Any, ensure_ascii: bool) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii).encode()


def canonical_json(value: Any, *, ensure_ascii: bool = False) -> bytes:
    """``value`` as canonical JSON: exactly ``json.dumps(value, sort_keys=True, separators=(",", ":"),
    ensure_ascii=ensure_ascii)`` as UTF-8 bytes, written by orjson wherever its bytes are the same."""
    try:
        out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError: big integers, non-string keys, surrogates
        return _stdlib_canonical(value, ensure_ascii)
    # ``null`` may be a NaN or an infinity orjson wrote as null: only the standard library tells;
    # with ensure_ascii, orjson's bytes are the same only when nothing needed escaping
    if _may_diverge(out) or (ensure_ascii and not out.isascii()):
        return _stdlib_canonical(value, ensure_ascii)
    return out


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, exactly as the standard library reads it; ValueError when it is not JSON.

    Not orjson: it reads an integer beyond 64 bits as a float without a word, and telling such a
    body apart costs more than the standard library's own parse (which runs in C as well).
    """
    return json.loads(raw)


async def read_json(request: Request) -> Any:
    """The request's body as JSON; :class:`~gymckpt.errors.InvalidRequest` (422) when it is not JSON."""
    raw = await request.body()
    try:
        return parse_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from exc


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object; :class:`~gymckpt.errors.InvalidRequest` (422) otherwise."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {type(body).__name__}")
    return body


class FastJSONResponse(Response):
    """A JSON reply written with orjson (the standard library for what orjson refuses, e.g. big integers)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except TypeError:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
