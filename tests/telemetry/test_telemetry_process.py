"""Telemetry of the reference stack as real processes: one trace per checkpoint cycle, OTLP export, logs.

One stack per module (real ``gymckpt serve`` processes, :class:`~gymckpt.stack.harness.RolloutHarness`),
started with the standard ``OTEL_*`` variables pointing at :class:`OtlpReceiver`: an OTLP/HTTP
(protobuf) collector on 127.0.0.1, in a thread of its own, that keeps every span and metric
data point it is sent. The servers inherit the variables from this process's environment
(the supervisor passes ``os.environ`` on), set for the module only. Before each test every
Gym server is killed and started again, and the receiver forgets what it got, so each test
sees only its own processes' telemetry (cumulative counters start from zero).

In this process the Coordinator records through an SDK tracer provider with an in-memory
exporter and an in-memory metric reader (:func:`gymckpt.telemetry.bind`, undone after each test).

Rollouts are caught in flight without sleeps: generations are slow (:data:`TOKEN_DELAY`) and
the test polls the inference backend's call log, each poll awaiting its HTTP round trip.
Waiting for exported telemetry blocks on the receiver's condition, woken by each export
request, bounded in time (:data:`WAIT`) and in wake-ups (:data:`MAX_WAKEUPS`).
"""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gymckpt import telemetry
from gymckpt.errors import CoordinationError
from gymckpt.stack.harness import RolloutHarness, default_stack_spec, task_for
from tests.support import REPO

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterable, Iterator
    from pathlib import Path

    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Tracer

    from gymckpt.control.coordination import Coordinator, ParticipantCommit

#: the control token: a recognisable secret that must appear in no log, span or metric
TOKEN = "sekrit-telemetry-token-5f1c9e2a"
#: the bound of any single wait (seconds)
WAIT = 60.0
#: the bound of one whole scenario on the test's loop (seconds)
SCENARIO = 180.0
#: the most wake-ups (export requests, polls) one wait handles before it gives up
MAX_WAKEUPS = 100_000
#: seconds between generated tokens: a model call (8 tokens) takes ~0.16 s
TOKEN_DELAY = 0.02
#: rollouts started for each checkpoint cycle
ROLLOUTS = 6
#: the participant kinds of the reference stack
PARTICIPANT_KINDS = ("environment", "model", "agent", "resources")
#: the server operations of one cycle
CYCLE_OPERATIONS = ("prepare", "commit", "resume")
#: the timestamp ``telemetry.setup_logging`` puts first on each line (logging's asctime)
STAMP = r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}"

T = TypeVar("T")


# ----------------------------------------------------------------------------- the OTLP receiver


def decode_value(value: AnyValue) -> Any:
    """A protobuf ``AnyValue`` as a Python value (arrays as tuples, key-value lists as dicts)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(decode_value(item) for item in value.array_value.values)
    if which == "kvlist_value":
        return decode_attributes(value.kvlist_value.values)
    return getattr(value, which)


def decode_attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {pair.key: decode_value(pair.value) for pair in pairs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span an OTLP export carried."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    service: str


@dataclass(frozen=True)
class ReceivedPoint:
    """One metric data point an OTLP export carried (a histogram's value is its sum, ``count`` its count)."""

    metric: str
    service: str
    attributes: dict[str, Any]
    value: float
    count: int
    time_unix_nano: int


@dataclass
class Received:
    """Everything the receiver got: decoded spans and points, and each request's raw body."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    points: list[ReceivedPoint] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def copy(self) -> Received:
        return Received(list(self.spans), list(self.points), list(self.bodies))


class OtlpReceiver:
    """An OTLP/HTTP protobuf collector (``POST /v1/traces``, ``/v1/metrics``) on 127.0.0.1, in its own thread."""

    def __init__(self) -> None:
        self.url = ""
        self._received = Received()
        self._changed = threading.Condition()
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._main, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not self._started.wait(WAIT):
            raise AssertionError(f"the OTLP receiver did not start within {WAIT} s")
        if self._failure is not None:
            raise self._failure
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(WAIT)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self._failure = exc
            self._started.set()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._started.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        body = await request.read()
        return gzip.decompress(body) if request.headers.get("Content-Encoding") == "gzip" else body

    async def _traces(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        spans = []
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            service = str(decode_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                spans.extend(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes=decode_attributes(span.attributes),
                        events=[(event.name, decode_attributes(event.attributes)) for event in span.events],
                        service=service,
                    )
                    for span in scope_spans.spans
                )
        with self._changed:
            self._received.spans.extend(spans)
            self._received.bodies.append(body)
            self._changed.notify_all()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        points = []
        for resource_metrics in ExportMetricsServiceRequest.FromString(body).resource_metrics:
            service = str(decode_attributes(resource_metrics.resource.attributes).get("service.name"))
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    data_field = metric.WhichOneof("data")
                    for point in getattr(metric, data_field).data_points:
                        if data_field in ("sum", "gauge"):
                            value, count = getattr(point, point.WhichOneof("value") or "as_int"), 1
                        else:
                            value, count = point.sum, point.count
                        points.append(
                            ReceivedPoint(
                                metric.name,
                                service,
                                decode_attributes(point.attributes),
                                value,
                                count,
                                point.time_unix_nano,
                            )
                        )
        with self._changed:
            self._received.points.extend(points)
            self._received.bodies.append(body)
            self._changed.notify_all()
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def clear(self) -> None:
        with self._changed:
            self._received = Received()

    def snapshot(self) -> Received:
        with self._changed:
            return self._received.copy()

    def wait_for(self, found: Callable[[Received], T | None], what: str) -> T:
        """Block until ``found(received)`` is not None (re-checked on each export), at most :data:`WAIT` s."""
        deadline = time.monotonic() + WAIT
        with self._changed:
            for _ in range(MAX_WAKEUPS):
                value = found(self._received.copy())
                if value is not None:
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            got = sorted({(span.service, span.name) for span in self._received.spans})
        raise AssertionError(f"the receiver never got {what} within {WAIT} s; spans it got: {got}")


# ----------------------------------------------------------------------------- the module's stack


@dataclass(frozen=True)
class Participant:
    """One Gym server as a checkpoint participant."""

    kind: str
    instance: str
    name: str
    server_kind: str
    url: str

    @property
    def service(self) -> str:
        """The ``service.name`` its telemetry carries (``gymckpt serve`` configures ``gymckpt-<server kind>``)."""
        return f"gymckpt-{self.server_kind}"


@dataclass
class TelemetryStack:
    """The module's stack, its loop, the receiver, and the checkpoints' allowed root."""

    runner: asyncio.Runner
    harness: RolloutHarness
    receiver: OtlpReceiver
    root: Path
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def run(self, scenario: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(asyncio.wait_for(scenario, SCENARIO))

    async def ready(self) -> None:
        """Wait (bounded) until every server answers; the discovered coordinator is closed."""
        gym = await self.harness.wait_ready(timeout=WAIT)
        await gym.close()

    def fresh(self) -> None:
        """SIGKILL every Gym server, forget what the receiver got, start them again, wait until they answer."""
        self.harness.crash()
        self.receiver.clear()
        self.harness.restart()
        self.run(self.ready())
        self.run(self.harness.reset_model_calls())

    def end_test(self) -> None:
        tasks, self.tasks = self.tasks, []

        async def cancel() -> None:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TelemetryStack]:
    """The reference stack, its servers exporting to an :class:`OtlpReceiver`; everything killed after."""
    workdir = tmp_path_factory.mktemp("telemetry-stack")
    root = workdir / "checkpoints"
    root.mkdir()
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("OTEL_")]:
            patch.delenv(name)
        patch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        patch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        patch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        patch.setenv(telemetry.LOG_LEVEL_ENV, "info")
        runner = asyncio.Runner()
        harness: RolloutHarness | None = None
        try:
            spec = default_stack_spec(token=TOKEN, token_delay_seconds=TOKEN_DELAY, allowed_roots=[str(root)])
            harness = RolloutHarness.start(spec, workdir=workdir)
            running = TelemetryStack(runner, harness, receiver, root)
            try:
                running.run(running.ready())
            except BaseException as exc:
                raise AssertionError(f"the stack did not come up: {exc}{harness.log_tails()}") from exc
            yield running
        finally:
            if harness is not None:
                runner.run(harness.close())
            runner.close()


@dataclass
class Recorded:
    """What this process's Coordinator recorded, in memory."""

    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer: Tracer


@pytest.fixture
def fresh_stack(stack: TelemetryStack) -> Iterator[tuple[TelemetryStack, Recorded]]:
    """Fresh Gym processes, an empty receiver, and gymckpt.telemetry bound to in-memory providers."""
    stack.fresh()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry.bind(tracer_provider, meter_provider)
    try:
        yield stack, Recorded(spans, reader, tracer_provider.get_tracer("tests.telemetry"))
    finally:
        telemetry.bind()
        stack.end_test()
        tracer_provider.shutdown()
        meter_provider.shutdown()


# ----------------------------------------------------------------------------- one checkpoint cycle


@dataclass
class Cycle:
    """One checkpoint cycle with rollouts in flight: prepare, commit, publish, resume (and a refused prepare)."""

    checkpoint_id: str
    #: participants by participant kind
    participants: dict[str, Participant]
    #: commit replies by participant kind
    commits: dict[str, ParticipantCommit]
    refusal: CoordinationError | None


def participants_of(gym: Coordinator, harness: RolloutHarness) -> dict[str, Participant]:
    names = {url: name for name, url in harness.urls.items()}
    found = {}
    for url, info in gym.kinds.items():
        name = names[url]
        found[info.kind] = Participant(info.kind, info.instance, name, harness.stack.servers[name].kind, url)
    assert sorted(found) == sorted(PARTICIPANT_KINDS), found
    return found


async def wait_until_in_flight(harness: RolloutHarness, runs: dict[str, asyncio.Task[dict[str, Any]]]) -> None:
    """Until the backend completed a model call of some rollout while some are unfinished (bounded)."""
    deadline = time.monotonic() + WAIT
    for _ in range(MAX_WAKEUPS):
        log = await harness.model_calls()  # each poll awaits its HTTP round trip
        called = {str(call["call_id"]).rsplit(":", 1)[0] for call in log} & set(runs)
        if all(run.done() for run in runs.values()):
            raise AssertionError(f"every rollout ended before one was caught in flight: {runs}")
        if called:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no model call of {sorted(runs)} completed within {WAIT} s")


async def checkpoint_cycle(stack: TelemetryStack, tracer: Tracer, tag: str, *, refuse_after: bool = False) -> Cycle:
    """Checkpoint rollouts in flight under one span ``test.cycle``; the rollouts then run to their end."""
    checkpoint_id = f"ckpt-{tag}"
    directory = stack.root / checkpoint_id
    runs = {
        f"{tag}-{index}": asyncio.create_task(stack.harness.run(f"{tag}-{index}", task_for(index)))
        for index in range(ROLLOUTS)
    }
    stack.tasks.extend(runs.values())
    await wait_until_in_flight(stack.harness, runs)
    gym = stack.harness.coordinator(probe_timeout=WAIT)
    refusal = None
    try:
        with tracer.start_as_current_span("test.cycle"):
            found = await gym.discover()
            assert found.ok, found.problems
            deadline = time.time() + WAIT
            prepared = await gym.prepare(checkpoint_id, deadline)
            assert prepared.prepared, prepared.blockers()
            scope = prepared.continued([key for key, run in runs.items() if not run.done()])
            assert scope, "every rollout ended before the commit: nothing in flight to checkpoint"
            commits = await gym.commit(checkpoint_id, deadline, str(directory), scope)
            await gym.publish(str(directory), commits)
            await gym.resume(checkpoint_id, deadline)
            if refuse_after:
                with pytest.raises(CoordinationError) as refused:
                    await gym.prepare(checkpoint_id, time.time() + WAIT)  # a resumed id is stale
                refusal = refused.value
        participants = participants_of(gym, stack.harness)
    finally:
        await gym.close()
    bodies = await asyncio.wait_for(asyncio.gather(*runs.values()), WAIT)
    for key, body in zip(runs, bodies, strict=True):
        assert body["status"] == 200 and "result" in body, (key, body)
    by_kind = {reply.kind: reply for reply in commits.values()}
    assert sorted(by_kind) == sorted(PARTICIPANT_KINDS), by_kind
    return Cycle(checkpoint_id, participants, by_kind, refusal)


# ----------------------------------------------------------------------------- spans and points


def hex_span(span_id: int) -> str:
    return f"{span_id:016x}"


def hex_trace(trace_id: int) -> str:
    return f"{trace_id:032x}"


def server_spans(received: Received, cycle: Cycle, operation: str) -> dict[str, list[ReceivedSpan]]:
    """The SERVER spans ``gym.checkpoint.<operation>`` of the cycle's checkpoint, by participant kind."""
    found: dict[str, list[ReceivedSpan]] = {}
    for span in received.spans:
        if (
            span.name == f"gym.checkpoint.{operation}"
            and span.kind == ProtoSpan.SPAN_KIND_SERVER
            and span.attributes.get(telemetry.CHECKPOINT_ID) == cycle.checkpoint_id
        ):
            found.setdefault(str(span.attributes.get(telemetry.KIND)), []).append(span)
    return found


def every_server_span(cycle: Cycle) -> Callable[[Received], dict[str, dict[str, ReceivedSpan]] | None]:
    """A :meth:`OtlpReceiver.wait_for` condition: one span of each cycle operation from each participant."""

    def found(received: Received) -> dict[str, dict[str, ReceivedSpan]] | None:
        spans = {operation: server_spans(received, cycle, operation) for operation in CYCLE_OPERATIONS}
        if any(set(spans[operation]) != set(PARTICIPANT_KINDS) for operation in CYCLE_OPERATIONS):
            return None
        for operation, by_kind in spans.items():
            for kind, listed in by_kind.items():
                assert len(listed) == 1, f"{kind} exported {len(listed)} {operation} spans: {listed}"
        return {
            operation: {kind: listed[0] for kind, listed in by_kind.items()} for operation, by_kind in spans.items()
        }

    return found


def latest_points(received: Received, metric: str, **attributes: Any) -> dict[str, ReceivedPoint]:
    """The newest point of ``metric`` whose attributes include ``attributes``, by service."""
    latest: dict[str, ReceivedPoint] = {}
    for point in received.points:
        if point.metric != metric or any(point.attributes.get(key) != value for key, value in attributes.items()):
            continue
        if point.service not in latest or point.time_unix_nano >= latest[point.service].time_unix_nano:
            latest[point.service] = point
    return latest


def in_memory_points(reader: InMemoryMetricReader, metric: str) -> list[tuple[dict[str, Any], Any]]:
    """Every data point of ``metric`` this process recorded, with its attributes."""
    data = reader.get_metrics_data()
    if data is None:
        return []
    return [
        (dict(point.attributes or {}), point)
        for resource_metrics in data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for recorded in scope_metrics.metrics
        if recorded.name == metric
        for point in recorded.data.data_points
    ]


def only(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    matching = [span for span in spans if span.name == name]
    assert len(matching) == 1, f"{len(matching)} in-memory spans named {name}: {[s.name for s in spans]}"
    return matching[0]


# ----------------------------------------------------------------------------- tests


def test_a_checkpoint_cycle_is_one_trace_from_the_coordinator_to_every_server(
    fresh_stack: tuple[TelemetryStack, Recorded],
) -> None:
    stack, recorded = fresh_stack
    cycle = stack.run(checkpoint_cycle(stack, recorded.tracer, "trace"))
    exported = stack.receiver.wait_for(every_server_span(cycle), "every server's prepare, commit and resume span")

    local = list(recorded.spans.get_finished_spans())
    root = only(local, "test.cycle")
    trace_id = hex_trace(root.context.trace_id)
    by_id = {hex_span(span.context.span_id): span for span in local}
    coordinate = {operation: only(local, f"gym.checkpoint.coordinate.{operation}") for operation in CYCLE_OPERATIONS}
    for operation, span in coordinate.items():
        assert hex_trace(span.context.trace_id) == trace_id, operation
        assert span.parent is not None and span.parent.span_id == root.context.span_id, operation
        assert span.attributes[telemetry.CHECKPOINT_ID] == cycle.checkpoint_id, operation

    parents_seen: set[str] = set()
    for operation, by_kind in exported.items():
        for kind, span in by_kind.items():
            participant = cycle.participants[kind]
            where = f"{operation} of {kind}"
            assert span.trace_id == hex_trace(coordinate[operation].context.trace_id) == trace_id, where
            assert span.service == participant.service, where
            assert span.attributes[telemetry.CHECKPOINT_ID] == cycle.checkpoint_id, where
            assert span.attributes[telemetry.INSTANCE] == participant.instance, where
            call = by_id.get(span.parent_span_id)
            assert call is not None, f"{where}: its parent {span.parent_span_id} is no span of the coordinator"
            assert call.name == f"gym.checkpoint.coordinate.{operation}.call", (where, call.name)
            assert call.kind is SpanKind.CLIENT, (where, call.kind)
            assert call.attributes[telemetry.PREFIX + "server"] == participant.url, where
            assert span.parent_span_id not in parents_seen, f"{where}: two server spans share one call span"
            parents_seen.add(span.parent_span_id)
            assert call.parent is not None, where
            stage = by_id[hex_span(call.parent.span_id)]
            if operation == "prepare":
                assert stage.name == f"gym.checkpoint.coordinate.prepare.{kind}", (where, stage.name)
                assert stage.parent is not None and stage.parent.span_id == coordinate[operation].context.span_id
            else:
                assert stage is coordinate[operation], (where, stage.name)

    received = stack.receiver.snapshot()
    for kind, commit in exported["commit"].items():
        reply = cycle.commits[kind]
        assert commit.attributes[telemetry.RECORDS] == reply.record_count, kind
        children = {span.name: span for span in received.spans if span.parent_span_id == commit.span_id}
        assert {"gym.checkpoint.export", "gym.checkpoint.write"} <= set(children), (kind, sorted(children))
        export, write = children["gym.checkpoint.export"], children["gym.checkpoint.write"]
        for child in (export, write):
            assert child.trace_id == trace_id, (kind, child.name)
            assert child.service == cycle.participants[kind].service, (kind, child.name)
        assert export.attributes[telemetry.RECORDS] == reply.record_count, kind
        assert write.attributes[telemetry.RECORDS] == reply.record_count, kind
        if kind == "environment":
            assert reply.record_count > 0, reply
            assert write.attributes[telemetry.BYTES] == reply.records_bytes, (write.attributes, reply)
            assert write.attributes[telemetry.BYTES] > 0, write.attributes

    durations = in_memory_points(recorded.metrics, "gym.checkpoint.operation.duration")
    for operation in CYCLE_OPERATIONS:
        ok = [
            point
            for attributes, point in durations
            if attributes.get(telemetry.OPERATION) == f"coordinate.{operation}" and attributes.get("outcome") == "ok"
        ]
        assert ok and ok[0].count >= 1, f"no ok duration of coordinate.{operation}: {durations}"

    services = {participant.service for participant in cycle.participants.values()}

    def every_commit_count(received: Received) -> dict[str, ReceivedPoint] | None:
        points = latest_points(received, "gym.checkpoint.records", **{telemetry.OPERATION: "commit"})
        return points if services <= set(points) else None

    records = stack.receiver.wait_for(every_commit_count, "every server's gym.checkpoint.records of commit")
    for kind, participant in cycle.participants.items():
        point = records[participant.service]
        assert point.attributes[telemetry.KIND] == kind, point
        assert point.value == cycle.commits[kind].record_count, (kind, point)
    total = sum(records[service].value for service in services)
    assert total == sum(reply.record_count for reply in cycle.commits.values()), records


def info_line(operation: str, checkpoint_id: str, participant: Participant, outcome: str, tail: str) -> re.Pattern[str]:
    """The INFO line of one operation: ``<stamp> INFO gymckpt.telemetry: <op> <id> <kind>/<instance>: …``."""
    head = rf"{operation} {re.escape(checkpoint_id)} {re.escape(participant.kind)}/{re.escape(participant.instance)}"
    return re.compile(rf"^{STAMP} INFO gymckpt\.telemetry: {head}: {outcome} in \d+\.\d{{3}} s{tail}$", re.MULTILINE)


def test_the_server_logs_have_an_info_line_per_operation_and_no_secret(
    fresh_stack: tuple[TelemetryStack, Recorded],
) -> None:
    stack, recorded = fresh_stack
    cycle = stack.run(checkpoint_cycle(stack, recorded.tracer, "logs", refuse_after=True))
    environment = cycle.participants["environment"]
    assert cycle.refusal is not None
    assert {url: getattr(cause, "wire_code", None) for url, cause in cycle.refusal.causes.items()} == {
        environment.url: "stale_checkpoint"
    }, cycle.refusal

    for kind, participant in cycle.participants.items():
        text = stack.harness.stack.servers[participant.name].log_path.read_text(errors="replace")
        for operation in ("prepare", "resume"):
            pattern = info_line(operation, cycle.checkpoint_id, participant, "ok", r"(?: \([^)]*\))?")
            assert len(pattern.findall(text)) == 1, f"{kind}: no single {operation} INFO line\n{text[-3000:]}"
        commit = info_line(
            "commit", cycle.checkpoint_id, participant, "ok", r" \(records=(?P<records>\d+)(?P<rest>(?: [^)]*)?)\)"
        )
        lines = list(commit.finditer(text))
        assert len(lines) == 1, f"{kind}: no single commit INFO line\n{text[-3000:]}"
        reply = cycle.commits[kind]
        assert int(lines[0]["records"]) == reply.record_count, (lines[0][0], reply)
        if kind == "environment":
            assert f"bytes={reply.records_bytes}" in lines[0]["rest"].split(), lines[0][0]
    refused_line = info_line("prepare", cycle.checkpoint_id, environment, "error", r"(?: \([^)]*\))?")
    environment_log = stack.harness.stack.servers[environment.name].log_path.read_text(errors="replace")
    assert len(refused_line.findall(environment_log)) == 1, environment_log[-3000:]

    def refusal_exported(received: Received) -> Received | None:
        prepares = [
            span
            for span in server_spans(received, cycle, "prepare").get("environment", [])
            if any(name == "refused" for name, _ in span.events)
        ]
        counted = latest_points(received, "gym.checkpoint.events", **{telemetry.EVENT: "refused"})
        return received if prepares and environment.service in counted else None

    received = stack.receiver.wait_for(refusal_exported, "the refused prepare's span and its events count")
    refused_events = [
        attributes
        for span in server_spans(received, cycle, "prepare")["environment"]
        for name, attributes in span.events
        if name == "refused"
    ]
    assert refused_events == [{telemetry.EVENT: "refused", telemetry.CODE: "stale_checkpoint"}], refused_events

    for name, server in stack.harness.stack.servers.items():
        assert TOKEN not in server.log_path.read_text(errors="replace"), f"the token is in the {name} log"
    assert received.bodies, "the receiver got nothing"
    assert not [body for body in received.bodies if TOKEN.encode() in body], "an OTLP export carries the token"
    for span in received.spans:
        values = [*span.attributes.values(), *(value for _, attributes in span.events for value in attributes.values())]
        assert not [value for value in values if TOKEN in str(value)], span
    for point in received.points:
        assert not [value for value in point.attributes.values() if TOKEN in str(value)], point
    for span in recorded.spans.get_finished_spans():
        values = [*span.attributes.values(), *(value for event in span.events for value in event.attributes.values())]
        assert not [value for value in values if TOKEN in str(value)], span.name
    for name in ("gym.checkpoint.operation.duration", "gym.checkpoint.events", "gym.checkpoint.records"):
        for attributes, _ in in_memory_points(recorded.metrics, name):
            assert not [value for value in attributes.values() if TOKEN in str(value)], (name, attributes)


NO_SDK_PROBE = textwrap.dedent(
    """
    import sys

    from opentelemetry import trace
    from opentelemetry.trace import ProxyTracerProvider

    from gymckpt import telemetry

    problems = []
    with telemetry.operation("prepare", kind="environment", instance="e", checkpoint_id="c") as op:
        if trace.get_current_span().is_recording():
            problems.append("the current span records")
        if op.span.is_recording():
            problems.append("the operation's span records")
        if not isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
            problems.append(f"the tracer provider is {type(trace.get_tracer_provider()).__name__}")
    configured = telemetry.configure_from_environment("x")
    if configured is not False:
        problems.append(f"configure_from_environment returned {configured!r}")
    if not isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
        problems.append(f"after configure, the tracer provider is {type(trace.get_tracer_provider()).__name__}")
    if "gymckpt._otel_sdk" in sys.modules:
        problems.append("gymckpt._otel_sdk was imported")
    print("; ".join(problems) or "no-op")
    sys.exit(1 if problems else 0)
    """
)


def test_without_an_sdk_no_span_records_and_the_no_op_tracer_is_used() -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    probe = subprocess.run(
        [sys.executable, "-c", NO_SDK_PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        stdin=subprocess.DEVNULL,
    )
    assert probe.returncode == 0, (probe.stdout, probe.stderr)
    assert probe.stdout.strip() == "no-op", probe.stdout
