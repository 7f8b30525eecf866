"""The benchmark workloads: seeded, lazily generated chat-history-like records.

Every record is rebuilt from ``(seed, workload, index)`` alone, so a workload is a
generator (:meth:`Workload.records`) that never holds more than one record, and two
processes (the driver and an RSS subprocess) produce the identical records.

A record looks like one rollout's saved state in an RL environment server::

    {"episode_id": "12-3", "env": {...}, "messages": [{"role": ..., "content": ...,
     "tool_calls": null | [...], "ts": 1.7e9, "token_ids": [...], "logprobs": [...]}, ...],
     "reward": 0.5 | null, "done": false, "metrics": {...}}

- W1: 1,000 records of about 350 KB (340-360 KB), about 350 MB in all.
- W2: 16,000 records of 0.5-5 KB (triangular, mode 4.6 KB), about 53 MB in all.

In both, every 50th record (2%) holds a NaN (a logprob or a metric) and exactly one
record holds an integer beyond 64 bits, so the exact path of the codec is exercised.
Content strings mix ASCII words with some non-ASCII ones (accents, CJK, emoji).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["WORKLOADS", "Workload", "get_workload"]

_ASCII_TEXT = (
    "the of and to in is that for it as with was on be by at this are from or an have not they which one you "
    "were all we when there can been has more if will would what their about so no out up into only time "
    "function return value error file test patch diff class import module python repository issue fix "
    "agent tool call observation reward episode step policy rollout checkpoint server environment model "
    "token sample batch gradient loss update config retry timeout request response status output input "
    "search query result page line column index list dict string integer float boolean null true false"
)
_ASCII_WORDS = tuple(_ASCII_TEXT.split())
_NON_ASCII_TEXT = (
    "café naïve résumé Grüße Straße déjà façade smörgåsbord jalapeño coöperate über "
    "日本語 中文 한국어 東京 数据 模型 Привет мир Ελληνικά עברית العربية हिन्दी "
    "→ ✓ ∑ π Ω µs ½ 🙂 🚀 🤖 ⚠️"
)
_NON_ASCII_WORDS = tuple(_NON_ASCII_TEXT.split())
#: about 1 word in 14 is non-ASCII
_VOCABULARY = _ASCII_WORDS * 4 + _NON_ASCII_WORDS
_TOOLS = ("search", "open_file", "edit_file", "run_tests", "bash", "submit")
_ENVS = ("swe-gym", "math-verify", "web-shop", "code-contests", "text-arena")

_NAN_EVERY = 50
_NAN_OFFSET = 17
_BIG_INT = 2**72 + 12345


def _text(rng: random.Random, chars: int) -> str:
    words = rng.choices(_VOCABULARY, k=max(1, chars // 6))
    return " ".join(words)


def _token_ids(rng: random.Random, count: int) -> list[int]:
    return array("H", rng.randbytes(2 * count)).tolist()


def _logprobs(rng: random.Random, count: int) -> list[float]:
    # binary fractions in (-16, 0]: exact doubles with reprs of 3-13 characters
    return [-(value >> 2) / 1024 for value in array("H", rng.randbytes(2 * count))]


def _tool_calls(rng: random.Random) -> list[dict[str, Any]]:
    calls = []
    for _ in range(rng.randint(1, 2)):
        arguments = {"query": _text(rng, rng.randint(20, 120)), "limit": rng.randint(1, 50)}
        calls.append(
            {
                "id": f"call_{rng.getrandbits(48):012x}",
                "type": "function",
                "function": {"name": rng.choice(_TOOLS), "arguments": orjson.dumps(arguments).decode()},
            }
        )
    return calls


def _message(rng: random.Random, role: str, ts: float, scale: int) -> dict[str, Any]:
    """One chat message; ``scale`` is the typical content length in characters."""
    if role == "system":
        return {"role": role, "content": _text(rng, rng.randint(scale // 2, scale)), "tool_calls": None, "ts": ts}
    if role == "user":
        return {"role": role, "content": _text(rng, rng.randint(scale // 8, scale)), "tool_calls": None, "ts": ts}
    if role == "tool":
        return {
            "role": role,
            "content": _text(rng, rng.randint(scale // 4, 2 * scale)),
            "tool_calls": None,
            "tool_call_id": f"call_{rng.getrandbits(48):012x}",
            "ts": ts,
        }
    content = _text(rng, rng.randint(scale // 8, scale))
    tokens = max(1, len(content) // 4)
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": _tool_calls(rng) if rng.random() < 0.35 else None,
        "ts": ts,
        "token_ids": _token_ids(rng, tokens),
        "logprobs": _logprobs(rng, tokens),
        "finish_reason": rng.choice(("stop", "tool_calls", "length")),
    }


def build_record(index: int, rng: random.Random, target_bytes: int, *, nan: bool, big_int: bool) -> dict[str, Any]:
    """One record of about ``target_bytes`` encoded bytes (its first key is ``episode_id``)."""
    scale = 2000 if target_bytes > 50_000 else max(40, target_bytes // 16)
    record: dict[str, Any] = {
        "episode_id": f"{index // 8}-{index % 8}",
        "env": {
            "name": rng.choice(_ENVS),
            "task_id": f"task-{rng.getrandbits(32):08x}",
            "seed": rng.getrandbits(31),
            "step": 0,
        },
        "messages": [],
        "reward": None if rng.random() < 0.3 else rng.randint(0, 1000) / 1000,
        "done": rng.random() < 0.5,
        "metrics": {"turns": 0, "tokens": 0, "elapsed_s": rng.random() * 600},
    }
    messages: list[dict[str, Any]] = record["messages"]
    size = len(orjson.dumps(record))
    ts = 1.7e9 + rng.random() * 1e7
    role = "system"
    tokens = 0
    slack = target_bytes // 50
    misses = 0
    while size < target_bytes and misses < 8:
        message = _message(rng, role, ts, scale)
        encoded = len(orjson.dumps(message)) + 1
        if messages and size + encoded > target_bytes + slack:
            misses += 1  # would overshoot by more than 2%: try a shorter message
            continue
        messages.append(message)
        size += encoded
        tokens += len(message.get("token_ids", ()))
        ts += rng.random() * 30
        if role in ("system", "tool"):
            role = "assistant" if role == "tool" or rng.random() < 0.2 else "user"
        elif role == "user":
            role = "assistant"
        else:
            role = "tool" if message["tool_calls"] is not None else "user"
    record["env"]["step"] = len(messages)
    record["metrics"]["turns"] = len(messages)
    record["metrics"]["tokens"] = tokens
    if nan:
        assistant = [m for m in messages if m["role"] == "assistant"]
        if assistant and rng.random() < 0.7:
            logprobs = rng.choice(assistant)["logprobs"]
            logprobs[rng.randrange(len(logprobs))] = float("nan")
        else:
            record["metrics"]["value_estimate"] = float("nan")
    if big_int:
        record["metrics"]["state_hash"] = _BIG_INT
    return record


@dataclass(frozen=True)
class Workload:
    """A seeded stream of records; :meth:`records` generates them lazily."""

    name: str
    count: int
    #: encoded record sizes follow a triangular distribution (low, high, mode), in bytes
    low: int
    high: int
    mode: int
    seed: int = 0
    description: str = ""

    def rng(self, index: int) -> random.Random:
        return random.Random(f"gymckpt-bench:{self.name}:{self.seed}:{index}")

    @property
    def big_int_index(self) -> int:
        """The one record holding an integer beyond 64 bits."""
        return self.count // 3

    def has_nan(self, index: int) -> bool:
        return index % _NAN_EVERY == _NAN_OFFSET

    def record(self, index: int) -> dict[str, Any]:
        """Record ``index``, the same in every process."""
        rng = self.rng(index)
        target = round(rng.triangular(self.low, self.high, self.mode))
        return build_record(index, rng, target, nan=self.has_nan(index), big_int=index == self.big_int_index)

    def records(self) -> Iterator[dict[str, Any]]:
        """All records, one at a time."""
        for index in range(self.count):
            yield self.record(index)

    def shrunk(self, factor: int) -> Workload:
        """The same records, ``factor`` times fewer (for ``--quick``)."""
        return Workload(
            self.name, max(1, self.count // factor), self.low, self.high, self.mode, self.seed, self.description
        )

    def with_seed(self, seed: int) -> Workload:
        return Workload(self.name, self.count, self.low, self.high, self.mode, seed, self.description)


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", 1_000, 340_000, 360_000, 350_000, description="1,000 records of ~350 KB (~350 MB)"),
    "W2": Workload("W2", 16_000, 500, 5_000, 4_600, description="16,000 records of 0.5-5 KB (~53 MB)"),
}


def get_workload(name: str, *, seed: int = 0, quick: bool = False) -> Workload:
    """The workload called ``name`` (W1, W2), seeded, shrunk 10x when ``quick``."""
    try:
        workload = WORKLOADS[name.upper()].with_seed(seed)
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None
    return workload.shrunk(10) if quick else workload
