"""Commit and restore of many counter sessions on 1, 2 and 4 uvicorn workers, side by side in one run.

::

    python -m benchmarks.bench_workers                           # 2,000 sessions, 3 repetitions
    python -m benchmarks.bench_workers --sessions 200 --repeat 1 # a smoke run
    python -m benchmarks.bench_workers --json out.json

Per repetition and worker count (the worker counts alternate in order from one repetition to
the next), on a fresh server and a fresh checkpoint directory:

1. start the counter resources server (``gymckpt serve counter --workers N``, a stack entry
   with ``workers: N``) and wait until every worker is linked to the coordinator;
2. seed ``--sessions`` sessions and give each ``--increments`` increments (untimed), at most
   ``--in-flight`` requests at a time, each session's cookie sent back on its later calls;
3. time ``prepare`` and ``commit`` of every session (the commit reply gives the records' bytes);
4. SIGKILL the server's process group, start it again with the same N, wait for every worker;
5. time ``restore`` of every session, then ``resume``;
6. check (untimed) a seeded sample of the restored sessions: one more increment of each
   next attempt (``<key>-a1``) must answer its count before the crash plus one.

A prepare that is not ready, a commit or restore that does not cover every session, or a
sample session with the wrong count stops the run with exit status 1: a benchmark that
restored nothing is void. Figures are medians of the repetitions; a ratio is the median of
the per-repetition ratios N workers' time / 1 worker's time (> 1: N workers are slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from rich.console import Console
from rich.table import Table
from rich.text import Text

from benchmarks.machine import filesystem, positive, warn_if_disturbed
from benchmarks.report import MB
from gymckpt import __version__ as gymckpt_version
from gymckpt.stack import load_stack
from gymckpt.workers.routing import COOKIE_NAME

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    from gymckpt.stack import Stack

__all__ = ["BenchFailure", "Measurement", "main"]

SERVER = "counter"
CONTROL = "/ng-control/v1/checkpoint"
#: how long a server may take to answer status with every worker linked
READY_TIMEOUT_S = 60.0
#: the deadline of each control call, from when it is sent
CONTROL_DEADLINE_S = 120.0
_POLL_S = 0.05
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=CONTROL_DEADLINE_S + 10)


class BenchFailure(RuntimeError):
    """A step answered wrong (not ready, sessions missing, a wrong count): the benchmark is void."""


@dataclass
class Measurement:
    """One repetition on one worker count: the timed steps and what was checked."""

    workers: int
    rep: int
    prepare_s: float
    commit_s: float
    restore_s: float
    records_bytes: int
    record_count: int
    restored: int
    checked: int
    setup_s: float
    #: CPU s over the repetition: this process, the server's processes, everything else on the machine
    bench_cpu_s: float
    server_cpu_s: float
    others_cpu_s: float
    wall_s: float


# --- CPU accounting: who kept the machine busy during a repetition


def _machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait); NaN off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _own_cpu_s() -> float:
    own = os.times()
    return own.user + own.system


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds of every live process of group ``pgid`` (with their reaped children); NaN off Linux."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return float("nan")
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        # after the command: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) cutime(13) cstime(14)
        if len(fields) > 14 and int(fields[2]) == pgid:
            total += sum(int(value) for value in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _server_cpu_s(stack: Stack) -> float:
    process = stack.servers[SERVER].process
    return _group_cpu_s(process.pid) if process is not None else 0.0


# --- HTTP


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _control(http: aiohttp.ClientSession, url: str, token: str, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST one control call; anything but 200 is a :class:`BenchFailure` quoting the reply."""
    async with http.post(f"{url}{CONTROL}/{op}", json=body, headers=_headers(token)) as response:
        text = await response.text()
        if response.status != 200:
            raise BenchFailure(f"{op} answered {response.status}: {text[:500]}")
        return json.loads(text)  # type: ignore[no-any-return]


async def _timed(call: Awaitable[dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    reply = await call
    return time.perf_counter() - started, reply


def _body(checkpoint_id: str, **fields: Any) -> dict[str, Any]:
    return {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + CONTROL_DEADLINE_S, **fields}


async def wait_ready(http: aiohttp.ClientSession, url: str, token: str, workers: int) -> dict[str, Any]:
    """Poll status (bounded) until the server answers and, with several workers, all are linked."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: object = "no answer"
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{url}{CONTROL}/status", headers=_headers(token)) as response:
                if response.status == 200:
                    status = await response.json()
                    if workers == 1 or status.get("workers") == status.get("expected_workers") == workers:
                        return status  # type: ignore[no-any-return]
                    last = {key: status.get(key) for key in ("workers", "expected_workers")}
                else:
                    last = f"status {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = repr(exc)
        await asyncio.sleep(_POLL_S)
    raise BenchFailure(f"the {workers}-worker server was not ready within {READY_TIMEOUT_S:.0f} s (last: {last})")


async def _rollout_call(
    http: aiohttp.ClientSession, url: str, key: str, path: str, body: dict[str, Any], cookie: str | None
) -> tuple[dict[str, Any], str | None]:
    """One data request of rollout ``key``; returns the reply and the session cookie (the given one if unset)."""
    headers = {"Cookie": f"{COOKIE_NAME}={cookie}"} if cookie else None
    async with http.post(f"{url}/ng-rollout/{key}/{path}", json=body, headers=headers) as response:
        if response.status != 200:
            raise BenchFailure(f"{path} of {key!r} answered {response.status}: {(await response.text())[:300]}")
        morsel = response.cookies.get(COOKIE_NAME)
        return await response.json(), morsel.value if morsel is not None else cookie


async def seed_sessions(
    http: aiohttp.ClientSession, url: str, keys: list[str], increments: int, in_flight: int
) -> dict[str, int]:
    """Seed every session and increment each ``increments`` times; return each session's count."""
    gate = asyncio.Semaphore(in_flight)
    counts: dict[str, int] = {}

    async def one(key: str) -> None:
        async with gate:
            _, cookie = await _rollout_call(http, url, key, "seed_session", {"task_input": {}}, None)
            for _ in range(increments):
                reply, cookie = await _rollout_call(http, url, key, "increment", {"n": 1}, cookie)
            counts[key] = int(reply["count"])

    await asyncio.gather(*(one(key) for key in keys))
    return counts


async def check_sample(http: aiohttp.ClientSession, url: str, counts: dict[str, int], sample: list[str]) -> int:
    """Increment each sampled session's next attempt once: its count must be the count before the crash + 1."""
    wrong = []
    for key in sample:
        reply, _ = await _rollout_call(http, url, f"{key}-a1", "increment", {"n": 1}, None)
        if reply.get("count") != counts[key] + 1:
            wrong.append(f"{key}-a1: count {reply.get('count')!r}, expected {counts[key] + 1}")
    if wrong:
        raise BenchFailure(f"{len(wrong)} of {len(sample)} sampled sessions did not continue: {'; '.join(wrong[:5])}")
    return len(sample)


# --- one repetition


def _client(in_flight: int) -> aiohttp.ClientSession:
    """A client without a cookie jar: each session's cookie is sent by hand (one host, many sessions)."""
    connector = aiohttp.TCPConnector(limit=in_flight + 4)
    return aiohttp.ClientSession(timeout=_HTTP_TIMEOUT, connector=connector, cookie_jar=aiohttp.DummyCookieJar())


def _spec(token: str, root: Path, workers: int) -> dict[str, Any]:
    return {
        "host": "127.0.0.1",
        "checkpoint": {"enabled": True, "control_auth_token": token, "allowed_roots": [str(root)]},
        "servers": [{"name": SERVER, "kind": "counter", "workers": workers}],
    }


async def _first_life(
    stack: Stack, args: argparse.Namespace, token: str, keys: list[str], checkpoint: tuple[str, Path]
) -> tuple[dict[str, int], dict[str, Any]]:
    """Start, seed, time prepare and commit; returns the counts and the timings and reply figures."""
    checkpoint_id, checkpoint_dir = checkpoint
    url = stack.urls[SERVER]
    workers = stack.servers[SERVER].workers
    async with _client(args.in_flight) as http:
        started = time.perf_counter()
        await wait_ready(http, url, token, workers)
        counts = await seed_sessions(http, url, keys, args.increments, args.in_flight)
        setup_s = time.perf_counter() - started
        prepare_s, prepared = await _timed(_control(http, url, token, "prepare", _body(checkpoint_id)))
        if not prepared.get("report", {}).get("ready"):
            raise BenchFailure(f"prepare was not ready: {json.dumps(prepared)[:500]}")
        commit_body = _body(checkpoint_id, checkpoint_dir=str(checkpoint_dir), episode_ids=keys)
        commit_s, committed = await _timed(_control(http, url, token, "commit", commit_body))
    if committed.get("record_count") != len(keys) or len(committed.get("episode_ids", [])) != len(keys):
        raise BenchFailure(
            f"the commit wrote {committed.get('record_count')!r} records for "
            f"{len(committed.get('episode_ids', []))} episodes, {len(keys)} sessions seeded"
        )
    figures = {
        "setup_s": setup_s,
        "prepare_s": prepare_s,
        "commit_s": commit_s,
        "records_bytes": int(committed["records_bytes"]),
        "record_count": int(committed["record_count"]),
    }
    return counts, figures


async def _second_life(
    stack: Stack, args: argparse.Namespace, token: str, counts: dict[str, int], checkpoint: tuple[str, Path]
) -> dict[str, Any]:
    """After the restart: wait for every worker, time restore, resume, check a sample."""
    checkpoint_id, checkpoint_dir = checkpoint
    url = stack.urls[SERVER]
    keys = list(counts)
    async with _client(args.in_flight) as http:
        await wait_ready(http, url, token, stack.servers[SERVER].workers)
        restore_body = _body(checkpoint_id, checkpoint_dir=str(checkpoint_dir), episode_ids=keys)
        restore_s, restored = await _timed(_control(http, url, token, "restore", restore_body))
        expected = {f"{key}-a1" for key in keys}
        got = set(restored.get("restored", []))
        if got != expected:
            raise BenchFailure(
                f"the restore installed {len(got)} sessions, {len(expected)} expected "
                f"(missing e.g. {sorted(expected - got)[:3]}, unexpected e.g. {sorted(got - expected)[:3]})"
            )
        await _control(http, url, token, "resume", _body(checkpoint_id))
        sample = sorted(random.Random(f"bench-workers:{checkpoint_id}").sample(keys, min(args.check, len(keys))))
        checked = await check_sample(http, url, counts, sample)
    return {"restore_s": restore_s, "restored": len(got), "checked": checked}


async def measure(args: argparse.Namespace, workers: int, rep: int, run_dir: Path, stacks: list[Stack]) -> Measurement:
    """One repetition on ``workers`` workers: a fresh server and checkpoint directory, killed after."""
    token = secrets.token_urlsafe(16)
    name = f"w{workers}-r{rep}"
    root = run_dir / name
    (root / "stack").mkdir(parents=True)
    checkpoint = (f"bench-workers-{name}", root / "checkpoint")
    keys = [f"bench-{index:06d}" for index in range(args.sessions)]
    stack = load_stack(_spec(token, root, workers), workdir=root / "stack")
    stacks.append(stack)
    wall, own, busy = time.perf_counter(), _own_cpu_s(), _machine_busy_s()
    try:
        stack.start()
        counts, first = await _first_life(stack, args, token, keys, checkpoint)
        server_cpu = _server_cpu_s(stack)
        await asyncio.to_thread(stack.kill)  # SIGKILL of the server's process group: every worker at once
        stack.start()
        second = await _second_life(stack, args, token, counts, checkpoint)
        server_cpu += _server_cpu_s(stack)
    except BenchFailure:
        _print_log_tail(stack)
        raise
    finally:
        await asyncio.to_thread(stack.close)
        stacks.remove(stack)
    wall, own, busy = time.perf_counter() - wall, _own_cpu_s() - own, _machine_busy_s() - busy
    shutil.rmtree(root, ignore_errors=True)
    return Measurement(
        workers=workers,
        rep=rep,
        **first,
        **second,
        bench_cpu_s=own,
        server_cpu_s=server_cpu,
        others_cpu_s=max(0.0, busy - own - server_cpu),
        wall_s=wall,
    )


def _print_log_tail(stack: Stack, lines: int = 30) -> None:
    log = stack.servers[SERVER].log_path
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return
    if not tail:
        return
    print(f"--- last lines of {log}:", *tail, sep="\n", file=sys.stderr)


# --- the run


async def run(args: argparse.Namespace, run_dir: Path, console: Console, stacks: list[Stack]) -> list[Measurement]:
    """Every repetition of every worker count; the order of the counts alternates between repetitions."""
    measurements: list[Measurement] = []
    for rep in range(args.repeat):
        order = args.workers if rep % 2 == 0 else args.workers[::-1]
        for workers in order:
            done = await measure(args, workers, rep, run_dir, stacks)
            measurements.append(done)
            console.log(
                f"rep {rep + 1}/{args.repeat}, {workers} worker(s): prepare {done.prepare_s:.3f}s, "
                f"commit {done.commit_s:.3f}s, restore {done.restore_s:.3f}s, "
                f"{done.record_count:,} records ({done.records_bytes / MB:.2f} MB), "
                f"{done.checked} sessions checked; setup {done.setup_s:.1f}s"
            )
    return measurements


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(measurements: list[Measurement], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per worker count: medians, and the medians of the per-repetition ratios to 1 worker."""
    by_key = {(item.workers, item.rep): item for item in measurements}
    rows = []
    for workers in args.workers:
        mine = [item for item in measurements if item.workers == workers]
        ratios: dict[str, list[float]] = {"commit": [], "restore": []}
        for item in mine:
            base = by_key[(1, item.rep)]
            ratios["commit"].append(item.commit_s / base.commit_s)
            ratios["restore"].append(item.restore_s / base.restore_s)
        cpu_total = sum(item.wall_s for item in mine) * (os.cpu_count() or 1)
        rows.append(
            {
                "workers": workers,
                "sessions": args.sessions,
                "prepare_s": _median([item.prepare_s for item in mine]),
                "commit_s": _median([item.commit_s for item in mine]),
                "restore_s": _median([item.restore_s for item in mine]),
                "records_bytes": _median([item.records_bytes for item in mine]),
                "commit_ratio_vs_1": _median(ratios["commit"]),
                "restore_ratio_vs_1": _median(ratios["restore"]),
                "ratio_reps": ratios,
                "others_cpu_share": sum(item.others_cpu_s for item in mine) / cpu_total if cpu_total else float("nan"),
                "reps": [asdict(item) for item in mine],
            }
        )
    return rows


def _table(document: dict[str, Any]) -> Table:
    config = document["config"]
    table = Table(
        title=f"counter server: {config['sessions']:,} sessions x {config['increments']} increments; "
        f"median of {config['repeat']} repetition(s), worker counts alternating",
        title_justify="left",
    )
    for name in ("workers", "sessions", "prepare s", "commit s", "restore s", "records MB"):
        table.add_column(name, justify="right")
    table.add_column("commit ratio vs 1 worker", justify="right")
    table.add_column("restore ratio vs 1 worker", justify="right")
    table.add_column("others' CPU", justify="right", style="dim")
    for row in document["rows"]:
        table.add_row(
            Text(str(row["workers"]), style="bold"),
            f"{row['sessions']:,}",
            f"{row['prepare_s']:.3f}",
            f"{row['commit_s']:.3f}",
            f"{row['restore_s']:.3f}",
            f"{row['records_bytes'] / MB:.3f}",
            Text(f"{row['commit_ratio_vs_1']:.2f}x", style="bold"),
            Text(f"{row['restore_ratio_vs_1']:.2f}x", style="bold"),
            f"{row['others_cpu_share']:.0%}",
        )
    return table


def render(document: dict[str, Any], console: Console) -> None:
    """Print the machine line, what was measured, and the table."""
    config = document["config"]
    console.print(
        f"[bold]gymckpt {config['gymckpt']}: commit and restore on 1, 2 and 4 uvicorn workers[/]: "
        f"Python {config['python']}, aiohttp {config['aiohttp']}, {config['cpus']} CPUs, {config['platform']}"
    )
    console.print(
        f"temp dir {config['dir']} ({config['filesystem']}); 127.0.0.1; {config['in_flight']} requests in flight"
    )
    console.print(
        "prepare, commit (every session, episode_ids given) and restore (every session, after SIGKILL of the "
        "server's process group and a restart with the same worker count, every worker linked) are timed from "
        "the client: the control call's round trip. records MB: the commit reply's records_bytes (10^6 bytes; with several "
        "workers each record also names the worker that owned its session). "
        "A ratio is the median of the per-repetition ratios N workers' time / 1 worker's time (> 1: slower). "
        f"After each restore {config['check']} sampled sessions continued with the right count. 'others' CPU': "
        "the share of all CPUs busy with processes other than this benchmark and its server over its "
        "repetitions.\n"
    )
    console.print(_table(document))
    worst = max(row["others_cpu_share"] for row in document["rows"])
    warn_if_disturbed(console, worst, config["cpus"], up_to=True)
    console.print(
        f"[dim]load average after: {' '.join(f'{value:.2f}' for value in config['load_average'])}; "
        f"total {config.get('elapsed_s', 0):.0f} s[/]"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_workers",
        description="Time prepare, commit and restore of many counter sessions on 1, 2 and 4 uvicorn workers.",
    )
    parser.add_argument("--sessions", type=positive, default=2000, help="sessions seeded (default 2000)")
    parser.add_argument("--repeat", type=positive, default=3, help="repetitions per worker count (default 3)")
    parser.add_argument("--increments", type=positive, default=2, help="increments per session (default 2)")
    parser.add_argument("--in-flight", type=positive, default=64, help="data requests in flight (default 64)")
    parser.add_argument("--check", type=positive, default=20, help="sessions checked after each restore (default 20)")
    parser.add_argument(
        "--workers", default="1,2,4", help="comma-separated worker counts, 1 among them (default 1,2,4)"
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints go, on the filesystem under test (default: the system temp dir); "
        "a run directory is created in it and removed after",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows to PATH as JSON")
    args = parser.parse_args(argv)
    try:
        args.workers = sorted({positive(part.strip()) for part in args.workers.split(",") if part.strip()})
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"--workers: {exc}")
    if 1 not in args.workers:
        parser.error("--workers must include 1: the ratios are to 1 worker")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _run_with_cleanup(function: Callable[[list[Stack]], Coroutine[Any, Any, list[Measurement]]]) -> list[Measurement]:
    """Run ``function`` with a list of running stacks; kill whatever is left in it on any exit."""
    stacks: list[Stack] = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return asyncio.run(function(stacks))
    finally:
        for stack in stacks:
            stack.close()
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    base = Path(args.dir).resolve() if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="gymckpt-bench-workers-", dir=base)).resolve()
    started = time.time()
    document: dict[str, Any] = {
        "config": {
            "sessions": args.sessions,
            "repeat": args.repeat,
            "increments": args.increments,
            "in_flight": args.in_flight,
            "check": args.check,
            "workers": args.workers,
            "dir": str(run_dir),
            "filesystem": filesystem(run_dir),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gymckpt": gymckpt_version,
            "aiohttp": aiohttp.__version__,
        },
    }
    try:
        measurements = _run_with_cleanup(lambda stacks: run(args, run_dir, console, stacks))
    except BenchFailure as exc:
        console.print(f"[bold red]WRONG RESULT, benchmark void:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]: every server started was killed")
        return 130
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    document["rows"] = summarize(measurements, args)
    document["config"]["elapsed_s"] = time.time() - started
    document["config"]["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
        console.log(f"rows written to {args.json}")
    render(document, Console() if sys.stdout.isatty() else Console(width=170))
    return 0


if __name__ == "__main__":
    sys.exit(main())
