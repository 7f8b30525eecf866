"""``gymckpt demo --store-only``: the store alone, no servers.

Generated records of four participants (environment, model, agent, resources) are
written, published, verified offline, and one agent scope is read back and compared.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from gymckpt.store import open_store, verify

if TYPE_CHECKING:
    from collections.abc import Iterator

    from rich.console import Console

__all__ = ["run_store_demo"]


_WORDS = [
    "the",
    "agent",
    "calls",
    "the",
    "weather",
    "tool",
    "for",
    "Paris",
    "and",
    "the",
    "model",
    "answers",
    "with",
    "a",
    "short",
    "summary",
    "of",
    "the",
    "result",
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _chat(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, 40)}]
    for turn in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": f"call_{turn}", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": _text(rng, 60)})
    return messages


def _records(kind: str, episodes: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = random.Random(f"{seed}-{kind}")
    for index in range(episodes):
        key = f"{index // 4}-{index % 4}"
        step = rng.randint(0, 6)
        if kind == "environment":
            yield {
                "episode_id": key,
                "task_digest": hashlib.sha256(key.encode()).hexdigest(),
                "boundary": None if step == 0 else {"stage": "invoke_agent", "step": step},
            }
        elif kind == "model":
            yield {
                "episode_id": key,
                "cut": {
                    "tokens": [rng.randrange(50_000) for _ in range(rng.randint(16, 256))],
                    "logprob": rng.random(),
                },
            }
        elif kind == "agent":
            yield {"episode_id": key, "session": {"turn": step, "messages": _chat(rng, step)}}
        else:
            yield {
                "episode_id": key,
                "state": {"counter": rng.randint(0, 9), "score": float("nan") if step == 6 else step},
            }


def run_store_demo(
    store_url: str,
    *,
    episodes: int,
    seed: int,
    console: Console,
    storage_options: dict[str, Any] | None = None,
    embedded_endpoint: bool = False,
) -> int:
    """Run the store demo (``storage_options`` for object storage); return the process exit code."""
    checkpoint_dir = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    options = dict(storage_options or {})
    store = open_store(store_url, **options)
    rows = []
    manifests = []
    started = time.perf_counter()
    for kind in ("environment", "model", "agent", "resources"):
        began = time.perf_counter()
        manifest = store.write_participant(
            checkpoint_dir,
            kind=kind,
            instance=f"{kind}-0",
            checkpoint_id=checkpoint_dir,
            records=_records(kind, episodes, seed),
            extra={"demo_seed": seed},
        )
        manifests.append(manifest)
        rows.append((kind, manifest.record_count, manifest.records_bytes, time.perf_counter() - began))
    commit_seconds = time.perf_counter() - started
    store.publish(checkpoint_dir, manifests, extra={"trainer_step": 7})

    began = time.perf_counter()
    report = verify(f"{store_url.rstrip('/')}/{checkpoint_dir}", **options)
    verify_seconds = time.perf_counter() - began

    scope = [f"{index}-0" for index in range(min(8, episodes // 4))]
    began = time.perf_counter()
    restored = list(store.read_participant(checkpoint_dir, kind="agent", instance="agent-0", scope=scope))
    restore_seconds = time.perf_counter() - began
    expected = [record for record in _records("agent", episodes, seed) if record["episode_id"] in set(scope)]
    faithful = restored == expected

    table = Table(title=Text(f"Checkpoint {checkpoint_dir} in {store_url}"))
    for column in ("participant", "records", "bytes", "commit s"):
        table.add_column(column, justify="right" if column != "participant" else "left")
    for kind, count, size, seconds in rows:
        table.add_row(f"{kind}/{kind}-0", str(count), f"{size:,}", f"{seconds:.3f}")
    console.print(table)
    console.print(
        f"committed {sum(r[2] for r in rows):,} bytes in {commit_seconds:.3f} s; published gym/checkpoint.json\n"
        f"verify: {'OK' if report.ok else 'DAMAGED'} ({len(report.errors)} errors, {len(report.warnings)} warnings, "
        f"{report.records_checked} records re-hashed in {verify_seconds:.3f} s)\n"
        f"restore of agent scope {scope}: {len(restored)} records in {restore_seconds:.3f} s, "
        f"{'identical to what was committed' if faithful else 'DIFFERENT from what was committed'}\n"
        + (
            "the embedded S3 endpoint stops with the demo; against your own bucket: "
            "gymckpt verify s3://BUCKET/PREFIX/CHECKPOINT --endpoint-url URL"
            if embedded_endpoint
            else f"check it yourself: gymckpt verify {store_url.rstrip('/')}/{checkpoint_dir}"
        ),
        highlight=False,
        markup=False,
    )
    store.close()
    return 0 if report.ok and faithful and len(restored) == len(scope) else 1
