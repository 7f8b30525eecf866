"""Faults on the shared filesystem: the committing process SIGKILLed at random points with the other
mount checking after each, the chunkserver stopped or killed mid-commit, the client mount killed
mid-commit. After each: no manifest, or one that verifies; then a recommit succeeds."""

from __future__ import annotations

import errno
import hashlib
import random
import re
import select
import signal
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gymckpt.errors import GymckptError, NoCheckpointFound, StorageError
from gymckpt.store import verify
from gymckpt.testing.sharedfs import poll
from gymckpt.testing.values import same_records, sample_records

from .conftest import PARTICIPANT

if TYPE_CHECKING:
    from gymckpt.testing.sharedfs import MooseFS

    from .conftest import CommitWorker, Hosts

pytestmark = pytest.mark.slow

SEED = 20251201
#: kills at every os operation of a commit, then at random moments, up to this many in all
KILLS = 120
RECORDS = {"count": 20, "payload": 100, "prefix": "r"}
#: larger commits for the daemon faults: the fault lands while the records file still has data to flush
LARGE = {"count": 300, "payload": 500, "prefix": "r"}
ALLOWED_WARNINGS = {"leftover_temporary_file", "orphaned_records", "unfinished_commit", "checkpoint_unpublished"}
RECORDS_FILE = re.compile(r"records-([0-9a-f]{64})\.jsonl")
#: how long a commit under a fault may take before the worker kills it (the bound the test asserts)
FAULT_TIMEOUT = 60.0


def _manifest(root: Path, checkpoint: str) -> Path:
    return root / checkpoint / "gym" / PARTICIPANT["kind"] / PARTICIPANT["instance"] / "manifest.json"


def _check_state(root: Path, checkpoint: str, reference: bytes) -> bool:
    """No manifest, or the reference manifest and a checkpoint that verifies; True when there is one."""
    for path in (root / checkpoint).rglob("records-*.jsonl"):
        match = RECORDS_FILE.fullmatch(path.name)
        assert match and hashlib.sha256(path.read_bytes()).hexdigest() == match.group(1), f"{path} has other bytes"
    manifest = _manifest(root, checkpoint)
    present = manifest.exists()
    if present:
        assert manifest.read_bytes() == reference, f"{manifest} is not the manifest these records give"
    try:
        report = verify(str(root / checkpoint))
    except NoCheckpointFound:
        assert not present
        return False
    assert report.ok, [finding.to_dict() for finding in report.errors]
    assert {finding.code for finding in report.warnings} <= ALLOWED_WARNINGS, report.warnings
    return present


def _recommit(hosts: Hosts, host: str, checkpoint: str, records: dict[str, Any], reference: bytes) -> None:
    """Commit the same records again through ``host``: the reference manifest, and the records read back."""
    store = hosts.store(host)
    expected = sample_records(records["count"], prefix=records["prefix"], payload=records["payload"])
    manifest = store.write_participant(checkpoint, **PARTICIPANT, records=iter(expected))
    assert manifest.raw == reference
    kind, instance = PARTICIPANT["kind"], PARTICIPANT["instance"]
    assert same_records(list(store.read_participant(checkpoint, kind=kind, instance=instance)), expected)
    assert _check_state(hosts.a if host == "b" else hosts.b, checkpoint, reference)


def _reference(worker: CommitWorker, hosts: Hosts, records: dict[str, Any]) -> dict[str, Any]:
    """An unkilled commit through A, counting its os operations, observed from B at once."""
    dry = worker.commit(hosts.a, f"reference-{records['count']}", kill_at=-1, observe_root=str(hosts.b), **records)
    child = dry["child"]
    assert dry["exit_code"] == 0 and child["outcome"] == "committed", dry
    child["raw"] = _manifest(hosts.b, f"reference-{records['count']}").read_bytes()
    assert hashlib.sha256(child["raw"]).hexdigest() == child["manifest_sha256"]
    return dry


def test_sigkill_at_random_points_with_the_other_mount_checking(
    hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """A commit through A is SIGKILLed before each of its os operations, then at random moments (the
    kill may land inside a FUSE request), at least KILLS kills in all; after each, B checks at once and
    again after verifying: no manifest, or the reference manifest and a checkpoint that verifies. Then
    B recommits the same records. Commits the timer missed count how often B saw the manifest at once."""
    worker = workers[0]
    dry = _reference(worker, hosts, RECORDS)
    trace, reference = dry["child"]["trace"], dry["child"]["raw"]
    assert len(trace) > 20, trace
    rng = random.Random(SEED)
    op_points = list(range(1, len(trace) + 1))
    rng.shuffle(op_points)
    plan: list[tuple[str, float]] = [("op", at) for at in op_points]
    durations = [dry["seconds"]]  # of commits that were not killed: the timer's range follows them
    seen: Counter[str] = Counter()
    killed_before: Counter[str] = Counter()
    kills = attempts = 0
    while kills < KILLS and attempts < 3 * KILLS:
        kind, value = plan[attempts] if attempts < len(plan) else ("time", rng.uniform(0.0, 1.2 * min(durations)))
        checkpoint = f"kill-{attempts}"
        attempts += 1
        fields = {"kill_at": value} if kind == "op" else {"kill_after": value, "observe_root": str(hosts.b)}
        reply = worker.commit(hosts.a, checkpoint, **RECORDS, **fields)
        assert not reply["timed_out"], reply
        killed = reply["signaled"] and reply["signal"] == signal.SIGKILL
        at_once = _manifest(hosts.b, checkpoint).exists()
        present = _check_state(hosts.b, checkpoint, reference)
        if killed:
            kills += 1
            seen[f"{kind}_kill_then_manifest_{'present' if present else 'absent'}"] += 1
            seen["manifest_appeared_after_the_first_look"] += present and not at_once
            if kind == "op":
                killed_before[trace[int(value) - 1]] += 1
        else:
            assert kind == "time", f"kill point {value} ({trace[int(value) - 1]}) was not reached: {reply}"
            child = reply["child"]
            assert child["outcome"] == "committed" and present, child
            durations.append(reply["seconds"])
            seen["timer_missed_commit_completed"] += 1
            seen["completed_then_b_read_the_same_manifest_at_once"] += (
                child["observed"]["visible"] and child["observed"]["same_bytes"]
            )
        _recommit(hosts, "b", checkpoint, RECORDS, reference)
    observations.update(
        kills=kills,
        attempts=attempts,
        op_kills=len(op_points),
        ops_per_commit=len(trace),
        reference_commit_seconds=round(dry["seconds"], 4),
        reference_observed_from_b_after_create_returned=dry["child"]["observed"],
        outcomes=dict(seen),
        killed_before_op=dict(killed_before),
    )
    assert kills >= KILLS, observations
    assert seen["completed_then_b_read_the_same_manifest_at_once"] == seen["timer_missed_commit_completed"]


def _reply_waiting(worker: CommitWorker) -> bool:
    """True when the worker's reply has not come yet (the commit still runs)."""
    assert worker.proc.stdout is not None
    ready, _, _ = select.select([worker.proc.stdout.fileno()], [], [], 0)
    return not ready and b"\n" not in worker._buffer


def _storage_error(child: dict[str, Any]) -> bool:
    return child is not None and child["outcome"] == "error" and "StorageError" in child["types"]


def test_chunkserver_stopped_mid_commit(
    moosefs: MooseFS, hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """The chunkserver SIGSTOPped halfway through the records: the commit ends with a StorageError and
    leaves no manifest, within FAULT_TIMEOUT (the master drops the hung chunkserver after MATOCS_TIMEOUT,
    10 s, then the client gives up after mfsioretries=5: ENXIO); running again, the recommit succeeds."""
    assert moosefs.chunkserver is not None
    reference = _reference(workers[1], hosts, LARGE)["child"]["raw"]
    hook = {"pid": moosefs.chunkserver.pid, "signal": signal.SIGSTOP, "after_records": LARGE["count"] // 2}
    try:
        reply = workers[0].commit(hosts.a, "stopped", signal_at=hook, timeout=FAULT_TIMEOUT, **LARGE)
        no_manifest_while_stopped = not _manifest(hosts.b, "stopped").exists()
    finally:
        moosefs.continue_chunkserver()
    child = reply["child"]
    assert not reply["timed_out"] and _storage_error(child), reply
    assert no_manifest_while_stopped and not _check_state(hosts.b, "stopped", reference)
    moosefs.wait_writable("a")
    again = workers[0].commit(hosts.a, "stopped", timeout=FAULT_TIMEOUT, **LARGE)
    assert again["child"]["outcome"] == "committed", again
    assert _check_state(hosts.b, "stopped", reference)
    observations.update(
        failed_after_seconds=round(reply["seconds"], 2), error=child["error"], errno=child["errno"], type=child["type"]
    )


def _unreadable(root: Path, checkpoint: str) -> list[str]:
    """Files under the checkpoint that the filesystem fails to read (EIO, ENXIO)."""
    failed = []
    for path in sorted((root / checkpoint).rglob("*")):
        if path.is_file():
            try:
                path.read_bytes()
            except OSError as exc:
                failed.append(f"{path.name}: {exc.strerror}")
    return failed


def test_chunkserver_killed_mid_commit(
    moosefs: MooseFS, hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """The only chunkserver SIGKILLed halfway through the records and restarted at once. Either the
    commit fails with a StorageError and leaves no manifest, or it completes; when it completed, the
    checkpoint verifies from B, or, where MooseFS acknowledged the fsync but lost the chunk it was
    writing (one copy, goal 1), verify and restore from B refuse it with a typed error instead of
    handing out other records. Then the recommit succeeds and repairs it (the records file is rewritten)."""
    assert moosefs.chunkserver is not None
    reference = _reference(workers[1], hosts, LARGE)["child"]["raw"]
    chunkserver = moosefs.chunkserver
    hook = {"pid": chunkserver.pid, "signal": signal.SIGKILL, "after_records": LARGE["count"] // 2}
    worker = workers[0]
    worker.prepare(hosts.a, "killed", signal_at=hook, timeout=FAULT_TIMEOUT, **LARGE)
    worker.go()
    try:
        poll(lambda: chunkserver.poll() is not None, FAULT_TIMEOUT, "the commit killed the chunkserver")
    finally:
        if moosefs.chunkserver.poll() is not None:
            moosefs.start_chunkserver()
    reply = worker.outcome()
    child = reply["child"]
    assert not reply["timed_out"], reply
    lost: list[str] = []
    if child["outcome"] != "committed":
        assert _storage_error(child), child
        assert not _check_state(hosts.b, "killed", reference)
    elif lost := _unreadable(hosts.b, "killed"):
        assert _manifest(hosts.b, "killed").read_bytes() == reference
        with pytest.raises(StorageError):
            verify(str(hosts.b / "killed"))
        with pytest.raises(GymckptError):
            list(
                hosts.store("b").read_participant("killed", kind=PARTICIPANT["kind"], instance=PARTICIPANT["instance"])
            )
    else:
        assert _check_state(hosts.b, "killed", reference)
    moosefs.wait_writable("a")
    _recommit(hosts, "a", "killed", LARGE, reference)
    assert _unreadable(hosts.b, "killed") == []
    observations.update(
        outcome=child["outcome"],
        error=child.get("error"),
        acknowledged_but_unreadable=lost,
        seconds=round(reply["seconds"], 2),
    )


def _waiting_in_fuse(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/wchan").read_text() == "request_wait_answer"
    except OSError:
        return False


def test_commit_while_the_only_chunkserver_is_gone_waits_for_it(
    moosefs: MooseFS, hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """A commit started while the only chunkserver is down: MooseFS neither fails it nor lets it finish
    (the master answers "try again" for new chunks, whatever mfstimeout says): the writer waits in a
    FUSE request, B sees no manifest; the chunkserver back, the commit completes and verifies from B.

    Or, when the writer's retry lands between the chunkserver's connecting and its reporting its
    disks (the master has no space for a chunk then: ENOSPC, as the fixture's wait_writable sees;
    or EIO once the client's mfsioretries are spent on that moment, on a loaded machine), the
    commit ends with a StorageError carrying that errno, leaves no manifest, and a recommit
    through A succeeds."""
    reference = _reference(workers[1], hosts, RECORDS)["child"]["raw"]
    moosefs.kill_chunkserver()
    worker = workers[0]
    try:
        pid = worker.prepare(hosts.a, "gone", timeout=FAULT_TIMEOUT, **RECORDS)
        worker.go()
        poll(lambda: _waiting_in_fuse(pid), FAULT_TIMEOUT, "the commit waits in a FUSE request")
        still_waiting = _reply_waiting(worker)
        no_manifest = not _manifest(hosts.b, "gone").exists()
    finally:
        moosefs.start_chunkserver()
    reply = worker.outcome()
    assert still_waiting and no_manifest
    child = reply["child"]
    if child["outcome"] == "error":
        assert _storage_error(child) and child["errno"] in (errno.ENOSPC, errno.EIO), child
        assert not _check_state(hosts.b, "gone", reference)
        _recommit(hosts, "a", "gone", RECORDS, reference)
        observations.update(outcome=f"errno {child['errno']} as the chunkserver came back, then recommitted")
        return
    assert child["outcome"] == "committed", child
    assert _check_state(hosts.b, "gone", reference)
    observations.update(commit_seconds_including_the_wait=round(reply["seconds"], 2))


def test_client_mount_killed_mid_commit(
    moosefs: MooseFS, hosts: Hosts, workers: tuple[CommitWorker, CommitWorker], observations: dict[str, Any]
) -> None:
    """mfsmount of A SIGKILLed halfway through the records: ENOTCONN, a StorageError, no manifest seen
    from B; A mounted again, the recommit succeeds and B verifies it."""
    reference = _reference(workers[1], hosts, LARGE)["child"]["raw"]
    hook = {"pid": moosefs.mounts["a"].pid, "signal": signal.SIGKILL, "after_records": LARGE["count"] // 2}
    try:
        reply = workers[0].commit(hosts.a, "client", signal_at=hook, timeout=FAULT_TIMEOUT, **LARGE)
    finally:
        moosefs.remount("a")
    child = reply["child"]
    assert not reply["timed_out"] and _storage_error(child), reply
    assert not _check_state(hosts.b, "client", reference)
    again = workers[0].commit(hosts.a, "client", timeout=FAULT_TIMEOUT, **LARGE)
    assert again["child"]["outcome"] == "committed", again
    assert _check_state(hosts.b, "client", reference)
    observations.update(error=child["error"], errno=child["errno"], seconds=round(reply["seconds"], 2))
