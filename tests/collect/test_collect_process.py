"""``gymckpt collect`` as a real process against the reference stack: stop, kill, resume, prune, bad input.

One stack per module (real ``gymckpt serve`` processes, :class:`~gymckpt.stack.harness.RolloutHarness`),
started once; each test starts its Gym servers afresh (SIGKILL, start, wait until they
answer) and empties the inference backend's call log. The collector is always a
subprocess (``python -m gymckpt collect … --json``) whose stdout and stderr go to files.

"While rows are in flight" is caught without sleeps as synchronization: generations are
slow (:data:`TOKEN_DELAY`), and a test polls a real condition (the results file's line
count, the root's ``LATEST``) in a loop bounded in count and time (:data:`PHASE`), with a
short pause (:data:`POLL`) between reads.

The uninterrupted collection of the same dataset (:func:`reference`) is what every
interrupted and resumed one must equal, row by row.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml

from gymckpt.collect.checkpoints import CheckpointRoot
from gymckpt.demo.measure import generation_tokens, held_model_calls
from gymckpt.identity import capture_key, split_capture_key
from gymckpt.stack.harness import RolloutHarness, default_stack_spec, task_for
from gymckpt.store import open_store
from gymckpt.store.layout import index_path

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator
    from pathlib import Path

TOKEN = "collect-process-token"
#: seconds between generated tokens: a model call (8 tokens) takes ~0.16 s, a row ~0.7 s
TOKEN_DELAY = 0.02
#: rows of the stop and kill scenarios
ROWS = 200
#: the bound of any single wait: a collection, a poll loop, a restart (seconds)
PHASE = 120.0
#: the pause between two polls of a real condition (never the synchronization itself)
POLL = 0.05
#: exit statuses of ``gymckpt collect``
EXIT_OK, EXIT_USAGE, EXIT_STOPPED = 0, 2, 75

T = TypeVar("T")


# ----------------------------------------------------------------------------- files


def write_dataset(path: Path, rows: range) -> Path:
    """A dataset whose row ``i`` is ``task_for(i)`` (so its rollout id is ``"<i>-0"``)."""
    with path.open("a") as stream:
        stream.writelines(json.dumps(task_for(index)) + "\n" for index in rows)
    return path


def line_count(path: Path) -> int:
    """Complete lines of a file (0 if it does not exist yet)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def results_by_rollout(path: Path) -> tuple[Counter[str], dict[str, dict[str, Any]]]:
    """How many lines each rollout id has in a results file, and each one's last line."""
    counts: Counter[str] = Counter()
    lines: dict[str, dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        counts[line["_ng_rollout_id"]] += 1
        lines[line["_ng_rollout_id"]] = line
    return counts, lines


def read_latest(root: Path) -> str | None:
    """What ``<root>/LATEST`` names (None: not written yet)."""
    try:
        return (root / "LATEST").read_text().strip() or None
    except FileNotFoundError:
        return None


def checkpoint_dirs(root: Path) -> set[str]:
    return {path.name for path in root.glob("ckpt-*") if path.is_dir()}


def is_published(root: Path, checkpoint_id: str) -> bool:
    return (root / index_path(checkpoint_id)).is_file()


def continued_keys(checkpoint_dir: Path) -> list[str]:
    """The capture keys of the attempts a published checkpoint continues (its ``extra["continued"]``)."""
    store = open_store(str(checkpoint_dir))
    try:
        extra = store.read_index("").extra
    finally:
        store.close()
    return sorted(capture_key(item["rollout_id"], item["attempt"]) for item in extra["continued"])


def assert_each_row_once_as_in(results: Path, reference: dict[str, dict[str, Any]]) -> None:
    """Every rollout of ``reference`` has exactly one line in ``results``, whose result is the reference's."""
    counts, lines = results_by_rollout(results)
    assert set(counts) == set(reference), (sorted(set(reference) - set(counts)), sorted(set(counts) - set(reference)))
    twice = sorted(key for key, count in counts.items() if count != 1)
    assert not twice, f"rows with more than one results line: {twice}"
    differing = sorted(key for key, line in lines.items() if line.get("result") != reference[key])
    assert not differing, f"rows whose result differs from the uninterrupted run: {[lines[k] for k in differing[:3]]}"


def wait_until(condition: Callable[[], T | None], what: str, watched: Collection | None = None) -> T:
    """Poll ``condition`` until it returns a value (not None), at most :data:`PHASE` seconds.

    Fails at once if the ``watched`` collector exits first.
    """
    deadline = time.monotonic() + PHASE
    for _ in range(int(PHASE / POLL) + 1):
        value = condition()
        if value is not None:
            return value
        if watched is not None and watched.process.poll() is not None:
            raise AssertionError(f"collect exited {watched.process.returncode} before {what}:\n{watched.stderr()}")
        if time.monotonic() > deadline:
            break
        time.sleep(POLL)
    raise AssertionError(f"never {what} within {PHASE:.0f} s")


# ----------------------------------------------------------------------------- the collector


@dataclass
class Finished:
    """A collector process that exited: its status, its ``--json`` summary, its stderr."""

    code: int
    summary: dict[str, Any]
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.code}, summary {self.summary}\n{self.stderr[-3000:]}"


@dataclass
class Collection:
    """A ``gymckpt collect`` subprocess; stdout and stderr go to files beside its results."""

    process: subprocess.Popen[bytes]
    stdout_path: Path
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def finish(self) -> Finished:
        """Wait (at most :data:`PHASE`) for the exit; kill it and fail if it does not come."""
        try:
            code = self.process.wait(timeout=PHASE)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"collect did not exit within {PHASE:.0f} s:\n{self.stderr()[-3000:]}") from None
        text = self.stdout_path.read_text()
        try:
            summary = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            summary = {"stdout": text}
        return Finished(code, summary, self.stderr())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=PHASE)


def collect_command(*arguments: str | Path) -> list[str]:
    return [sys.executable, "-m", "gymckpt", "collect", *(str(argument) for argument in arguments)]


def start_process(command: list[str], logs: Path, started: list[Collection]) -> Collection:
    """Start ``command`` with stdout and stderr to ``<logs>.stdout`` / ``.stderr``; remember it in ``started``."""
    stdout_path, stderr_path = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
    with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    collection = Collection(process, stdout_path, stderr_path)
    started.append(collection)
    return collection


# ----------------------------------------------------------------------------- the module's stack


@dataclass
class CollectStack:
    """The module's running stack, its event loop, and the collectors the current test started."""

    runner: asyncio.Runner
    harness: RolloutHarness
    #: the allowed root of every Gym server: each test's files and checkpoints go below it
    base: Path
    #: the ``--config`` file (the stack's ``checkpoint:`` block, with the control token)
    config: Path
    started: list[Collection] = field(default_factory=list)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(asyncio.wait_for(work, PHASE))

    async def _restart(self) -> None:
        """SIGKILL every Gym server (the inference backend survives), start them again, wait until all answer."""
        await asyncio.to_thread(self.harness.crash)
        self.harness.restart()
        gym = await self.harness.wait_ready(timeout=PHASE)
        await gym.close()

    def restart(self) -> None:
        self.run(self._restart())

    def fresh(self) -> None:
        """Fresh Gym servers and an empty inference call log: nothing of an earlier collection is left."""

        async def fresh() -> None:
            await self._restart()
            await self.harness.reset_model_calls()

        self.run(fresh())

    def model_calls(self) -> list[dict[str, Any]]:
        return self.run(self.harness.model_calls())

    def start_collect(self, dataset: Path, out: Path, root: Path, *options: str) -> Collection:
        """``gymckpt collect DATASET`` against this stack, ``--json``, with ``options`` (``--every``, ``--resume``…)."""
        urls = self.harness.urls
        servers = [part for name in ("model", "resources", "agent") for part in ("--servers", urls[name])]
        command = collect_command(
            dataset,
            *("--environment", urls["environment"]),
            *servers,
            *("--out", out, "--checkpoint-dir", root, "--config", self.config),
            *("--concurrency", "32", "--json"),
            *options,
        )
        return start_process(command, out.with_name(f"{out.stem}.run{len(self.started)}"), self.started)

    def end_test(self) -> None:
        """Kill every collector the test left running."""
        started, self.started = self.started, []
        for collection in started:
            collection.kill()


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CollectStack]:
    """The reference stack for the module; every server is killed at the end, whatever the tests did."""
    base = tmp_path_factory.mktemp("collect")
    spec = default_stack_spec(token=TOKEN, token_delay_seconds=TOKEN_DELAY, allowed_roots=[str(base)])
    config = base / "collect.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": spec["checkpoint"]}))
    runner = asyncio.Runner()
    harness: RolloutHarness | None = None
    try:
        servers = base / "servers"
        servers.mkdir()
        harness = runner.run(RolloutHarness.open(spec, workdir=servers))
        stack = CollectStack(runner, harness, base, config)
        try:
            yield stack
        finally:
            stack.end_test()
    finally:
        if harness is not None:
            runner.run(harness.close())
        runner.close()


@pytest.fixture
def stack(module_stack: CollectStack) -> Iterator[CollectStack]:
    """The module's stack with fresh Gym servers; every collector the test started is killed after it."""
    module_stack.fresh()
    try:
        yield module_stack
    finally:
        module_stack.end_test()


@pytest.fixture
def workdir(module_stack: CollectStack, request: pytest.FixtureRequest) -> Path:
    """A directory of this test's own below the servers' allowed root."""
    path = module_stack.base / request.node.name[:48]
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def reference(module_stack: CollectStack) -> dict[str, dict[str, Any]]:
    """The uninterrupted collection of the :data:`ROWS`-row dataset: rollout id → result."""
    module_stack.fresh()
    try:
        directory = module_stack.base / "reference"
        directory.mkdir()
        dataset = write_dataset(directory / "data.jsonl", range(ROWS))
        out = directory / "results.jsonl"
        done = module_stack.start_collect(dataset, out, directory / "ckpts").finish()
    finally:
        module_stack.end_test()
    assert done.code == EXIT_OK, done
    assert done.summary["finished"] == ROWS and done.summary["failed"] == 0, done
    counts, lines = results_by_rollout(out)
    assert counts == Counter({f"{index}-0": 1 for index in range(ROWS)})
    assert all("result" in line for line in lines.values())
    return {key: line["result"] for key, line in lines.items()}


# ----------------------------------------------------------------------------- the tests


def test_sigterm_then_resume_gives_every_row_once_equal_to_an_uninterrupted_collect(
    reference: dict[str, dict[str, Any]], stack: CollectStack, workdir: Path
) -> None:
    dataset = write_dataset(workdir / "data.jsonl", range(ROWS))
    out, root = workdir / "results.jsonl", workdir / "ckpts"

    first = stack.start_collect(dataset, out, root)
    ended = wait_until(
        lambda: count if (count := line_count(out)) >= ROWS * 0.4 else None, "40% of the rows ended", first
    )
    first.signal(signal.SIGTERM)
    stopped = first.finish()

    assert stopped.code == EXIT_STOPPED, stopped
    assert stopped.summary["stopped"] is True, stopped
    stopped_at = stopped.summary["stopped_at"]
    assert stopped_at, stopped
    assert read_latest(root) == stopped_at
    latest = CheckpointRoot(str(root)).latest()
    assert latest is not None and latest.checkpoint_id == stopped_at
    assert ended <= line_count(out) < ROWS, "the stop left no row in flight"
    keys = continued_keys(root / stopped_at)
    assert keys, "the stop's checkpoint continues no row"
    assert all(split_capture_key(key)[1] == 0 for key in keys), keys  # the first run sent attempt 0 only
    before = stack.model_calls()

    stack.restart()  # the servers the stop left stopped are gone; fresh ones restore the checkpoint
    resumed = stack.start_collect(dataset, out, root, "--resume").finish()
    after = stack.model_calls()

    assert resumed.code == EXIT_OK, resumed
    assert resumed.summary["continued"] > 0, resumed
    assert resumed.summary["skipped"] + resumed.summary["finished"] == ROWS, resumed
    assert resumed.summary["failed"] == 0, resumed
    assert_each_row_once_as_in(out, reference)
    held = held_model_calls(str(root / stopped_at), {}, keys, completed=[])
    tokens = generation_tokens(before, after, keys, held)
    assert tokens.from_first_token == 0, tokens
    assert tokens.generated_again == 0, tokens


def test_sigkill_of_the_collector_then_resume_from_the_last_periodic_checkpoint(
    reference: dict[str, dict[str, Any]], stack: CollectStack, workdir: Path
) -> None:
    dataset = write_dataset(workdir / "data.jsonl", range(ROWS))
    out, root = workdir / "results.jsonl", workdir / "ckpts"
    seen: list[str | None] = [None]

    def just_published() -> str | None:
        """A checkpoint published since the last poll, once 30% of the rows have ended (rows are in flight)."""
        named, previous = read_latest(root), seen[0]
        seen[0] = named
        assert line_count(out) <= ROWS * 0.6, "no periodic checkpoint was published while 30–60% of rows had ended"
        return named if named is not None and named != previous and line_count(out) >= ROWS * 0.3 else None

    first = stack.start_collect(dataset, out, root, "--every", "1")
    wait_until(just_published, "a periodic checkpoint with 30% of the rows ended", first)
    first.process.kill()  # SIGKILL: no checkpoint on the way out
    first.process.wait(timeout=PHASE)
    stack.run(asyncio.to_thread(stack.harness.crash))  # a node loss: the Gym servers die with it
    assert first.process.returncode == -signal.SIGKILL

    killed_at = read_latest(root)
    assert killed_at is not None
    latest = CheckpointRoot(str(root)).latest()
    assert latest is not None and latest.checkpoint_id == killed_at
    assert line_count(out) < ROWS
    keys = continued_keys(root / killed_at)
    assert keys, "the periodic checkpoint continues no row"
    before = stack.model_calls()

    stack.restart()
    resumed = stack.start_collect(dataset, out, root, "--resume").finish()
    after = stack.model_calls()

    assert resumed.code == EXIT_OK, resumed
    assert resumed.summary["continued"] > 0, resumed
    assert resumed.summary["failed"] == 0, resumed
    assert_each_row_once_as_in(out, reference)
    # what ran after the checkpoint is redone by design: only the checkpoint's own cuts must not start over
    held = held_model_calls(str(root / killed_at), {}, keys, completed=[])
    tokens = generation_tokens(before, after, keys, held)
    assert tokens.from_first_token == 0, tokens


def test_keep_two_leaves_the_two_newest_published_checkpoints(stack: CollectStack, workdir: Path) -> None:
    rows = 40
    dataset = write_dataset(workdir / "data.jsonl", range(rows))
    out, root = workdir / "results.jsonl", workdir / "ckpts"
    every = ("--every", "0.5", "--keep", "2", "--concurrency", "8")

    done = stack.start_collect(dataset, out, root, *every).finish()

    assert done.code == EXIT_OK, done
    taken = done.summary["checkpoints"]
    assert len(taken) >= 3, f"the run took fewer than 3 checkpoints: {done}"
    older, newer = taken[-2:]
    assert checkpoint_dirs(root) == {older, newer}
    assert is_published(root, older) and is_published(root, newer)
    assert read_latest(root) == newer
    latest = CheckpointRoot(str(root)).latest()
    assert latest is not None and latest.checkpoint_id == newer

    # a crash between publish and delete: the older one lost its index mid-prune, and a newer-looking
    # directory never got one (its servers' records are there, its index is not)
    (root / index_path(older)).unlink()
    unpublished = "ckpt-29991231T235959-0badc0de"
    shutil.copytree(root / newer, root / unpublished)
    (root / index_path(unpublished)).unlink()
    checkpoints = CheckpointRoot(str(root))
    try:
        assert [item.checkpoint_id for item in checkpoints.published()] == [newer]
        assert checkpoints.latest() is not None and checkpoints.latest().checkpoint_id == newer
        (root / "LATEST").rename(root / "LATEST.kept")  # without LATEST: the newest *published* one
        assert checkpoints.latest() is not None and checkpoints.latest().checkpoint_id == newer
        (root / "LATEST.kept").rename(root / "LATEST")
    finally:
        checkpoints.close()

    # a resume of the complete dataset runs nothing and publishes nothing: pruning waits for the next publish
    idle = stack.start_collect(dataset, out, root, "--resume", *every).finish()
    assert idle.code == EXIT_OK, idle
    assert idle.summary["skipped"] == rows and idle.summary["finished"] == 0, idle
    assert idle.summary["checkpoints"] == [], idle
    assert read_latest(root) == newer
    checkpoints = CheckpointRoot(str(root))
    try:
        assert checkpoints.latest() is not None and checkpoints.latest().checkpoint_id == newer
    finally:
        checkpoints.close()

    # the next publish (more rows to run) removes every unpublished directory and keeps two published ones
    more = 16
    write_dataset(dataset, range(rows, rows + more))
    grown = stack.start_collect(dataset, out, root, "--resume", *every).finish()
    assert grown.code == EXIT_OK, grown
    assert grown.summary["skipped"] == rows and grown.summary["finished"] == more, grown
    published_now = grown.summary["checkpoints"]
    assert published_now, f"the resume published no checkpoint: {grown}"
    remaining = checkpoint_dirs(root)
    assert unpublished not in remaining and older not in remaining
    assert all(is_published(root, checkpoint_id) for checkpoint_id in remaining), remaining
    assert len(remaining) == 2 and published_now[-1] in remaining, remaining
    assert read_latest(root) == published_now[-1]
    counts, _ = results_by_rollout(out)
    assert counts == Counter({f"{index}-0": 1 for index in range(rows + more)})


def run_collect_without_a_stack(tmp_path: Path, dataset: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "collect.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": {"enabled": True, "control_auth_token": TOKEN}}))
    command = collect_command(
        dataset,
        *("--environment", "http://127.0.0.1:9", "--out", tmp_path / "results.jsonl"),
        *("--checkpoint-dir", tmp_path / "ckpts", "--config", config, "--json"),
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=PHASE, stdin=subprocess.DEVNULL)


def test_config_errors_name_file_line_and_id(tmp_path: Path) -> None:
    reserved = tmp_path / "reserved.jsonl"
    reserved.write_text(
        json.dumps(task_for(0)) + "\n" + json.dumps({"_ng_rollout_id": "task-a2", **task_for(1)}) + "\n"
    )
    failed = run_collect_without_a_stack(tmp_path, reserved)
    assert failed.returncode == EXIT_USAGE, (failed.stdout, failed.stderr)
    assert f"{reserved}:2:" in failed.stderr, failed.stderr
    assert "task-a2" in failed.stderr and "reserved" in failed.stderr, failed.stderr
    assert not (tmp_path / "results.jsonl").exists()  # refused before anything was written

    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(json.dumps(task_for(0)) + "\n" + json.dumps(task_for(1)) + "\n" + '{"task": \n')
    failed = run_collect_without_a_stack(tmp_path, malformed)
    assert failed.returncode == EXIT_USAGE, (failed.stdout, failed.stderr)
    assert f"{malformed}:3:" in failed.stderr, failed.stderr
    assert not (tmp_path / "results.jsonl").exists()
