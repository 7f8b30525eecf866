"""Peak memory of a commit and of a restore, each in a fresh subprocess.

The subprocess imports everything, sets up the workload as a generator (no record is
built yet), and takes its resident set size as the baseline. Then it resets the
kernel's high-water mark (``/proc/self/clear_refs``), runs the one operation and
reports the peak (``VmHWM``) above the baseline. Where the high-water mark cannot be
reset, ``ru_maxrss`` is used instead (a peak over the process's whole life).

Modes:

- ``commit``: ``write_participant`` of the lazily generated records.
- ``restore``: ``read_participant`` (full scope), discarding each record: the store's own memory.
- ``restore-keep``: the same, keeping the records in a list, as a restoring server would.

Run as ``python -m benchmarks.rss MODE --workload W1 --store DIR [--quick] [--seed N]``;
it prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

__all__ = ["CHECKPOINT", "INSTANCE", "KIND", "MODES", "measure"]

MODES = ("commit", "restore", "restore-keep")
CHECKPOINT = "rss"
KIND = "environment"
INSTANCE = "env-0"


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _current_rss() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss(reset: bool) -> int:
    if reset:
        kib = _status_kib("VmHWM")
        if kib is not None:
            return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _run(mode: str, workload_name: str, store_root: str, *, quick: bool, seed: int) -> dict[str, Any]:
    from benchmarks.workloads import get_workload
    from gymckpt.store import open_store

    store = open_store(store_root)
    workload = get_workload(workload_name, seed=seed, quick=quick)
    records = workload.records()  # a generator: nothing is built yet
    kept: list[dict[str, Any]] = []

    baseline = _current_rss()
    reset = _reset_peak()
    start = time.perf_counter()
    count = 0
    if mode == "commit":
        manifest = store.write_participant(
            CHECKPOINT, kind=KIND, instance=INSTANCE, checkpoint_id=CHECKPOINT, records=records
        )
        count = manifest.record_count
    elif mode == "restore":
        for record in store.read_participant(CHECKPOINT, kind=KIND, instance=INSTANCE):
            del record
            count += 1
    else:
        kept = list(store.read_participant(CHECKPOINT, kind=KIND, instance=INSTANCE))
        count = len(kept)
    seconds = time.perf_counter() - start
    peak = _peak_rss(reset)
    return {
        "mode": mode,
        "workload": workload.name,
        "records": count,
        "seconds": seconds,
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "above_baseline_bytes": max(0, peak - baseline),
        "method": "VmHWM after clear_refs" if reset else "ru_maxrss",
    }


def measure(mode: str, workload_name: str, store_root: str, *, quick: bool, seed: int) -> dict[str, Any]:
    """Run one mode in a fresh interpreter and return what it reported."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    command = [sys.executable, "-m", "benchmarks.rss", mode, "--workload", workload_name, "--store", store_root]
    command += ["--seed", str(seed)] + (["--quick"] if quick else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    completed = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"rss subprocess {mode} failed ({completed.returncode}):\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rss", description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--store", required=True, help="root of the local store (in the benchmark's temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = _run(args.mode, args.workload, args.store, quick=args.quick, seed=args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
