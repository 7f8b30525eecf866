"""The fake inference backend's deterministic token and logprob streams.

Tokens are a function of ``(seed, prompt)``, their logprobs of ``(seed, prompt's sha256)``:
each a sha256-seeded :class:`random.Random` stream, so a longer generation extends a
shorter one and a continued generation makes the tokens an uncut one would.
"""

from __future__ import annotations

import hashlib
import random

__all__ = [
    "VOCAB_SIZE",
    "draw_tokens",
    "generate_tokens",
    "logprob_stream",
    "next_logprob",
    "token_logprobs",
    "token_stream",
]

#: token ids are drawn from ``range(VOCAB_SIZE)``
VOCAB_SIZE = 32_000


def token_stream(seed: int, prompt: str) -> random.Random:
    """The random stream whose :func:`draw_tokens` draws are the tokens of ``(seed, prompt)``."""
    digest = hashlib.sha256(f"{seed}\n{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


#: the bits of one draw: a draw at or above VOCAB_SIZE is drawn again
_TOKEN_BITS = VOCAB_SIZE.bit_length()


def draw_tokens(rng: random.Random, count: int) -> list[int]:
    """The next ``count`` tokens of a :func:`token_stream`: uniform in ``range(VOCAB_SIZE)`` by rejection of
    ``getrandbits`` draws (``randrange``'s own method, without its per-call argument handling)."""
    getrandbits = rng.getrandbits
    tokens = []
    for _ in range(count):
        token = getrandbits(_TOKEN_BITS)
        while token >= VOCAB_SIZE:
            token = getrandbits(_TOKEN_BITS)
        tokens.append(token)
    return tokens


def generate_tokens(seed: int, prompt: str, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of ``(seed, prompt)`` (what ``/generate`` answers, without delay)."""
    return draw_tokens(token_stream(seed, prompt), max_tokens)


def logprob_stream(seed: int, prompt_sha256: str) -> random.Random:
    """The random stream whose :func:`next_logprob` draws are the logprobs of ``(seed, prompt)``."""
    return random.Random(int.from_bytes(hashlib.sha256(f"logprobs\n{seed}\n{prompt_sha256}".encode()).digest(), "big"))


def next_logprob(rng: random.Random) -> float:
    """The next logprob of a :func:`logprob_stream` (6 decimals)."""
    return -round(rng.expovariate(2.0), 6)


def token_logprobs(seed: int, prompt_sha256: str, count: int) -> list[float]:
    """The logprobs of the first ``count`` tokens of ``(seed, prompt)`` (``prompt_sha256``: the prompt's sha256
    hex): a stream of their own, so the tokens stay those of :func:`generate_tokens`; 6 decimals."""
    rng = logprob_stream(seed, prompt_sha256)
    return [next_logprob(rng) for _ in range(count)]
