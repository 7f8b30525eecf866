"""Medians, ratios and targets of a run, and the tables printed from them.

Every figure is the median of the repetitions; every ratio is the median of the
per-repetition ratios (gymckpt's time / the other's time, taken moments apart, so
disk drift cancels). A ratio below 1 means gymckpt is faster.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from gymckpt.store.codec import ACCELERATED

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["MB", "MIB", "TARGETS", "evaluate", "render"]

MB = 1_000_000
MIB = 1 << 20

#: gymckpt's time as a fraction of its primitive sum, at most (issue 15's targets)
TARGETS: dict[str, dict[str, float]] = {
    "W1": {"commit": 0.75, "restore": 0.60},
    "W2": {"commit": 1.00, "restore": 0.70},
}
#: peak RSS above baseline, at most this many times the largest record, plus RSS_SLACK bytes
RSS_FACTOR = 2
RSS_SLACK = 64 * MIB

_OPERATIONS = ("commit", "restore")
_STEP_LABELS = {
    "encode": "orjson encode (orjson.dumps per record)",
    "sha256_commit": "sha256 of the encoded bytes",
    "write_fsync": "write + fsync",
    "primitive_commit": "primitive sum",
    "gymckpt_commit": "gymckpt write_participant",
    "read": "read the file",
    "sha256_restore": "sha256 of the bytes read",
    "decode": "orjson decode per line, kept (GC on)",
    "primitive_restore": "primitive sum",
    "gymckpt_restore": "gymckpt read_participant (full scope, kept)",
}
_PEER_LABELS = {
    "naive": "pydantic + json (naive)",
    "sqlite": "SQLite WAL, synchronous=FULL",
    "pickle": "pickle + fsync",
}
_PRIMITIVE_STEPS = {
    "commit": ("encode", "sha256_commit", "write_fsync"),
    "restore": ("read", "sha256_restore", "decode"),
}


def _median_ratio(reps: list[dict[str, float]], numerator: str, denominator: str) -> float:
    return statistics.median(rep[numerator] / rep[denominator] for rep in reps)


def evaluate(result: dict[str, Any], peers: list[str]) -> dict[str, Any]:
    """Add medians, ratios and the target checks to one workload's result."""
    reps: list[dict[str, float]] = result["reps"]
    result["median_s"] = {key: statistics.median(rep[key] for rep in reps) for key in reps[0]}
    if result.get("cpu_reps"):
        result["median_cpu_s"] = {
            key: statistics.median(rep[key] for rep in result["cpu_reps"]) for key in result["cpu_reps"][0]
        }
    ratios: dict[str, dict[str, float]] = {}
    for operation in _OPERATIONS:
        gymckpt = f"gymckpt_{operation}"
        against = [f"primitive_{operation}", *_PRIMITIVE_STEPS[operation]] + [f"{peer}_{operation}" for peer in peers]
        ratios[operation] = {key: _median_ratio(reps, gymckpt, key) for key in against}
    result["ratios"] = ratios

    checks: list[dict[str, Any]] = []
    limits = TARGETS.get(result["name"], {})
    for operation in _OPERATIONS:
        measured = ratios[operation][f"primitive_{operation}"]
        limit = limits.get(operation)
        checks.append(
            {
                "check": f"{operation} <= {limit:.2f}x its primitive sum" if limit else f"{operation} / primitive sum",
                "measured": f"{measured:.2f}x",
                "value": measured,
                "limit": limit,
                "met": None if limit is None else measured <= limit,
            }
        )
    for operation in _OPERATIONS:
        if not peers:
            continue
        slowest_margin = max(peers, key=lambda peer: ratios[operation][f"{peer}_{operation}"])
        worst = ratios[operation][f"{slowest_margin}_{operation}"]
        checks.append(
            {
                "check": f"{operation} faster than every peer",
                "measured": f"{worst:.2f}x of {slowest_margin} (closest)",
                "value": worst,
                "limit": 1.0,
                "met": worst < 1.0,
            }
        )
    if result.get("rss"):
        limit_bytes = RSS_FACTOR * result["largest_record"] + RSS_SLACK
        for mode, label in (("commit", "commit"), ("restore", "restore, discarding records")):
            above = result["rss"][mode]["above_baseline_bytes"]
            checks.append(
                {
                    "check": f"peak RSS of a {label} <= {RSS_FACTOR}x largest record + 64 MiB",
                    "measured": f"{above / MIB:.1f} MiB (limit {limit_bytes / MIB:.1f} MiB)",
                    "value": above,
                    "limit": limit_bytes,
                    "met": above <= limit_bytes,
                }
            )
    checks.append(
        {
            "check": "same records give the same manifest bytes",
            "measured": f"{len(reps) if len(reps) > 1 else 2} commits: "
            + ("identical" if result["manifest_identical"] else "DIFFERENT"),
            "value": result["manifest_identical"],
            "limit": True,
            "met": result["manifest_identical"],
        }
    )
    inexact = sorted(name for name, exact in result["roundtrip"].items() if not exact)
    checks.append(
        {
            "check": "gymckpt and every peer round-trip the records exactly",
            "measured": "all exact" if not inexact else f"inexact: {', '.join(inexact)}",
            "value": not inexact,
            "limit": True,
            "met": not inexact,
        }
    )
    result["checks"] = checks
    return result


def _status(met: bool | None) -> Text:
    if met is None:
        return Text("-", style="dim")
    return Text("met", style="bold green") if met else Text("not met", style="bold red")


def _timings_table(result: dict[str, Any], peers: list[str]) -> Table:
    payload = result["bytes"]
    table = Table(
        title=f"{result['name']}: {result['records']:,} records, {payload / MB:,.1f} MB of JSONL "
        f"(largest record {result['largest_record'] / 1000:,.1f} KB), {len(result['reps'])} repetitions",
        title_justify="left",
    )
    table.add_column("step")
    table.add_column("median s", justify="right")
    table.add_column("MB/s", justify="right")
    table.add_column("each repetition, s", justify="right", style="dim")
    table.add_column("CPU s", justify="right", style="dim")
    table.add_column("gymckpt / this", justify="right")
    for index, operation in enumerate(_OPERATIONS):
        if index:
            table.add_section()
        keys = [
            *_PRIMITIVE_STEPS[operation],
            f"primitive_{operation}",
            f"gymckpt_{operation}",
            *(f"{peer}_{operation}" for peer in peers),
        ]
        for key in keys:
            seconds = result["median_s"][key]
            if key.startswith("gymckpt"):
                label, style, ratio = _STEP_LABELS[key], "bold cyan", ""
            elif key.startswith("primitive"):
                label, style = f"{operation}: {_STEP_LABELS[key]}", "bold"
                ratio = f"{result['ratios'][operation][key]:.2f}x"
            elif key in _STEP_LABELS:
                label, style, ratio = f"  {_STEP_LABELS[key]}", "", ""
            else:
                peer = key.rpartition("_")[0]
                label, style = f"peer: {_PEER_LABELS.get(peer, peer)}", ""
                ratio = f"{result['ratios'][operation][key]:.2f}x"
            table.add_row(
                Text(label, style=style),
                f"{seconds:.3f}",
                f"{payload / MB / seconds:,.0f}",
                " ".join(f"{rep[key]:.3f}" for rep in result["reps"]),
                f"{result['median_cpu_s'][key]:.3f}" if "median_cpu_s" in result else "",
                ratio,
            )
    return table


def _checks_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"{result['name']}: targets and checks", title_justify="left")
    table.add_column("target / check")
    table.add_column("measured", justify="right")
    table.add_column("status")
    for check in result["checks"]:
        table.add_row(check["check"], check["measured"], _status(check["met"]))
    return table


def _rss_table(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"{result['name']}: peak RSS in a fresh subprocess, records generated lazily", title_justify="left"
    )
    table.add_column("operation")
    table.add_column("peak above baseline, MiB", justify="right")
    table.add_column("baseline, MiB", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("measured by", style="dim")
    labels = {
        "commit": "write_participant (generator in)",
        "restore": "read_participant, discarding records",
        "restore-keep": "read_participant, keeping records (info)",
    }
    for mode, measured in result["rss"].items():
        table.add_row(
            labels.get(mode, mode),
            f"{measured['above_baseline_bytes'] / MIB:,.1f}",
            f"{measured['baseline_bytes'] / MIB:,.1f}",
            f"{measured['seconds']:.2f}",
            measured["method"],
        )
    return table


def render(document: dict[str, Any], console: Console) -> None:
    """Print the run as tables."""
    config = document["config"]
    walks = config.get("codec_walks") or ("C" if ACCELERATED else "Python")
    console.print(
        f"[bold]gymckpt {config['gymckpt']} benchmark[/]: Python {config['python']}, orjson {config['orjson']}, "
        f"codec walks in {walks}, {config['cpus']} CPUs, {config['platform']}"
    )
    console.print(
        f"temp dir {config['dir']} ({config['filesystem']}); "
        f"{'cold' if config['cold'] else 'warm'} page cache for reads; seed {config['seed']}"
        + ("; [yellow]--quick: workloads shrunk 10x[/]" if config["quick"] else "")
    )
    console.print(
        "MB = 10^6 bytes of the JSONL payload (the primitive encoding) per second; 'gymckpt / this' is the median "
        "of the per-repetition ratios gymckpt time / that time (< 1: gymckpt faster); 'CPU s' is this process's CPU "
        "time over all its threads (median), which other processes on the machine disturb less than wall time.\n"
    )
    for result in document["workloads"].values():
        console.print(_timings_table(result, config["peers"]))
        share = result.get("others_cpu_share", float("nan"))
        if share == share:  # not NaN
            style = "bold yellow" if share > 0.10 else "dim"
            console.print(
                f"[{style}]other processes kept {share:.0%} of the {config['cpus']} CPUs busy during these repetitions"
                + (" — figures are disturbed; rerun on a quiet machine" if share > 0.10 else "")
                + f" (load average after: {' '.join(f'{v:.2f}' for v in result['load_average'])})[/]"
            )
        if result.get("rss"):
            console.print(_rss_table(result))
        console.print(_checks_table(result))
        peer_sizes = ", ".join(f"{name} {size / MB:,.1f} MB" for name, size in result["peer_bytes"].items())
        console.print(
            f"[dim]files: gymckpt records {result['gymckpt_bytes'] / MB:,.1f} MB, {peer_sizes}; "
            f"manifest {result['manifest_bytes']:,} bytes (sha256 {result['manifest_sha256'][:16]}…); "
            f"workload generation {result['generation_s']:.1f} s (untimed)[/]\n"
        )
    console.print(f"[dim]total {config.get('elapsed_s', 0):.0f} s[/]")
