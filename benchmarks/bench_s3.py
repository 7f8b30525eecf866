"""S3 commit/restore through gymckpt (s3fs) beside raw s3fs ``pipe``/``cat`` of the same bytes.

::

    python -m benchmarks.bench_s3             # W1 (1,000 x ~350 KB) and W2 (16,000 x 0.5-5 KB)
    python -m benchmarks.bench_s3 --quick     # the same shapes, 10x fewer records
    python -m benchmarks.bench_s3 --endpoint-url http://127.0.0.1:9000 --bucket b   # an S3 you run

Without ``--endpoint-url`` a moto server runs in a child process on 127.0.0.1 (port 0),
so the server and the client do not share a GIL. Per repetition, on the same records
and moments apart: gymckpt ``write_participant`` (encode, hash, multipart upload to a
temporary key, server-side copy to ``records-<sha256>.jsonl``, conditional manifest)
and ``read_participant`` (one streamed GET, hash, decode every record), then raw s3fs
``pipe_file`` and ``cat_file`` of the records file's exact bytes (s3fs defaults:
50 MiB parts, 10 concurrent requests). Ratios are raw time / gymckpt time, i.e.
gymckpt's throughput as a fraction of raw s3fs's (the target is >= 0.8); each figure
is the median of the repetitions. To tell the backend from the JSON work, the same
bytes also go through the backend alone (``sink_only``: sink, finish, publish;
``stream_only``: one streamed GET hashed with sha256), and ``raw_copy_s`` times a
server-side copy alone: the price of publishing under the digest name only once complete.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = ["measure_s3", "small_records", "large_records"]

BUCKET = "gymckpt-bench"
_CHUNK = 4 << 20
_WORDS = [
    "the",
    "agent",
    "calls",
    "a",
    "tool",
    "and",
    "the",
    "model",
    "answers",
    "with",
    "tokens",
    "logprobs",
    "reward",
    "episode",
    "café",
    "東京",
    "🙂",
]


def large_records(count: int = 1_000, size: int = 350_000, *, seed: int = 0) -> Iterator[dict[str, Any]]:
    """W1-like: ``count`` chat-like records of about ``size`` encoded bytes each."""
    for index in range(count):
        rng = random.Random(f"w1:{seed}:{index}")
        messages = []
        total = 0
        while total < size:
            tokens = [rng.randrange(50_000) for _ in range(200)]
            content = " ".join(rng.choices(_WORDS, k=300))
            messages.append({"role": "assistant", "content": content, "token_ids": tokens, "logprob": -rng.random()})
            total += len(content) + 6 * len(tokens) + 60
        yield {"episode_id": f"{index // 8}-{index % 8}", "messages": messages, "reward": rng.random()}


def small_records(count: int = 16_000, *, seed: int = 0) -> Iterator[dict[str, Any]]:
    """W2-like: ``count`` records of 0.5-5 KB."""
    for index in range(count):
        rng = random.Random(f"w2:{seed}:{index}")
        target = round(rng.triangular(500, 5_000, 4_600))
        text = " ".join(rng.choices(_WORDS, k=max(1, target // 7)))
        yield {"episode_id": f"{index // 8}-{index % 8}", "state": {"step": index % 40, "text": text}}


def _workloads(quick: bool) -> dict[str, Callable[[], Iterable[dict[str, Any]]]]:
    """The suite's seeded W1/W2 (benchmarks.workloads) when importable, else this module's look-alikes."""
    try:
        from benchmarks.workloads import get_workload

        return {name: get_workload(name, quick=quick).records for name in ("W1", "W2")}
    except (ImportError, AttributeError, ValueError):
        shrink = 10 if quick else 1
        return {
            "W1": lambda: large_records(1_000 // shrink),
            "W2": lambda: small_records(16_000 // shrink),
        }


_SERVE_MOTO = """
import sys
from gymckpt.testing.moto import MotoEndpoint
endpoint = MotoEndpoint().start()
print(endpoint.url, flush=True)
sys.stdin.read()  # until the parent closes it
endpoint.stop()
"""


class _ChildMoto:
    """A moto server in a child process (its own GIL), on 127.0.0.1 and a free port."""

    def __enter__(self) -> str:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVE_MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._process.stdout is not None
        url = self._process.stdout.readline().strip()
        if not url.startswith("http://"):
            self._process.kill()
            raise RuntimeError("the moto server did not start")
        return url

    def __exit__(self, *exc_info: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()


def _credentials() -> dict[str, Any]:
    from gymckpt.testing.moto import DUMMY_KEY, DUMMY_SECRET

    return {"key": DUMMY_KEY, "secret": DUMMY_SECRET, "region": "us-east-1"}


def measure_s3(
    records_factory: Callable[[], Iterable[dict[str, Any]]],
    reps: int = 3,
    *,
    endpoint_url: str | None = None,
    bucket: str = BUCKET,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Commit and restore ``records_factory()``'s records through gymckpt, and raw-s3fs the same bytes.

    Starts a moto server in a child process unless ``endpoint_url`` is given (then
    ``storage_options`` carry the credentials and ``bucket`` must exist). Returns the
    median seconds of each step, MB/s, and the ratios raw time / gymckpt time.
    """
    if endpoint_url is None:
        with _ChildMoto() as url:
            options = {**_credentials(), **(storage_options or {})}
            return _measure(records_factory, reps, url, bucket, options, create_bucket=True)
    return _measure(records_factory, reps, endpoint_url, bucket, dict(storage_options or {}), create_bucket=False)


def _measure(
    records_factory: Callable[[], Iterable[dict[str, Any]]],
    reps: int,
    endpoint_url: str,
    bucket: str,
    options: dict[str, Any],
    *,
    create_bucket: bool,
) -> dict[str, Any]:
    import fsspec

    from gymckpt.store import open_store

    options["endpoint_url"] = endpoint_url
    raw_options = {key: value for key, value in options.items() if key in {"endpoint_url", "key", "secret"}}
    if "region" in options:
        raw_options["client_kwargs"] = {"region_name": options["region"]}
    raw = fsspec.filesystem("s3", skip_instance_cache=True, **raw_options)
    if create_bucket:
        raw.call_s3("create_bucket", Bucket=bucket)

    records = list(records_factory())  # generated once, untimed
    gc.collect()
    gc.freeze()  # the records weigh on no timed step, as in a server that built them long ago
    names = ("commit", "restore", "sink_only", "stream_only", "raw_pipe", "raw_cat", "raw_copy")
    steps: dict[str, list[float]] = {name: [] for name in names}
    size = 0
    try:
        with open_store(f"s3://{bucket}/bench", **options) as store:
            for rep in range(reps):
                checkpoint = f"rep-{rep}-{time.time_ns()}"
                began = time.perf_counter()
                manifest = store.write_participant(
                    checkpoint, kind="environment", instance="env-0", checkpoint_id="bench", records=iter(records)
                )
                steps["commit"].append(time.perf_counter() - began)
                size = manifest.records_bytes

                began = time.perf_counter()
                restored = list(store.read_participant(checkpoint, kind="environment", instance="env-0"))
                steps["restore"].append(time.perf_counter() - began)
                assert len(restored) == len(records)
                del restored

                records_object = f"{bucket}/bench/{manifest.records_path}"
                data = raw.cat_file(records_object)  # the exact bytes, untimed

                # the backend alone, without JSON: the same bytes through the sink, and read back
                began = time.perf_counter()
                sink = store.backend.open_sink(f"sink-{checkpoint}")
                for offset in range(0, len(data), _CHUNK):
                    sink.write(data[offset : offset + _CHUNK])
                sink.finish()
                sink.publish(manifest.records_file)
                steps["sink_only"].append(time.perf_counter() - began)
                began = time.perf_counter()
                digest = hashlib.sha256()
                with store.backend.open_read(f"sink-{checkpoint}/{manifest.records_file}") as stream:
                    while chunk := stream.read(_CHUNK):
                        digest.update(chunk)
                steps["stream_only"].append(time.perf_counter() - began)
                assert digest.hexdigest() == manifest.records_sha256
                target = f"{bucket}/raw/{checkpoint}.jsonl"
                began = time.perf_counter()
                raw.pipe_file(target, data)
                steps["raw_pipe"].append(time.perf_counter() - began)
                began = time.perf_counter()
                again = raw.cat_file(target)
                steps["raw_cat"].append(time.perf_counter() - began)
                assert again == data
                del again, data
                began = time.perf_counter()
                raw.copy(target, f"{target}.copy")
                steps["raw_copy"].append(time.perf_counter() - began)
                raw.rm([target, f"{target}.copy"])
    finally:
        gc.unfreeze()
    median = {name: statistics.median(values) for name, values in steps.items()}
    megabytes = size / 1e6
    return {
        "records": len(records),
        "bytes": size,
        "reps": reps,
        **{f"{name}_s": round(seconds, 3) for name, seconds in median.items()},
        "commit_MBps": round(megabytes / median["commit"], 1),
        "restore_MBps": round(megabytes / median["restore"], 1),
        "raw_pipe_MBps": round(megabytes / median["raw_pipe"], 1),
        "raw_cat_MBps": round(megabytes / median["raw_cat"], 1),
        "commit_ratio": round(median["raw_pipe"] / median["commit"], 2),
        "restore_ratio": round(median["raw_cat"] / median["restore"], 2),
        "sink_ratio": round(median["raw_pipe"] / median["sink_only"], 2),
        "stream_ratio": round(median["raw_cat"] / median["stream_only"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10x fewer records per workload")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per workload (median reported)")
    parser.add_argument("--workload", action="append", choices=["W1", "W2"], help="run only these")
    parser.add_argument("--endpoint-url", help="an S3 endpoint to use instead of a moto child process")
    parser.add_argument("--bucket", default=BUCKET, help="bucket (must exist with --endpoint-url)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    workloads = _workloads(args.quick)
    for name in args.workload or sorted(workloads):
        began = time.perf_counter()
        results[name] = measure_s3(workloads[name], args.reps, endpoint_url=args.endpoint_url, bucket=args.bucket)
        results[name]["wall_s"] = round(time.perf_counter() - began, 1)
        if not args.json:
            row = results[name]
            print(
                f"{name}: {row['records']} records, {row['bytes'] / 1e6:.1f} MB, median of {row['reps']}\n"
                f"  commit  {row['commit_s']:7.3f} s {row['commit_MBps']:7.1f} MB/s | raw pipe "
                f"{row['raw_pipe_s']:7.3f} s {row['raw_pipe_MBps']:7.1f} MB/s | ratio {row['commit_ratio']:.2f}x\n"
                f"  restore {row['restore_s']:7.3f} s {row['restore_MBps']:7.1f} MB/s | raw cat  "
                f"{row['raw_cat_s']:7.3f} s {row['raw_cat_MBps']:7.1f} MB/s | ratio {row['restore_ratio']:.2f}x\n"
                f"  backend alone, no JSON: sink+publish {row['sink_only_s']:.3f} s ({row['sink_ratio']:.2f}x raw pipe), "
                f"stream+sha256 {row['stream_only_s']:.3f} s ({row['stream_ratio']:.2f}x raw cat); "
                f"a server-side copy alone: {row['raw_copy_s']:.3f} s",
                flush=True,
            )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
