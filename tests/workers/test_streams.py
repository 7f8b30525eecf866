"""Records between the coordinator and its workers in bounded chunks: commit's gather, restore's scatter.

A real ControlPlane over a CoordinatedParticipant with linked workers (tests/workers/cluster.py);
records are large enough that every worker's part spans several chunks of the real chunk size.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
import random
import re
import string
import tracemalloc
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import gymckpt.workers.scatter as scatter_module
from gymckpt import gc_pause
from gymckpt.control.plane import ControlPlane
from gymckpt.control.plane_restore import ScopeRecords
from gymckpt.errors import InvalidCheckpointState, InvalidRecord, InvalidRequest
from gymckpt.store import open_store
from gymckpt.store._local import _LocalSink
from gymckpt.store.codec import decode_line, encode_record, rekeyed_line
from gymckpt.store.encoded import check_run
from gymckpt.testing.participant import FakeParticipant
from gymckpt.testing.time import until
from gymckpt.workers import link as link_module
from gymckpt.workers.coordinator_fields import with_session_id
from gymckpt.workers.placement import whole_episode_rule
from gymckpt.workers.scatter import (
    _prepared,
    _prepared_line,
    plan_scatter,
    read_share,
    scatter_lines,
    share_lists,
    survey,
    survey_lines,
)
from gymckpt.workers.streams import CHUNK_BYTES, InstallStaging, append_export, encode_export_chunk, exported_run

from ..support import error_code
from .cluster import INSTANCE, KIND, call, client_of, cluster, control_app, request

if TYPE_CHECKING:
    from .cluster import Cluster

ROUTING = ["1" * 32, "2" * 32]
#: records per worker; each about half a chunk, so every worker's part spans several chunks
PER_WORKER = 7


def _state(seed: int) -> dict[str, Any]:
    """About CHUNK_BYTES / 2 of text, with the values a fast path must not lose."""
    rnd = random.Random(seed)
    text = "".join(rnd.choices(string.ascii_letters + ' é"\\\n', k=CHUNK_BYTES // 2))
    return {"text": text, "nan": float("nan"), "big": 2**70 + seed, "seed": seed}


def _records_file(checkpoint: Path, kind: str = KIND) -> tuple[Any, bytes]:
    store = open_store(str(checkpoint))
    manifest = store.read_manifest("", kind=kind, instance=INSTANCE)
    return manifest, (checkpoint / manifest.records_path).read_bytes()


def _manifests(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.rglob("manifest.json")) if checkpoint.exists() else []


def _count_calls(running: Cluster, name: str) -> list[int]:
    """Count the coordinator's calls of ``name`` by worker index (patched on the instance)."""
    seen: list[int] = []
    original = getattr(running.coordinator, name)

    async def counted(index: int, *args: Any) -> Any:
        seen.append(index)
        return await original(index, *args)

    setattr(running.coordinator, name, counted)
    return seen


@pytest.mark.parametrize("path", ["appended", "chunks"])
async def test_a_commit_larger_than_a_chunk_is_appended_or_moves_in_chunks_and_writes_the_one_worker_file(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker appends its lines to the local records file itself; where the sink takes no
    appends, they reach the coordinator in several chunks. Either way the file is the one-worker file."""
    keys = {index: [f"w{index}-{n}" for n in range(PER_WORKER)] for index in (1, 2)}
    single = FakeParticipant(KIND, INSTANCE)
    for index in (1, 2):
        for number, key in enumerate(keys[index]):
            single.start(key, _state(index * 100 + number))
    plane = ControlPlane(single)
    async with client_of(control_app(plane)) as alone:
        assert (await call(alone, "prepare", request("c1"))).json()["phase"] == "prepared"
        reply = await call(alone, "commit", request("c1", checkpoint_dir=str(tmp_path / "one")))
        assert reply.status_code == 200, reply.text
    await plane.close()

    if path == "chunks":
        monkeypatch.setattr(_LocalSink, "append_target", lambda self: None)
    async with cluster(tmp_path, 2) as running:
        chunks = _count_calls(running, "export_chunk")
        appends = _count_calls(running, "_append_lines")
        for worker in running.workers:
            for number, key in enumerate(keys[worker.index]):
                worker.fake.start(key, _state(worker.index * 100 + number))
        assert (await running.workers[0].call("prepare", request("c1"))).json()["phase"] == "prepared"
        reply = await running.workers[1].call("commit", request("c1", checkpoint_dir=str(tmp_path / "two")))
        assert reply.status_code == 200, reply.text
        assert reply.json()["episode_ids"] == sorted(keys[1] + keys[2])
    if path == "appended":  # one append per worker, no chunk
        assert appends == [1, 2] and chunks == []
    else:  # every worker's part came in several chunks
        assert appends == []
        assert chunks.count(1) > 1
        assert chunks.count(2) > 1
    one_manifest, one_bytes = _records_file(tmp_path / "one")
    two_manifest, two_bytes = _records_file(tmp_path / "two")
    if path == "appended":  # the workers appended at once: the same lines, each worker's in its order
        lines = two_bytes.splitlines(keepends=True)
        assert sorted(lines) == sorted(one_bytes.splitlines(keepends=True))
        for index in (1, 2):
            own = [line for line in lines if line.startswith(b'{"episode_id":"w%d-' % index)]
            assert own == [line for line in one_bytes.splitlines(keepends=True) if line in set(own)]
        assert two_manifest.records_sha256 == hashlib.sha256(two_bytes).hexdigest()
    else:  # chunks come a worker after the other: the one-worker file, byte for byte
        assert two_bytes == one_bytes
        assert two_manifest.records_sha256 == one_manifest.records_sha256
    assert two_manifest.record_count == 2 * PER_WORKER


@pytest.mark.parametrize("path", ["appended", "chunks"])
async def test_a_worker_lost_in_the_middle_of_its_lines_fails_the_commit_named_and_leaves_no_manifest(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "chunks":
        monkeypatch.setattr(_LocalSink, "append_target", lambda self: None)
    async with cluster(tmp_path, 2) as running:
        one, two = running.workers
        for worker in running.workers:
            for number in range(PER_WORKER):
                worker.fake.start(f"w{worker.index}-{number}", _state(number))
        name = "_append_lines" if path == "appended" else "export_chunk"
        original = getattr(running.coordinator, name)
        cut: list[int] = []

        async def cut_in_its_lines(index: int, *args: Any) -> Any:
            if index == two.index and not cut:
                cut.append(index)
                await running.coordinator.workers[index].channel.close()  # the connection dies mid-stream
            return await original(index, *args)

        setattr(running.coordinator, name, cut_in_its_lines)
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        reply = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert cut == [two.index]
        assert reply.status_code == 503, reply.text
        assert error_code(reply) == "checkpoint_coordinator_unavailable"
        assert f"{KIND} worker {two.index}" in reply.json()["error"]["detail"]
        assert _manifests(tmp_path / "ck") == []
        assert two.lost == ["lost"]  # the worker took its coordinator as gone


async def test_a_worker_that_cannot_open_the_records_file_sends_its_lines_after_the_others_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = link_module.append_export
    refused: list[str] = []

    def the_second_cannot(records: list[dict[str, Any]], kind: str, owner: Any, skip: Any, target: Any) -> Any:
        if owner == ROUTING[1]:  # as a worker at its descriptor limit would
            refused.append(owner)
            return None
        return real(records, kind, owner, skip, target)

    monkeypatch.setattr(link_module, "append_export", the_second_cannot)
    async with cluster(tmp_path, 2, routing_ids=ROUTING) as running:
        chunks = _count_calls(running, "export_chunk")
        for worker in running.workers:
            for number in range(PER_WORKER):
                worker.fake.start(f"w{worker.index}-{number}", _state(number))
        one, two = running.workers
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        reply = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert reply.status_code == 200, reply.text
    assert refused == [ROUTING[1]]
    assert set(chunks) == {two.index}  # only the worker that could not append sent chunks
    manifest, data = _records_file(tmp_path / "ck")
    lines = data.splitlines()
    first = [line.split(b'"')[3].decode() for line in lines[:PER_WORKER]]
    last = [line.split(b'"')[3].decode() for line in lines[PER_WORKER:]]
    assert first == [f"w{one.index}-{number}" for number in range(PER_WORKER)]  # appended, then the chunks
    assert last == [f"w{two.index}-{number}" for number in range(PER_WORKER)]
    assert manifest.records_sha256 == hashlib.sha256(data).hexdigest()


def _appending_wrongly(how: str) -> Any:
    """A worker's append that writes other bytes than it names: one line more, or another id."""
    real = link_module.append_export

    def wrong(records: list[dict[str, Any]], kind: str, owner: Any, skip: Any, target: Any) -> Any:
        if how == "another_id":
            records = [{**records[0], "episode_id": "intruder"}, *records[1:]]
        appended = real(records, kind, owner, skip, target)
        if how == "a_line_more":
            with open(target, "ab") as file:
                file.write(b'{"episode_id":"intruder"}\n')
        return appended

    return wrong


@pytest.mark.parametrize("how", ["a_line_more", "another_id"])
async def test_a_worker_appending_other_lines_than_it_named_fails_the_commit_and_leaves_no_manifest(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "append_export", _appending_wrongly(how))
    async with cluster(tmp_path, 2) as running:
        one, _ = running.workers
        for worker in running.workers:
            for number in range(3):
                worker.fake.start(f"w{worker.index}-{number}", _state(number))
        assert (await one.call("prepare", request("c1"))).json()["phase"] == "prepared"
        reply = await one.call("commit", request("c1", checkpoint_dir=str(tmp_path / "ck")))
        assert reply.status_code >= 400, reply.text
        detail = reply.json()["error"]["detail"]
        if how == "a_line_more":
            # the workers appended at once: the stray line is theirs, not one worker's
            assert "workers 1 and 2 appended" in detail and "bytes, not the" in detail, detail
        else:
            # every worker wrote an intruder; the first in the file is named, with the worker that wrote it
            assert re.search(
                r"in the lines worker (\d) appended: the encoded record of 'w\1-0' .*'intruder'", detail
            ), detail
        assert _manifests(tmp_path / "ck") == []
        assert [entry.name for entry in (tmp_path / "ck").rglob("*") if entry.is_file()] == []


def _session_records(count: int) -> list[dict[str, Any]]:
    """A one-worker server's sessions (no owner), each about half a chunk."""
    return [{"episode_id": f"s{number}", "state": _state(number)} for number in range(count)]


def _write_sessions(checkpoint: Path, records: list[dict[str, Any]], kind: str = "resources") -> None:
    open_store(str(checkpoint)).write_participant(
        "", kind=kind, instance=INSTANCE, checkpoint_id="c0", records=records, extra={}
    )


def _same(left: Any, right: Any) -> bool:
    """Equal, NaN included (the states carry one)."""
    return repr(left) == repr(right)


async def test_a_restore_whose_shares_span_several_chunks_installs_exactly_the_records(tmp_path: Path) -> None:
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources") as running:
        chunks = _count_calls(running, "_send_chunk")
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["restored"] == sorted(f"{key}-a1" for key in keys)
        installed: dict[str, dict[str, Any]] = {}
        for worker, routing_id in zip(running.workers, ROUTING, strict=True):
            assert worker.fake.installed, "every worker installs a share"
            for record in worker.fake.installed:
                assert record["owner"] == routing_id  # placed on this worker
                installed[record["episode_id"]] = record
        assert sorted(installed) == sorted(f"{key}-a1" for key in keys)
        for record in records:
            assert _same(installed[f"{record['episode_id']}-a1"]["state"], record["state"])
        assert chunks.count(running.workers[0].index) > 1
        assert chunks.count(running.workers[1].index) > 1
        # the coordinator keeps none of the sessions' records
        assert running.coordinator.held == {}


async def test_a_session_kinds_restore_moves_lines_undecoded_through_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator neither decodes nor encodes a session's state: its worker decodes the line once."""
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)

    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError("the coordinator decoded or encoded a session record")

    monkeypatch.setattr(ScopeRecords, "__iter__", refuse)
    monkeypatch.setattr(scatter_module, "encoded", refuse)
    monkeypatch.setattr(scatter_module, "decode_line", refuse, raising=False)
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources") as running:
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 200, reply.text
        installed = {
            record["episode_id"]: (record, routing_id)
            for worker, routing_id in zip(running.workers, ROUTING, strict=True)
            for record in worker.fake.installed
        }
        assert sorted(installed) == sorted(f"{key}-a1" for key in keys)
        for record in records:
            restored, routing_id = installed[f"{record['episode_id']}-a1"]
            assert list(restored) == ["episode_id", "state", "owner"]
            assert restored["owner"] == routing_id
            assert _same(restored["state"], record["state"])


async def test_an_environments_restore_across_workers_holds_every_line_as_read_decoding_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every environment record is whole-episode: the coordinator holds the lines, rekeyed, and a claim decodes one."""
    records = _session_records(4)
    _write_sessions(tmp_path / "ck", records, kind=KIND)

    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError("the coordinator decoded or encoded a whole-episode record")

    monkeypatch.setattr(ScopeRecords, "__iter__", refuse)
    monkeypatch.setattr(scatter_module, "encoded", refuse)
    monkeypatch.setattr(scatter_module, "decode_line", refuse, raising=False)
    async with cluster(tmp_path, 2) as running:
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 200, reply.text
        held = running.coordinator.held
        assert sorted(held) == sorted(f"{key}-a1" for key in keys)
        for record in records:
            key = f"{record['episode_id']}-a1"
            assert held[key].line.endswith(b"\n") and held[key].line.count(b"\n") == 1
            assert _same(decode_line(held[key].line), {**record, "episode_id": key})
        assert all(worker.fake.installed == [] for worker in running.workers)
        assert (await running.workers[0].call("resume", request("r-1"))).status_code == 200
        claimed = await running.workers[1].link.claim("s2-a1")
        assert _same(claimed, {**records[2], "episode_id": "s2-a1"})


def test_a_kind_with_held_and_placed_records_is_surveyed_from_lines_as_from_decoded_records() -> None:
    """An agent's run records are held, its sessions placed: the lines' survey equals the records' survey."""
    records = [
        {"episode_id": "r1", "kind": "run", "state": _state(1)},
        {"episode_id": "s1", "kind": "session", "state": {"owner": "x"}},
        {"episode_id": "s2", "state": 2, "owner": ROUTING[0]},
        {"episode_id": "s3", "state": 3, "session_id": "sess"},
        {"episode_id": "r2", "kind": "run", "state": {"nan": float("nan")}, "owner": ROUTING[1]},
    ]
    rule = whole_episode_rule("agent")
    assert callable(rule)
    lines = [(f"{record['episode_id']}-a1", encode_record(record)[1][:-1]) for record in records]
    held, placed = survey_lines(lines, rule)
    want_held, want_placed = survey(
        ({**record, "episode_id": f"{record['episode_id']}-a1"} for record in records), rule
    )
    assert placed == want_placed
    assert [entry["episode_id"] for entry in placed] == ["s1-a1", "s2-a1", "s3-a1"]
    assert sorted(held) == sorted(want_held) == ["r1-a1", "r2-a1"]
    for key, record in held.items():
        assert record.episode_id == key
        assert _same(decode_line(record.line), decode_line(want_held[key].line))


def _installed_by_worker(running: Cluster) -> dict[str, tuple[dict[str, Any], str]]:
    return {
        record["episode_id"]: (record, routing_id)
        for worker, routing_id in zip(running.workers, ROUTING, strict=True)
        for record in worker.fake.installed
    }


async def test_workers_that_read_the_store_take_their_shares_from_the_file_and_no_chunk_moves(
    tmp_path: Path,
) -> None:
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources", reads_store=True) as running:
        chunks = _count_calls(running, "_send_chunk")
        shares = _count_calls(running, "_send_shares")
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 200, reply.text
        assert chunks == [] and len(shares) == 1
        installed = _installed_by_worker(running)
        assert sorted(installed) == sorted(f"{key}-a1" for key in keys)
        assert all(worker.fake.installed for worker in running.workers), "every worker installs a share"
        for record in records:
            restored, routing_id = installed[f"{record['episode_id']}-a1"]
            assert list(restored) == ["episode_id", "state", "owner"]
            assert restored["owner"] == routing_id
            assert _same(restored["state"], record["state"])
        assert running.coordinator.held == {}


async def test_shares_go_in_chunks_unless_every_worker_reads_the_store(tmp_path: Path) -> None:
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources", reads_store=[True, False]) as running:
        chunks = _count_calls(running, "_send_chunk")
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 200, reply.text
        assert chunks.count(running.workers[0].index) > 1 and chunks.count(running.workers[1].index) > 1
        assert sorted(_installed_by_worker(running)) == sorted(f"{key}-a1" for key in keys)


async def test_a_file_damaged_before_a_worker_reads_its_share_fails_the_restore_typed_with_nothing_installed(
    tmp_path: Path,
) -> None:
    """Each worker checks its lines against the CRC-32 the coordinator's verified read took of them: a line
    changed after that read fails the restore."""
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    manifest, data = _records_file(tmp_path / "ck", kind="resources")
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources", reads_store=True) as running:
        original = running.coordinator._send_shares

        async def damage_first(*args: Any) -> None:
            (tmp_path / "ck" / manifest.records_path).write_bytes(data[:-5] + b"X" + data[-4:])
            await original(*args)

        running.coordinator._send_shares = damage_first  # type: ignore[method-assign]
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 422, reply.text
        assert error_code(reply) == "invalid_checkpoint_state"
        detail = reply.json()["error"]["detail"]
        assert "did not complete install_share" in detail and "changed since the file was verified" in detail
        assert all(worker.fake.installed == [] for worker in running.workers)
        assert all(worker.link._staging.records == {} for worker in running.workers)


def test_a_share_read_from_the_file_is_what_the_chunks_would_carry() -> None:
    """:func:`read_share` gives each record as the worker decodes the line :func:`scatter_lines` sends."""
    records = [
        {"episode_id": "k1", "state": _state(1)},
        {"episode_id": "k2", "state": 2, "owner": ROUTING[0]},
        {"episode_id": "k3", "state": 3, "session_id": "sess"},
        {"episode_id": "k4", "state": {"owner": "x"}, "owner": None},
    ]
    next_keys = {record["episode_id"]: f"{record['episode_id']}-a1" for record in records}
    stored = [(record["episode_id"], encode_record(record)[1][:-1]) for record in records]
    _, placed = survey_lines([(next_keys[stored_id], line) for stored_id, line in stored])
    plan = plan_scatter(placed, {1: ROUTING[0], 2: ROUTING[1]}, {})
    sent: dict[int, list[list[Any]]] = {}
    rekeyed = [(next_keys[stored_id], rekeyed_line(line, next_keys[stored_id])) for stored_id, line in stored]
    scatter_lines(rekeyed, plan, lambda index, chunk: sent.setdefault(index, []).extend(chunk))
    spans, offset = {}, 0
    for stored_id, line in stored:
        spans[stored_id] = (offset, len(line) + 1, zlib.crc32(line))
        offset += len(line) + 1
    shares = share_lists(plan, next_keys, spans)
    assert sorted(shares) == sorted(plan.counts)
    for share in shares.values():
        assert [tuple(entry[4:]) for entry in share] == sorted(spans[entry[0]] for entry in share)
    for index, share in shares.items():
        got = read_share(stored, share)
        want = {position: decode_line(line.encode("utf-8")) for position, line in sent[index]}
        assert sorted(got) == sorted(want) == list(range(plan.counts[index]))
        for position, record in got.items():
            assert list(record) == list(want[position])
            assert _same(record, want[position])
    with pytest.raises(InvalidCheckpointState, match="gave 0 of the"):
        read_share(stored[:0], shares[1])


async def test_a_damaged_records_file_fails_a_lines_restore_typed_with_nothing_installed(tmp_path: Path) -> None:
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    manifest, data = _records_file(tmp_path / "ck", kind="resources")
    (tmp_path / "ck" / manifest.records_path).write_bytes(data[:-5] + b"X" + data[-4:])
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources") as running:
        keys = [record["episode_id"] for record in records]
        reply = await running.workers[0].call(
            "restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys)
        )
        assert reply.status_code == 422, reply.text
        assert error_code(reply) == "invalid_checkpoint_state"
        assert "hashes to" in reply.json()["error"]["detail"]
        assert all(worker.fake.installed == [] for worker in running.workers)


async def test_a_worker_lost_in_the_middle_of_its_share_fails_the_restore_named_with_nothing_installed(
    tmp_path: Path,
) -> None:
    records = _session_records(2 * PER_WORKER)
    _write_sessions(tmp_path / "ck", records)
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources") as running:
        one, two = running.workers
        original = running.coordinator._send_chunk
        sent: list[int] = []

        async def cut_before_the_second_chunk(index: int, stream: int, chunk: list[list[Any]]) -> None:
            sent.append(index)
            if index == two.index and sent.count(index) == 2:
                await running.coordinator.workers[index].channel.close()  # the connection dies mid-stream
            await original(index, stream, chunk)

        running.coordinator._send_chunk = cut_before_the_second_chunk  # type: ignore[method-assign]
        keys = [record["episode_id"] for record in records]
        reply = await one.call("restore", request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=keys))
        assert reply.status_code == 503, reply.text
        assert error_code(reply) == "checkpoint_coordinator_unavailable"
        assert f"resources worker {two.index}" in reply.json()["error"]["detail"]
        assert one.fake.installed == []
        assert two.fake.installed == []
        assert one.link._staging.records == {}  # the failed restore reopened admission: its chunks are dropped
        # the worker that lost its coordinator mid-stream dropped its stream too: the collector runs again
        await until(lambda: two.link._staging.stream is None, message="the lost worker kept its install stream")
        assert gc_pause._GC_PAUSE.pauses == 0 and gc.isenabled()


def test_an_install_stream_gives_its_records_in_share_order_and_refuses_a_short_one() -> None:
    staging = InstallStaging()
    staging.take({"stream": 3, "records": [[1, '{"episode_id":"b","n":2}\n'], [0, '{"episode_id": "a", "n": NaN}\n']]})
    records = staging.finish(3, 2)
    assert [record["episode_id"] for record in records] == ["a", "b"]
    staging.take({"stream": 4, "records": [[0, '{"episode_id":"a"}\n']]})
    staging.take({"stream": 5, "records": [[1, '{"episode_id":"b"}\n']]})  # a new stream drops the unfinished one
    try:
        staging.finish(5, 2)
    except Exception as exc:
        assert getattr(exc, "code", None) == "invalid_checkpoint_state"
    else:
        raise AssertionError("a stream missing a record was installed")
    assert staging.finish(6, 0) == []


async def test_lines_asked_for_after_the_write_ended_are_refused(tmp_path: Path) -> None:
    async with cluster(tmp_path, 2) as running:
        refused = await asyncio.gather(
            running.coordinator.export_chunk(running.workers[0].index, {"stream": 99, "records": []}),
            return_exceptions=True,
        )
        assert getattr(refused[0], "code", None) == "invalid_phase"


async def test_a_workers_commit_and_restore_log_lines_carry_the_planes_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write_sessions(tmp_path / "ck", _session_records(2))
    async with cluster(tmp_path, 2, routing_ids=ROUTING, kind="resources") as running:
        with caplog.at_level(logging.INFO, logger="gymckpt.telemetry"):
            body = request("r-1", checkpoint_dir=str(tmp_path / "ck"), episode_ids=["s0", "s1"])
            assert (await running.workers[0].call("restore", body)).status_code == 200
            assert (await running.workers[1].call("resume", request("r-1"))).status_code == 200
            assert (await running.workers[1].call("prepare", request("c2"))).json()["phase"] == "prepared"
            reply = await running.workers[0].call("commit", request("c2", checkpoint_dir=str(tmp_path / "ck2")))
            assert reply.status_code == 200, reply.text
    lines = {record.getMessage().split(" ", 1)[0]: record.getMessage() for record in caplog.records}
    assert re.search(r"read=\d+\.\d+s install=\d+\.\d+s", lines["restore"]), lines["restore"]
    assert re.search(r"export=\d+\.\d+s write=\d+\.\d+s", lines["commit"]), lines["commit"]


_OWNER, _OTHER = "a" * 32, "b" * 32


@pytest.mark.parametrize(
    "record",
    [
        {"episode_id": "k", "state": {"x": 'he said "owner"', "y": "session_id"}},
        {"episode_id": "k", "state": 1, "owner": _OWNER},
        {"episode_id": "k", "session_id": "s1", "state": 1},
        {"episode_id": "k", "session_id": "k", "state": 1},
        {"episode_id": "k", "owner": None, "state": 1},
        {"episode_id": "k", "state": {"owner": _OWNER}, "owner": _OWNER},
        {"episode_id": "k", "state": {"nan": float("nan"), "big": 2**70}, "owner": _OWNER},
        {"episode_id": "k", "state": ['"q"'] * 400 + ["owner"]},
    ],
)
@pytest.mark.parametrize("stamp", [None, _OTHER])
def test_undecoded_lines_are_placed_and_stamped_as_their_decoded_records_are(
    record: dict[str, Any], stamp: str | None
) -> None:
    line = encode_record(record)[1][:-1]
    restored = {**record, "episode_id": "k-a1"}
    held, [fields] = survey_lines([("k-a1", line)])
    assert held == {}
    assert fields == with_session_id(
        {name: restored[name] for name in ("episode_id", "owner", "session_id") if name in restored}
    )
    got = decode_line(_prepared_line("k-a1", rekeyed_line(line, "k-a1"), stamp))
    want = decode_line(encode_record(_prepared(restored, stamp))[1])
    assert list(got) == list(want)
    assert repr(got) == repr(want)


def test_an_export_chunks_lines_travel_as_bytes_one_per_named_record() -> None:
    records = [{"episode_id": f"k{number}", "state": _state(number)} for number in range(3)]
    ids, lines, after = encode_export_chunk(records, 0, "resources", ROUTING[0], limit=CHUNK_BYTES * 4)
    assert after == 3 and ids == ["k0", "k1", "k2"]
    run = exported_run(ids, lines, "worker 1")
    assert run.episode_ids == ids
    for record, (episode_id, line) in zip(records, check_run(run), strict=True):
        assert episode_id == record["episode_id"]
        assert _same(decode_line(line), {**record, "owner": ROUTING[0]})
    with pytest.raises(InvalidRecord, match="record of 'k0' starts with episode_id 'k1'"):
        check_run(exported_run(ids, lines.split(b"\n", 1)[1], "worker 1"))  # the writer's look
    with pytest.raises(InvalidCheckpointState, match="3 records whose lines do not end with a newline"):
        exported_run(ids, lines[:-1], "worker 1")
    with pytest.raises(InvalidCheckpointState, match="0 records whose lines"):
        exported_run([], lines, "worker 1")
    with pytest.raises(InvalidCheckpointState, match="without its episode ids and their lines"):
        exported_run(ids, lines.decode(), "worker 1")
    with pytest.raises(InvalidCheckpointState, match="not all strings"):
        exported_run([*ids[:2], 3], lines, "worker 1")


def test_encoding_an_export_chunk_holds_about_the_chunk_not_a_buffer_per_line() -> None:
    records = [{"episode_id": f"k{number:05d}", "state": {"count": number}} for number in range(2000)]
    tracemalloc.start()
    try:
        ids, lines, after = encode_export_chunk(records, 0, "resources", ROUTING[0], limit=CHUNK_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after == 2000 and len(ids) == 2000 and lines.count(b"\n") == 2000
    # each line orjson writes keeps a 4 KiB buffer while it lives: 8 MB if the chunk's lines were kept apart
    assert peak < 4 * len(lines) + 200 * len(ids), (peak, len(lines))


def test_a_worker_that_cannot_open_the_records_file_says_why_and_appends_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = [{"episode_id": f"k{number}", "state": _state(number)} for number in range(3)]
    gone = f"/proc/{os.getpid()}/fd/999999"
    with caplog.at_level(logging.INFO, logger="gymckpt.workers.streams"):
        assert append_export(records, "resources", ROUTING[0], frozenset(), gone) is None
    assert f"cannot open {gone} to append its records" in caplog.text and "they go in chunks" in caplog.text
    with pytest.raises(InvalidRequest, match="not to '/tmp/elsewhere'"):
        append_export(records, "resources", ROUTING[0], frozenset(), "/tmp/elsewhere")
