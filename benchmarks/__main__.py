"""``python -m benchmarks``: gymckpt commit/restore against the primitives and peers, in one run.

Per workload: the records are generated once (untimed) and frozen out of the cyclic
GC's view (``gc.freeze``), so they weigh on no timed step, as in a server whose
records were built long before the checkpoint. gymckpt's restore is timed with the
heap unfrozen (:func:`_unfrozen`): in a process holding frozen objects its reads leave
the GC's generations alone, and servers freeze nothing. Then each repetition times, on the
same records and moments apart:

1. the primitives: orjson encode, sha256, write+fsync; read, sha256, orjson decode;
2. gymckpt: ``write_participant`` and ``read_participant`` (full scope, kept in a list);
3. the peers: pydantic+json, SQLite, pickle (commit and restore each).

Every figure is the median of the repetitions, and every ratio the median of the
per-repetition ratios. The peak RSS of a commit and of a restore is then measured
in fresh subprocesses (:mod:`benchmarks.rss`).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from rich.console import Console

from benchmarks import primitives, rss
from benchmarks.machine import cpu_snapshot, filesystem, others_share
from benchmarks.peers import PEERS
from benchmarks.report import TARGETS, evaluate, render
from benchmarks.workloads import WORKLOADS, get_workload
from gymckpt import __version__ as gymckpt_version
from gymckpt.store import open_store

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from benchmarks.workloads import Workload
    from gymckpt.store import CheckpointStore

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".bench-tmp"
KIND = "environment"
INSTANCE = "env-0"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="gymckpt commit/restore throughput against the machine's primitives and against peers.",
    )
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions per workload; medians are reported (default 3)"
    )
    parser.add_argument("--workloads", default="W1,W2", help="comma-separated workloads (default W1,W2)")
    parser.add_argument("--json", action="store_true", help="print a machine-readable JSON document instead of tables")
    parser.add_argument("--quick", action="store_true", help="shrink every workload 10x (a smoke run)")
    parser.add_argument(
        "--dir",
        default=None,
        help=f"where temporary files go, on the filesystem under test (default {DEFAULT_DIR.relative_to(REPO)}/ "
        "in the repository); a run directory is created in it and removed after",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--skip-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument(
        "--cold", action="store_true", help="evict each file from the page cache before it is read back"
    )
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated peers (default {','.join(PEERS)})")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.workloads = [name.strip().upper() for name in args.workloads.split(",") if name.strip()]
    for name in args.workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    args.peers = [name.strip() for name in args.peers.split(",") if name.strip()]
    for name in args.peers:
        if name not in PEERS:
            parser.error(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
    return args


def _settle() -> None:
    """Collect the garbage of the previous step, so the next starts from a clean heap."""
    gc.collect()


def _fingerprint(records: list[dict[str, Any]]) -> str:
    """A digest equal for records that round-tripped exactly: key order, NaN, int vs float, big ints."""
    hasher = hashlib.sha256()
    for record in records:
        hasher.update(json.dumps(record, allow_nan=True).encode())
        hasher.update(b"\n")
    return hasher.hexdigest()


def _largest_line(path: str) -> int:
    largest = 0
    with open(path, "rb") as stream:
        for line in stream:
            largest = max(largest, len(line))
    return largest


def _read_all(store: CheckpointStore, checkpoint_dir: str) -> list[dict[str, Any]]:
    return list(store.read_participant(checkpoint_dir, kind=KIND, instance=INSTANCE))


@contextmanager
def _unfrozen() -> Iterator[None]:
    """Run the block with the workload out of the GC's permanent generation, as a server's heap is.

    gymckpt's reads hand the records they made to the GC's oldest generation uncollected,
    except in a process that froze objects (``gc.freeze``, which only the benchmark does
    here): the read is timed without the freeze, then the heap is frozen again. No
    collection runs while gymckpt reads (it pauses the GC), so the workload costs it nothing
    either way.
    """
    gc.unfreeze()
    try:
        yield
    finally:
        gc.freeze()


def _evict(paths: list[str], cold: bool) -> None:
    if cold:
        for path in paths:
            if os.path.exists(path):
                primitives.evict_from_page_cache(path)


class _Clock:
    """Times steps by the wall clock (what the ratios use) and by this process's CPU time (all threads)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def __call__(self, key: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        cpu_start = time.process_time()
        wall_start = time.perf_counter()
        result = function(*args, **kwargs)
        self.wall[key] = time.perf_counter() - wall_start
        self.cpu[key] = time.process_time() - cpu_start
        return result


def run_repetition(
    rep: int,
    records: list[dict[str, Any]],
    workload: Workload,
    rep_dir: str,
    args: argparse.Namespace,
    *,
    reference: str,
    check: bool,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Time every step once; return the timings and what the checks need (manifest, round-trips)."""
    clock = _Clock()
    facts: dict[str, Any] = {"roundtrip": {}}

    # 1. primitives on the same bytes
    path = os.path.join(rep_dir, "primitive.jsonl")
    _settle()
    encoded = clock("encode", primitives.encode_records, records)
    clock("sha256_commit", primitives.sha256_lines, encoded.lines)
    clock("write_fsync", primitives.write_fsync, path, encoded.lines)
    facts["bytes"], facts["largest_primitive"] = encoded.size, encoded.largest
    del encoded
    _evict([path], args.cold)
    _settle()
    data = clock("read", primitives.read_file, path)
    clock("sha256_restore", primitives.sha256_bytes, data)
    decoded = clock("decode", primitives.decode_lines, data)
    del data, decoded
    os.unlink(path)

    # 2. gymckpt, moments later, on the same records
    store_root = os.path.join(rep_dir, "store")
    store = open_store(store_root)
    checkpoint_dir = f"rep-{rep}"
    _settle()
    manifest = clock(
        "gymckpt_commit",
        store.write_participant,
        checkpoint_dir,
        kind=KIND,
        instance=INSTANCE,
        checkpoint_id=f"bench-{workload.name.lower()}",
        records=records,
        extra={"workload": workload.name, "seed": workload.seed},
    )
    records_path = os.path.join(store_root, manifest.records_path)
    with open(os.path.join(store_root, manifest.path), "rb") as stream:
        facts["manifest"] = stream.read()
    facts["gymckpt_bytes"] = manifest.records_bytes
    _evict([records_path], args.cold)
    _settle()
    with _unfrozen():
        restored = clock("gymckpt_restore", _read_all, store, checkpoint_dir)
    if check:
        facts["roundtrip"]["gymckpt"] = _fingerprint(restored) == reference
        facts["largest_gymckpt"] = _largest_line(records_path)
    del restored

    # 3. peers
    for name in args.peers:
        peer = PEERS[name](rep_dir)
        _settle()
        clock(f"{name}_commit", peer.commit, records)
        facts[f"{name}_bytes"] = sum(os.path.getsize(p) for p in peer.files if os.path.exists(p))
        _evict(peer.files, args.cold)
        _settle()
        restored = clock(f"{name}_restore", peer.restore)
        if check:
            facts["roundtrip"][name] = _fingerprint(restored) == reference
        del restored
        peer.clean()

    for measured in (clock.wall, clock.cpu):
        measured["primitive_commit"] = sum(measured[step] for step in primitives.COMMIT_STEPS)
        measured["primitive_restore"] = sum(measured[step] for step in primitives.RESTORE_STEPS)
    facts["cpu"] = clock.cpu
    _settle()
    return clock.wall, facts


def run_workload(workload: Workload, args: argparse.Namespace, run_dir: str, console: Console) -> dict[str, Any]:
    log = console.log
    log(f"[bold]{workload.name}[/]: generating {workload.count:,} records (seed {workload.seed}, untimed)")
    generation_s, records = primitives.timed(list, workload.records())
    gc.collect()
    gc.freeze()  # the workload lives outside the GC's generations: it burdens no timed step
    try:
        reference = _fingerprint(records)
        reps: list[dict[str, float]] = []
        cpu_reps: list[dict[str, float]] = []
        manifests: list[bytes] = []
        roundtrip: dict[str, bool] = {}
        facts: dict[str, Any] = {}
        cpu_start = cpu_snapshot()
        for rep in range(args.reps):
            rep_dir = os.path.join(run_dir, f"{workload.name}-rep{rep}")
            os.makedirs(rep_dir)
            try:
                timings, facts_rep = run_repetition(
                    rep, records, workload, rep_dir, args, reference=reference, check=rep == 0
                )
            finally:
                shutil.rmtree(rep_dir, ignore_errors=True)
            if rep == 0:
                facts = facts_rep
                roundtrip = facts_rep["roundtrip"]
            manifests.append(facts_rep["manifest"])
            reps.append(timings)
            cpu_reps.append(facts_rep["cpu"])
            log(
                f"{workload.name} rep {rep + 1}/{args.reps}: commit gymckpt {timings['gymckpt_commit']:.2f}s "
                f"vs primitives {timings['primitive_commit']:.2f}s, restore gymckpt "
                f"{timings['gymckpt_restore']:.2f}s vs primitives {timings['primitive_restore']:.2f}s"
            )
        others_cpu = others_share(cpu_start, cpu_snapshot())
        if len(manifests) < 2:  # one repetition: commit once more (untimed) for the determinism check
            again_dir = os.path.join(run_dir, f"{workload.name}-again")
            store = open_store(again_dir)
            manifest = store.write_participant(
                "again",
                kind=KIND,
                instance=INSTANCE,
                checkpoint_id=f"bench-{workload.name.lower()}",
                records=records,
                extra={"workload": workload.name, "seed": workload.seed},
            )
            manifests.append(manifest.raw)
            shutil.rmtree(again_dir, ignore_errors=True)
    finally:
        del records
        gc.unfreeze()
        gc.collect()

    result: dict[str, Any] = {
        "name": workload.name,
        "description": workload.description,
        "records": workload.count,
        "bytes": facts["bytes"],
        "gymckpt_bytes": facts["gymckpt_bytes"],
        "peer_bytes": {name: facts[f"{name}_bytes"] for name in args.peers},
        "largest_record": max(facts["largest_primitive"], facts["largest_gymckpt"]),
        "generation_s": generation_s,
        "others_cpu_share": others_cpu,
        "load_average": os.getloadavg(),
        "reps": reps,
        "cpu_reps": cpu_reps,
        "roundtrip": roundtrip,
        "manifest_identical": all(raw == manifests[0] for raw in manifests),
        "manifest_bytes": len(manifests[0]),
        "manifest_sha256": hashlib.sha256(manifests[0]).hexdigest(),
        "rss": None,
    }
    if not args.skip_rss:
        rss_root = os.path.join(run_dir, f"{workload.name}-rss")
        try:
            result["rss"] = {}
            for mode in rss.MODES:
                log(f"{workload.name}: peak RSS of {mode} in a fresh subprocess")
                result["rss"][mode] = rss.measure(mode, workload.name, rss_root, quick=args.quick, seed=workload.seed)
        finally:
            shutil.rmtree(rss_root, ignore_errors=True)
    return evaluate(result, args.peers)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    base = Path(args.dir).resolve() if args.dir else DEFAULT_DIR
    created_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="run-", dir=base)
    started = time.time()
    document: dict[str, Any] = {
        "config": {
            "reps": args.reps,
            "quick": args.quick,
            "seed": args.seed,
            "cold": args.cold,
            "peers": args.peers,
            "dir": run_dir,
            "filesystem": filesystem(run_dir),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gymckpt": gymckpt_version,
            "orjson": orjson.__version__,
            "targets": TARGETS,
        },
        "workloads": {},
    }
    try:
        for name in args.workloads:
            workload = get_workload(name, seed=args.seed, quick=args.quick)
            document["workloads"][name] = run_workload(workload, args, run_dir, console)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if created_base:
            try:
                base.rmdir()
            except OSError:
                pass  # something else lives there now
    document["config"]["elapsed_s"] = time.time() - started
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=150)  # piped: no 80-column wrap
        render(document, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
