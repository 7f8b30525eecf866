"""Token ids and logprobs packed into strings: how the reference servers' records carry generations.

A generation's token ids and logprobs are the bulk of a model server's records. As JSON
lists of numbers they cost the most to write and read back (every number formatted and
parsed: measured at a fifth of the speed of the same bytes of strings), so the ledger
rows and cut prefixes carry them packed: token ids as little-endian int32, logprobs as
little-endian float64 (exact: every float comes back bit for bit), each base64-encoded.
:func:`unpack_token_ids` and :func:`unpack_logprobs` give the lists back.
"""

from __future__ import annotations

import base64
import sys
from array import array

__all__ = ["TOKEN_ENCODING", "pack_logprobs", "pack_token_ids", "unpack_logprobs", "unpack_token_ids"]

#: what a record names the packing by
TOKEN_ENCODING = "base64:int32le,float64le"
_SWAP = sys.byteorder != "little"


def _pack(kind: str, values: list[int] | list[float] | array) -> str:  # type: ignore[type-arg]
    if isinstance(values, array) and values.typecode == kind and not _SWAP:
        return base64.b64encode(values).decode("ascii")  # its bytes as they are: no copy
    packed = array(kind, values)
    if _SWAP:
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack(kind: str, text: str) -> array:  # type: ignore[type-arg]
    values = array(kind)
    values.frombytes(base64.b64decode(text, validate=True))
    if _SWAP:
        values.byteswap()
    return values


def pack_token_ids(tokens: list[int] | array) -> str:  # type: ignore[type-arg]
    """Token ids (each within int32) as base64 of little-endian int32."""
    return _pack("i", tokens)


def pack_logprobs(logprobs: list[float] | array) -> str:  # type: ignore[type-arg]
    """Logprobs as base64 of little-endian float64 (exact)."""
    return _pack("d", logprobs)


def unpack_token_ids(text: str) -> list[int]:
    """The token ids :func:`pack_token_ids` packed."""
    return _unpack("i", text).tolist()


def unpack_logprobs(text: str) -> list[float]:
    """The logprobs :func:`pack_logprobs` packed."""
    return _unpack("d", text).tolist()
