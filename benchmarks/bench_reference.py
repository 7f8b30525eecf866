"""Reading the reference stack's checkpoints beside gymckpt's own: the same records, both formats, one run.

::

    python -m benchmarks.bench_reference             # small: 20,000 x ~2 KB; large: 200 x ~1 MB
    python -m benchmarks.bench_reference --quick     # 10x fewer records, 2 repetitions
    python -m benchmarks.bench_reference --json out.json --cold

Per workload the records are generated once (untimed) and written twice: by gymckpt
(``write_participant`` and ``publish``) and in the reference's format
(:func:`~gymckpt.testing.reference_format.write_reference_participant`: ``json.dumps``
lines, the episode id as an object, the reference's manifest, ``collection.json``). Then
only what is needed to check the reads is kept (one digest per record) and the records
are dropped, so at most one workload's records are in memory at a time.

Each repetition times, alternating which format goes first, on the two checkpoints:

1. a full read: ``read_participant``, every record kept in a list;
2. a scoped read: ``read_participant`` of 10% of the episodes (seeded, spread over the file);
3. ``gymckpt.store.verify`` of the checkpoint directory;
4. the primitive: stdlib ``json.loads`` of every reference line, the lines already in
   memory, kept, GC paused as in a read: how much of a reference read is the decoder.

Every read is checked against the records written (same capture keys in the same order,
and the same values: key order, NaN, int vs float, integers beyond 64 bits), and every
verify must find nothing; a repetition that reads wrong data stops the run with exit
status 1. Figures are medians of the repetitions; a ratio is the median of the
per-repetition ratios reference time / gymckpt time (> 1: the reference format is slower).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich.console import Console
from rich.table import Table
from rich.text import Text

from benchmarks import primitives
from benchmarks.machine import cpu_snapshot, filesystem, others_share
from benchmarks.report import MB
from benchmarks.workloads import Workload, build_record
from gymckpt import __version__ as gymckpt_version
from gymckpt.store import open_store, verify
from gymckpt.store.manifest import GYMCKPT_FORMAT, REFERENCE_FORMAT
from gymckpt.testing.reference_format import write_reference_collection, write_reference_participant

if TYPE_CHECKING:
    from collections.abc import Callable

    from gymckpt.store import VerifyReport

__all__ = ["SHAPES", "Shape", "WrongRead", "main"]

KIND = "environment"
INSTANCE = "env-0"
CHECKPOINT = "bench-reference"
FORMATS = (GYMCKPT_FORMAT, REFERENCE_FORMAT)
OPERATIONS = ("full", "scoped", "verify")
PRIMITIVE = "primitive"
SCOPE_FRACTION = 0.10
_LABELS = {
    "full": "full read",
    "scoped": f"scoped read ({SCOPE_FRACTION:.0%})",
    "verify": "verify",
    PRIMITIVE: "json.loads alone",
}
#: one record in ten is a retry: its capture key is ``<rollout>-a1``, ``{"attempt": 1}`` in the reference's file
_RETRY_EVERY = 10
_NAN_EVERY = 50


class WrongRead(RuntimeError):
    """A read or a verify returned something other than what was written: the benchmark is void."""


@dataclass(frozen=True)
class Shape:
    """A workload: ``count`` records of about ``record_bytes`` encoded bytes each.

    With ``numeric`` a record is a short agent conversation plus long token-id and logprob
    lists filling it up; without, an agent-like conversation alone (non-ASCII text included).
    """

    name: str
    count: int
    record_bytes: int
    numeric: bool
    seed: int = 0

    @property
    def description(self) -> str:
        if self.numeric:
            return f"{self.count:,} records of ~{self.record_bytes / MB:g} MB, mostly long token-id and logprob lists"
        low, high = self.record_bytes // 2, self.record_bytes * 3 // 2
        return (
            f"{self.count:,} agent conversations of ~{self.record_bytes / 1000:g} KB "
            f"({low / 1000:g}-{high / 1000:g} KB, non-ASCII text)"
        )

    def shrunk(self, factor: int) -> Shape:
        return replace(self, count=max(10, self.count // factor))

    def with_seed(self, seed: int) -> Shape:
        return replace(self, seed=seed)

    def record(self, index: int) -> dict[str, Any]:
        """Record ``index``, rebuilt from (seed, name, index) alone; its ``episode_id`` is a capture key."""
        if self.numeric:
            record = _numeric_record(index, self)
        else:
            spread = self.record_bytes // 2
            conversation = Workload(
                f"ref-{self.name}",
                self.count,
                self.record_bytes - spread,
                self.record_bytes + spread,
                self.record_bytes,
            )
            record = conversation.with_seed(self.seed).record(index)
        record["episode_id"] = episode_key(index)  # in place: still the first key
        return record


SHAPES: dict[str, Shape] = {
    "small": Shape("small", 20_000, 2_000, numeric=False),
    "large": Shape("large", 200, 1_000_000, numeric=True),
}


def episode_key(index: int) -> str:
    """The capture key of record ``index``: attempt 0 of its rollout, or attempt 1 for one record in ten."""
    rollout = f"rollout-{index:06d}"
    return f"{rollout}-a1" if index % _RETRY_EVERY == 3 else rollout


def _uint16s(rng: random.Random, count: int) -> list[int]:
    return array("H", rng.randbytes(2 * count)).tolist()


def _numeric_record(index: int, shape: Shape) -> dict[str, Any]:
    """A ~``record_bytes`` record: a ~40 KB conversation and a trajectory of long numeric lists."""
    rng = random.Random(f"gymckpt-bench-reference:{shape.name}:{shape.seed}:{index}")
    target = round(rng.triangular(0.9 * shape.record_bytes, 1.1 * shape.record_bytes))
    record = build_record(index, rng, 40_000, nan=index % _NAN_EVERY == 17, big_int=index == shape.count // 3)
    budget = max(0, target - len(json.dumps(record)))
    completion = max(1, budget // 23)  # a completion token: ~6 bytes of id, ~14 of logprob, ~3 of mask
    prompt = completion // 2  # a prompt token ~6 bytes
    record["trajectory"] = {
        "prompt_token_ids": _uint16s(rng, prompt),
        "completion_token_ids": _uint16s(rng, completion),
        # binary fractions in (-16, 0]: exact doubles, reprs of 3-13 characters
        "completion_logprobs": [-(value >> 2) / 1024 for value in _uint16s(rng, completion)],
        "mask": [1] * completion,
    }
    return record


def _exact_text(record: dict[str, Any]) -> bytes:
    """Equal for records equal to the last bit: key order, NaN, int vs float, big integers."""
    return json.dumps(record, allow_nan=True).encode()


def _digest(record: dict[str, Any]) -> bytes:
    return hashlib.sha256(_exact_text(record)).digest()


@dataclass
class Side:
    """One format's checkpoint of a workload."""

    name: str
    root: Path
    records_path: Path
    manifest_path: Path

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / CHECKPOINT

    @property
    def size(self) -> int:
        return self.records_path.stat().st_size


@dataclass
class Prepared:
    """Both checkpoints of a workload and what their reads must return (no records)."""

    shape: Shape
    sides: dict[str, Side]
    #: (capture key, digest) of every record, in file order
    expected: list[tuple[str, bytes]]
    scope: frozenset[str]
    expected_scoped: list[tuple[str, bytes]]
    largest_record: int
    generation_s: float


def prepare(shape: Shape, run_dir: Path, console: Console) -> Prepared:
    """Generate the records, write them in both formats, keep their digests, drop them."""
    console.log(f"[bold]{shape.name}[/]: generating {shape.count:,} records (seed {shape.seed}, untimed)")
    generation_s, records = primitives.timed(lambda: [shape.record(index) for index in range(shape.count)])
    expected: list[tuple[str, bytes]] = []
    largest = 0  # the longest reference line (json.dumps), newline excluded
    for record in records:
        text = _exact_text(record)
        expected.append((record["episode_id"], hashlib.sha256(text).digest()))
        largest = max(largest, len(text))
    sides: dict[str, Side] = {}

    root = run_dir / shape.name / GYMCKPT_FORMAT
    store = open_store(str(root))
    manifest = store.write_participant(
        CHECKPOINT, kind=KIND, instance=INSTANCE, checkpoint_id=CHECKPOINT, records=records
    )
    store.publish(CHECKPOINT, [manifest])
    store.close()
    sides[GYMCKPT_FORMAT] = Side(GYMCKPT_FORMAT, root, root / manifest.records_path, root / manifest.path)

    root = run_dir / shape.name / REFERENCE_FORMAT
    participant = root / CHECKPOINT / "gym" / KIND / INSTANCE
    reference = write_reference_participant(
        root / CHECKPOINT, kind=KIND, instance=INSTANCE, checkpoint_id=CHECKPOINT, records=records
    )
    write_reference_collection(root, CHECKPOINT)
    sides[REFERENCE_FORMAT] = Side(
        REFERENCE_FORMAT, root, participant / reference["records_file"], participant / "manifest.json"
    )
    del records
    gc.collect()

    chosen = sorted(
        random.Random(f"scope:{shape.seed}").sample(range(shape.count), max(1, round(shape.count * SCOPE_FRACTION)))
    )
    scoped = [expected[index] for index in chosen]
    return Prepared(shape, sides, expected, frozenset(key for key, _ in scoped), scoped, largest, generation_s)


def check_records(got: list[dict[str, Any]], expected: list[tuple[str, bytes]], what: str) -> None:
    """Raise :class:`WrongRead` unless ``got`` holds exactly the expected records, in order."""
    if len(got) != len(expected):
        raise WrongRead(f"{what}: {len(got):,} records read, {len(expected):,} expected")
    for position, (record, (key, digest)) in enumerate(zip(got, expected, strict=True)):
        if record.get("episode_id") != key:
            raise WrongRead(f"{what}: record {position} has episode_id {record.get('episode_id')!r}, expected {key!r}")
        if _digest(record) != digest:
            raise WrongRead(f"{what}: record {position} (episode {key!r}) differs from the record written")


def check_report(report: VerifyReport, side: str, count: int, what: str) -> None:
    """Raise :class:`WrongRead` unless verify found nothing, checked every record and saw the right format."""
    if not report.ok or report.findings:
        found = "; ".join(f"{finding.code}: {finding.detail}" for finding in report.findings[:3])
        raise WrongRead(f"{what}: verify found {len(report.findings)} problem(s): {found}")
    if report.records_checked != count:
        raise WrongRead(f"{what}: verify checked {report.records_checked:,} records, {count:,} written")
    if report.formats.get(side) != 1:
        raise WrongRead(f"{what}: verify saw formats {report.formats}, expected one {side} participant")


def _read(side: Side, scope: frozenset[str] | None) -> list[dict[str, Any]]:
    with open_store(str(side.root)) as store:
        return list(store.read_participant(CHECKPOINT, kind=KIND, instance=INSTANCE, scope=scope))


def _read_lines(path: Path) -> list[bytes]:
    lines = primitives.read_file(str(path)).split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    return lines


def _json_loads_all(lines: list[bytes]) -> list[Any]:
    """stdlib json.loads of every line, kept, the cyclic GC paused (as a gymckpt read pauses it)."""
    loads = json.loads
    enabled = gc.isenabled()
    gc.disable()
    try:
        return [loads(line) for line in lines]
    finally:
        if enabled:
            gc.enable()


def _timed(function: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, CPU s of this process, result) of one call, after collecting the previous step's garbage."""
    gc.collect()
    cpu = time.process_time()
    wall = time.perf_counter()
    result = function()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def run_repetition(rep: int, prepared: Prepared, cold: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Time every operation once per format (the order alternating with ``rep``), checking each result."""
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    order = FORMATS if rep % 2 == 0 else FORMATS[::-1]
    count = len(prepared.expected)
    for operation in OPERATIONS:
        for name in order:
            side = prepared.sides[name]
            what = f"{prepared.shape.name} rep {rep + 1}, {operation}, {name} format"
            if cold:
                for path in (side.records_path, side.manifest_path):
                    primitives.evict_from_page_cache(str(path))
            key = f"{operation}/{name}"
            if operation == "verify":
                wall[key], cpu[key], report = _timed(lambda side=side: verify(str(side.checkpoint_dir)))
                check_report(report, name, count, what)
                continue
            scope = prepared.scope if operation == "scoped" else None
            wall[key], cpu[key], got = _timed(lambda side=side, scope=scope: _read(side, scope))
            check_records(got, prepared.expected if scope is None else prepared.expected_scoped, what)
            del got
    lines = _read_lines(prepared.sides[REFERENCE_FORMAT].records_path)  # untimed: the decoder alone is timed
    key = f"{PRIMITIVE}/{REFERENCE_FORMAT}"
    wall[key], cpu[key], decoded = _timed(lambda lines=lines: _json_loads_all(lines))
    if len(decoded) != count:
        raise WrongRead(
            f"{prepared.shape.name} rep {rep + 1}: json.loads gave {len(decoded):,} records, {count:,} written"
        )
    del decoded, lines
    gc.collect()
    return wall, cpu


def _ratio(rep: dict[str, float], operation: str) -> float:
    return rep[f"{operation}/{REFERENCE_FORMAT}"] / rep[f"{operation}/{GYMCKPT_FORMAT}"]


def summarize(prepared: Prepared, reps: list[dict[str, float]], cpu_reps: list[dict[str, float]]) -> dict[str, Any]:
    """Medians, MB/s (of each format's own file) and the per-repetition ratios reference / gymckpt."""
    sizes = {name: side.size for name, side in prepared.sides.items()}
    median_s = {key: statistics.median(rep[key] for rep in reps) for key in reps[0]}
    median_cpu_s = {key: statistics.median(rep[key] for rep in cpu_reps) for key in cpu_reps[0]}
    mbps = {key: sizes[key.partition("/")[2]] / MB / seconds for key, seconds in median_s.items()}
    ratios = {operation: [_ratio(rep, operation) for rep in reps] for operation in OPERATIONS}
    cpu_ratios = {operation: [_ratio(rep, operation) for rep in cpu_reps] for operation in OPERATIONS}
    primitive = f"{PRIMITIVE}/{REFERENCE_FORMAT}"
    decoder_share = statistics.median(rep[primitive] / rep[f"full/{REFERENCE_FORMAT}"] for rep in reps)
    decoder_cpu_share = statistics.median(rep[primitive] / rep[f"full/{REFERENCE_FORMAT}"] for rep in cpu_reps)
    return {
        "name": prepared.shape.name,
        "description": prepared.shape.description,
        "records": len(prepared.expected),
        "scoped_records": len(prepared.expected_scoped),
        "bytes": sizes,
        "largest_record": prepared.largest_record,
        "generation_s": prepared.generation_s,
        "reps": reps,
        "cpu_reps": cpu_reps,
        "median_s": median_s,
        "median_cpu_s": median_cpu_s,
        "MBps": mbps,
        "ratio_reference_over_gymckpt": {operation: statistics.median(values) for operation, values in ratios.items()},
        "cpu_ratio_reference_over_gymckpt": {
            operation: statistics.median(values) for operation, values in cpu_ratios.items()
        },
        "ratio_reps": ratios,
        "decoder_share_of_reference_full_read": decoder_share,
        "decoder_cpu_share_of_reference_full_read": decoder_cpu_share,
        "reads_checked": len(reps) * (2 * len(OPERATIONS) + 1),
    }


def run_workload(shape: Shape, args: argparse.Namespace, run_dir: Path, console: Console) -> dict[str, Any]:
    """Prepare one workload, run its repetitions, remove its files; return its summary."""
    prepared = prepare(shape, run_dir, console)
    try:
        reps: list[dict[str, float]] = []
        cpu_reps: list[dict[str, float]] = []
        start = cpu_snapshot()
        for rep in range(args.reps):
            wall, cpu = run_repetition(rep, prepared, args.cold)
            reps.append(wall)
            cpu_reps.append(cpu)
            console.log(
                f"{shape.name} rep {rep + 1}/{args.reps} (all reads checked): full read gymckpt "
                f"{wall[f'full/{GYMCKPT_FORMAT}']:.3f}s, reference {wall[f'full/{REFERENCE_FORMAT}']:.3f}s, "
                f"json.loads alone {wall[f'{PRIMITIVE}/{REFERENCE_FORMAT}']:.3f}s"
            )
        summary = summarize(prepared, reps, cpu_reps)
        summary["others_cpu_share"] = others_share(start, cpu_snapshot())
        summary["load_average"] = os.getloadavg()
        return summary
    finally:
        shutil.rmtree(run_dir / shape.name, ignore_errors=True)


def _table(result: dict[str, Any]) -> Table:
    sizes = result["bytes"]
    table = Table(
        title=f"{result['name']}: {result['records']:,} records (largest reference line {result['largest_record'] / 1000:,.1f} KB); "
        f"records file: gymckpt {sizes[GYMCKPT_FORMAT] / MB:,.1f} MB, reference {sizes[REFERENCE_FORMAT] / MB:,.1f} MB; "
        f"median of {len(result['reps'])} repetitions, formats alternating",
        title_justify="left",
    )
    table.add_column("operation")
    for name in FORMATS:
        table.add_column(f"{name} s", justify="right")
        table.add_column(f"{name} MB/s", justify="right")
        table.add_column(f"{name} CPU s", justify="right", style="dim")
    table.add_column("ref / gymckpt", justify="right")
    table.add_column("each rep", justify="right", style="dim")
    table.add_column("by CPU s", justify="right", style="dim")
    for operation in (*OPERATIONS, PRIMITIVE):
        cells: list[str | Text] = [Text(_LABELS[operation], style="bold" if operation != PRIMITIVE else "")]
        for name in FORMATS:
            key = f"{operation}/{name}"
            if key in result["median_s"]:
                cells += [
                    f"{result['median_s'][key]:.3f}",
                    f"{result['MBps'][key]:,.0f}",
                    f"{result['median_cpu_s'][key]:.3f}",
                ]
            else:
                cells += ["", "", ""]
        ratio = result["ratio_reference_over_gymckpt"].get(operation)
        if ratio is None:
            cells += ["", "", ""]
        else:
            cells.append(Text(f"{ratio:.2f}x", style="bold"))
            cells.append(" ".join(f"{value:.2f}" for value in result["ratio_reps"][operation]))
            cells.append(f"{result['cpu_ratio_reference_over_gymckpt'][operation]:.2f}x")
        table.add_row(*cells)
    return table


def render(document: dict[str, Any], console: Console) -> None:
    """Print the run as one table per workload."""
    config = document["config"]
    console.print(
        f"[bold]gymckpt {config['gymckpt']}: reading reference-format checkpoints beside gymckpt's[/]: "
        f"Python {config['python']}, orjson {config['orjson']}, {config['cpus']} CPUs, {config['platform']}"
    )
    console.print(
        f"temp dir {config['dir']} ({config['filesystem']}); {'cold' if config['cold'] else 'warm'} page cache; "
        f"seed {config['seed']}" + ("; [yellow]--quick: 10x fewer records[/]" if config["quick"] else "")
    )
    console.print(
        "full read: read_participant, every record kept; scoped read: read_participant of a seeded 10% of the "
        "episodes (the whole file is still read and hashed); verify: gymckpt.store.verify of the checkpoint "
        "directory; json.loads alone (the primitive): stdlib json.loads of every reference line, already in memory, kept, GC paused. "
        "MB/s = each format's own records file (10^6 bytes) per second. 'ref / gymckpt' is the median of "
        "the per-repetition wall-time ratios reference / gymckpt (> 1: the reference format is slower; 'each rep' "
        "lists them, 'by CPU s' is the same by CPU time); 'CPU s' is this process's "
        "CPU time over all its threads, which other processes disturb less than wall time. Every read and "
        "verify was checked against the records written.\n"
    )
    for result in document["workloads"].values():
        console.print(_table(result))
        share = result["decoder_share_of_reference_full_read"]
        cpu_share = result["decoder_cpu_share_of_reference_full_read"]
        console.print(
            f"json.loads of the reference lines alone is [bold]{share:.0%}[/] of a reference full read by wall "
            f"time, {cpu_share:.0%} by CPU time (medians of the per-repetition shares)"
        )
        others = result["others_cpu_share"]
        if others == others:  # not NaN
            style = "bold yellow" if others > 0.10 else "dim"
            console.print(
                f"[{style}]other processes kept {others:.0%} of the {config['cpus']} CPUs busy during these repetitions"
                + (" — figures are disturbed; rerun on a quiet machine" if others > 0.10 else "")
                + f" (load average after: {' '.join(f'{value:.2f}' for value in result['load_average'])})[/]"
            )
        console.print(
            f"[dim]{result['description']}; scoped read of {result['scoped_records']:,} records; "
            f"generation {result['generation_s']:.1f} s (untimed)[/]\n"
        )
    console.print(f"[dim]total {config.get('elapsed_s', 0):.0f} s[/]")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_reference",
        description="Read, scoped-read and verify the same records in gymckpt's format and the reference stack's.",
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions per workload (default 5, --quick 2)")
    parser.add_argument(
        "--workloads", default=",".join(SHAPES), help=f"comma-separated workloads (default {','.join(SHAPES)})"
    )
    parser.add_argument("--quick", action="store_true", help="10x fewer records and 2 repetitions (a smoke run)")
    parser.add_argument(
        "--dir",
        default=None,
        help="where the temporary checkpoints go, on the filesystem under test (default: the system temp dir); "
        "a run directory is created in it and removed after",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the numbers to PATH as JSON")
    parser.add_argument("--cold", action="store_true", help="evict each file from the page cache before it is read")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.workloads = [name.strip().lower() for name in args.workloads.split(",") if name.strip()]
    for name in args.workloads:
        if name not in SHAPES:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    base = Path(args.dir).resolve() if args.dir else None
    created_base = base is not None and not base.exists()
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="gymckpt-bench-reference-", dir=args.dir))
    started = time.time()
    document: dict[str, Any] = {
        "config": {
            "reps": args.reps,
            "quick": args.quick,
            "seed": args.seed,
            "cold": args.cold,
            "dir": str(run_dir),
            "filesystem": filesystem(run_dir),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gymckpt": gymckpt_version,
            "orjson": orjson.__version__,
        },
        "workloads": {},
    }
    try:
        for name in args.workloads:
            shape = SHAPES[name].with_seed(args.seed)
            document["workloads"][name] = run_workload(
                shape.shrunk(10) if args.quick else shape, args, run_dir, console
            )
    except WrongRead as exc:
        console.print(f"[bold red]WRONG DATA, benchmark void:[/] {exc}")
        return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if created_base and base is not None:
            try:
                base.rmdir()
            except OSError:
                pass  # something else lives there now
    document["config"]["elapsed_s"] = time.time() - started
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        console.log(f"numbers written to {args.json}")
    render(document, Console() if sys.stdout.isatty() else Console(width=170))
    return 0


if __name__ == "__main__":
    sys.exit(main())
