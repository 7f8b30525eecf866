"""Spans and metrics of a checkpoint cycle, in one process: two participants served over HTTP
(uvicorn in the test's loop) and a Coordinator, recorded by an in-memory exporter and reader."""

from __future__ import annotations

import asyncio
import re
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gymckpt import telemetry
from gymckpt.control.coordination import Coordinator
from gymckpt.control.settings import load_settings
from gymckpt.errors import CoordinationError
from gymckpt.participants.install import install_checkpointing
from gymckpt.testing.net import serve_in_loop
from gymckpt.testing.participant import FakeParticipant

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

TOKEN = "telemetry-token"
PARTICIPANTS = [("environment", "env-0"), ("resources", "tools-0")]


@pytest.fixture
def recorded() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    telemetry.bind(tracer_provider, MeterProvider(metric_readers=[reader]))
    try:
        yield spans, reader
    finally:
        telemetry.bind()


def app_of(participant: FakeParticipant, root: Path) -> FastAPI:
    app = FastAPI()
    settings = load_settings(
        {"checkpoint": {"enabled": True, "control_auth_token": TOKEN, "allowed_roots": [str(root)]}}
    )
    install_checkpointing(app, participant, settings)
    return app


async def serve_fakes(stack: AsyncExitStack, root: Path) -> tuple[list[FakeParticipant], list[str]]:
    participants = [FakeParticipant(kind, instance) for kind, instance in PARTICIPANTS]
    urls = [await stack.enter_async_context(serve_in_loop(app_of(fake, root))) for fake in participants]
    return participants, urls


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def parent_of(span: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    assert span.parent is not None, span.name
    (parent,) = [other for other in spans if other.context.span_id == span.parent.span_id]
    return parent


def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def test_a_checkpoint_cycle_gives_the_span_tree_its_attributes_and_metrics(
    recorded: tuple[InMemorySpanExporter, InMemoryMetricReader], tmp_path: Path
) -> None:
    exporter, reader = recorded
    directory = str(tmp_path / "ck")

    async def main() -> None:
        async with AsyncExitStack() as stack:
            fakes, urls = await serve_fakes(stack, tmp_path)
            for fake in fakes:
                fake.start("r-1", {"step": 3})
                fake.start("r-2", {"step": 1})
            gym = await stack.enter_async_context(Coordinator(urls, token=TOKEN))
            assert (await gym.discover(require_model=False)).ok
            deadline = time.time() + 60
            assert (await gym.prepare("c1", deadline)).prepared
            commits = await gym.commit("c1", deadline, directory, ["r-1", "r-2"])
            await gym.publish(directory, commits)
            await gym.resume("c1", deadline)
            with pytest.raises(CoordinationError):  # a late call of the resumed checkpoint: refused everywhere
                await gym.prepare("c1", deadline)
        async with AsyncExitStack() as stack:  # fresh processes: the restore
            _, urls = await serve_fakes(stack, tmp_path)
            gym = await stack.enter_async_context(Coordinator(urls, token=TOKEN))
            assert (await gym.discover(require_model=False)).ok
            await gym.restore("c1", time.time() + 60, directory, ["r-1"])
            await gym.resume("c1", time.time() + 60)

    asyncio.run(main())
    spans = exporter.get_finished_spans()

    # coordination → stage → CLIENT call → SERVER operation → its steps, one trace per coordination call
    for prepare in by_name(spans, "gym.checkpoint.prepare")[:2]:
        assert prepare.kind is SpanKind.SERVER
        call = parent_of(prepare, spans)
        assert (call.name, call.kind) == ("gym.checkpoint.coordinate.prepare.call", SpanKind.CLIENT)
        stage = parent_of(call, spans)
        assert stage.name == f"gym.checkpoint.coordinate.prepare.{prepare.attributes[telemetry.KIND]}"
        top = parent_of(stage, spans)
        assert top.name == "gym.checkpoint.coordinate.prepare"
        assert prepare.context.trace_id == top.context.trace_id
        assert top.attributes[telemetry.KIND] == "controller" and top.attributes[telemetry.CHECKPOINT_ID] == "c1"
        (wait,) = [span for span in spans if span.parent is not None and span.parent.span_id == prepare.context.span_id]
        assert wait.name == "gym.checkpoint.wait_ready"
    commits = by_name(spans, "gym.checkpoint.commit")
    assert sorted((span.attributes[telemetry.KIND], span.attributes[telemetry.INSTANCE]) for span in commits) == sorted(
        PARTICIPANTS
    )
    for commit in commits:
        assert commit.attributes[telemetry.CHECKPOINT_ID] == "c1"
        assert commit.attributes[telemetry.RECORDS] == 2 and commit.attributes[telemetry.BYTES] > 0
        children = {span.name: span for span in spans if span.parent and span.parent.span_id == commit.context.span_id}
        assert set(children) == {"gym.checkpoint.export", "gym.checkpoint.write"}
        assert children["gym.checkpoint.export"].attributes[telemetry.RECORDS] == 2
        assert children["gym.checkpoint.write"].attributes[telemetry.BYTES] == commit.attributes[telemetry.BYTES]
    top_commit = by_name(spans, "gym.checkpoint.coordinate.commit")[0]
    assert top_commit.attributes[telemetry.RECORDS] == 4 and top_commit.attributes[telemetry.EPISODES] == 2
    for restore in by_name(spans, "gym.checkpoint.restore"):
        assert restore.attributes[telemetry.RECORDS] == 1
        children = [span.name for span in spans if span.parent and span.parent.span_id == restore.context.span_id]
        assert sorted(children) == ["gym.checkpoint.install", "gym.checkpoint.read"]
    # the refused prepare (the first stage refuses; the coordinator stops there): an ERROR span, a refused event
    refused = [span for span in by_name(spans, "gym.checkpoint.prepare") if span.events]
    assert [span.attributes[telemetry.KIND] for span in refused] == ["environment"]
    for span in refused:
        assert not span.status.is_ok
        (event,) = [event for event in span.events if event.name == "refused"]
        assert event.attributes[telemetry.CODE] == "stale_checkpoint"

    durations = {
        (
            point.attributes[telemetry.OPERATION],
            point.attributes[telemetry.KIND],
            point.attributes["outcome"],
        ): point.count
        for point in points(reader, "gym.checkpoint.operation.duration")
    }
    assert durations[("coordinate.prepare", "controller", "ok")] == 1
    assert durations[("coordinate.prepare", "controller", "error")] == 1
    assert durations[("commit", "environment", "ok")] == 1 and durations[("commit", "resources", "ok")] == 1
    assert durations[("prepare", "environment", "error")] == 1 and ("prepare", "resources", "error") not in durations
    written = {
        (point.attributes[telemetry.OPERATION], point.attributes[telemetry.KIND]): point.value
        for point in points(reader, "gym.checkpoint.records")
    }
    assert written == {
        ("commit", "environment"): 2,
        ("commit", "resources"): 2,
        ("restore", "environment"): 1,
        ("restore", "resources"): 1,
    }
    refusals = [
        point for point in points(reader, "gym.checkpoint.events") if point.attributes[telemetry.EVENT] == "refused"
    ]
    assert [(point.attributes[telemetry.CODE], point.value) for point in refusals] == [("stale_checkpoint", 1)]


def all_attribute_values(spans: tuple[ReadableSpan, ...], reader: InMemoryMetricReader) -> list[str]:
    """Every attribute value of every span, span event and metric point, as text."""
    values = [str(value) for span in spans for value in (span.attributes or {}).values()]
    values += [str(value) for span in spans for event in span.events for value in (event.attributes or {}).values()]
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                values += [str(value) for point in metric.data.data_points for value in point.attributes.values()]
    return values


def test_a_commit_to_s3_logs_an_info_line_and_neither_the_token_nor_the_s3_secret_appears(
    recorded: tuple[InMemorySpanExporter, InMemoryMetricReader],
    moto_endpoint: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter, reader = recorded
    secret = "s3-secret-7d1f0c2b9e"
    moto_endpoint.create_bucket("telemetry")
    options = moto_endpoint.storage_options(secret=secret)
    settings = load_settings(
        {
            "checkpoint": {
                "enabled": True,
                "control_auth_token": TOKEN,
                "allowed_roots": ["s3://telemetry"],
                "storage_options": options,
            }
        }
    )
    participant = FakeParticipant("environment", "env-0")
    participant.start("r-1", {"step": 2})
    app = FastAPI()
    install_checkpointing(app, participant, settings)

    async def main() -> None:
        async with serve_in_loop(app) as url, Coordinator([url], token=TOKEN, storage_options=options) as gym:
            assert (await gym.discover(require_model=False)).ok
            deadline = time.time() + 60
            assert (await gym.prepare("s3-1", deadline)).prepared
            commits = await gym.commit("s3-1", deadline, "s3://telemetry/s3-1", ["r-1"])
            await gym.publish("s3://telemetry/s3-1", commits)
            await gym.resume("s3-1", deadline)

    with caplog.at_level("INFO", logger="gymckpt"):
        asyncio.run(main())
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("commit s3-1 environment/env-0: ok in ") and "records=1" in line for line in lines), (
        lines
    )
    assert any(line.startswith("coordinate.commit s3-1 controller/coordination: ok") for line in lines), lines
    (commit_line,) = [line for line in lines if line.startswith("commit s3-1 environment/env-0: ")]
    # the line names its steps' seconds: where a slow commit spent them
    assert re.search(r"\(records=1 bytes=\d+ .*export=\d+\.\d{3}s write=\d+\.\d{3}s", commit_line), commit_line
    text = "\n".join(lines) + "\n".join(caplog.text.splitlines())
    recorded_values = all_attribute_values(exporter.get_finished_spans(), reader)
    assert recorded_values, "nothing was recorded"
    for forbidden in (secret, TOKEN):
        assert forbidden not in text
        assert not any(forbidden in value for value in recorded_values)


def test_a_lease_that_expires_is_a_span_an_event_and_a_count(
    recorded: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    from gymckpt.control.models import ControlRequest
    from gymckpt.control.plane import ControlPlane

    exporter, reader = recorded
    now = [1000.0]
    participant = FakeParticipant("agent", "agent-0")
    plane = ControlPlane(participant, clock=lambda: now[0], lease_grace_seconds=1.0)

    async def main() -> None:
        await plane.prepare(ControlRequest(checkpoint_id="lease-1", deadline_ts=now[0] + 5))
        now[0] += 100  # past the deadline and its grace: the controller is gone
        assert await plane.expire_lease()
        await plane.close()

    asyncio.run(main())
    (span,) = by_name(exporter.get_finished_spans(), "gym.checkpoint.lease_expired")
    assert span.attributes[telemetry.CHECKPOINT_ID] == "lease-1" and span.attributes[telemetry.KIND] == "agent"
    assert [event.name for event in span.events] == ["lease_expired"]
    assert participant.admission_open  # it resumed by itself
    expired = [
        point
        for point in points(reader, "gym.checkpoint.events")
        if point.attributes[telemetry.EVENT] == "lease_expired"
    ]
    assert [point.value for point in expired] == [1]


def test_an_operations_line_sums_the_seconds_of_its_steps_by_name_and_leaves_dotted_ones_out(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the operation begins at 0; read 0 → 0.25, install 0.25 → 0.75, read 1.0 → 1.125, a dotted step
    # begins at 1.25 (its end is not read); the operation ends at 2.0
    clock = iter([0.0, 0.0, 0.25, 0.25, 0.75, 1.0, 1.125, 1.25, 2.0])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    with (
        caplog.at_level("INFO", logger="gymckpt.telemetry"),
        telemetry.operation("restore", kind="environment", instance="env-0", checkpoint_id="c9") as op,
    ):
        for name in ("read", "install", "read", "coordinate.restore.call"):
            with telemetry.step(name):
                pass
        op.set(records=4)
    monkeypatch.undo()
    (line,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("restore c9")]
    assert line == "restore c9 environment/env-0: ok in 2.000 s (records=4 read=0.375s install=0.500s)"
