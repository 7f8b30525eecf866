"""Telemetry: OpenTelemetry spans and metrics of checkpoint operations, trace context over HTTP, logging.

Everything goes through the OpenTelemetry API. Until an SDK is configured the API's
providers are no-ops: a span does not record (attributes are skipped), an instrument
records nothing. :func:`configure_from_environment` configures the SDK and its OTLP
exporter (the ``gymckpt[otel]`` extra) from the standard ``OTEL_*`` variables;
``gymckpt serve``, ``stack up`` and ``collect`` call it, and a server of your own gets it
(and its logging) from ``install_checkpointing``, which calls :func:`configure_process`.

Names follow the reference stack's, so dashboards built for it keep working:

- spans ``gym.checkpoint.<operation>`` on each participant (prepare, commit, restore,
  resume, retire, forget, renew, lease_expired), with children ``gym.checkpoint.wait_ready``,
  ``.export``, ``.write``, ``.read``, ``.install``, ``.generation_cut``; on the
  controller ``gym.checkpoint.coordinate.<operation>``, a child per prepare stage
  (``….prepare.<kind>``) and one per server call (``….<operation>.call``, a CLIENT span
  whose ``traceparent`` the server continues);
- attributes ``nemo.gym.checkpoint.*`` (:data:`CHECKPOINT_ID`, :data:`KIND`, …);
- span events ``refused`` (``code``), ``lease_expired``, ``prepare_not_ready`` and
  ``generation_cut`` (``disposition``), each also counted by ``gym.checkpoint.events``;
- metrics ``gym.checkpoint.operation.duration`` (ms), ``gym.checkpoint.records`` and
  ``gym.checkpoint.bytes`` (written and read, by operation), ``gym.checkpoint.prepare.blockers``,
  ``gym.checkpoint.episodes.in_flight``, ``gym.checkpoint.events``.

Logging: one INFO line per operation (logger ``gymckpt.telemetry``): its id, participant,
counts, bytes, seconds and outcome. :func:`setup_logging` gives every line a timestamp,
level and logger name; :func:`configure_process` does so only where no logging was set up. Attribute values are the checkpoint's own ids and counts: no
token, header or storage option is ever recorded.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gymckpt._version import __version__

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, MutableMapping

__all__ = [
    "BLOCKERS",
    "BYTES",
    "CHECKPOINT_ID",
    "EPISODES",
    "INSTANCE",
    "KIND",
    "PHASE",
    "RECORDS",
    "Operation",
    "check_environment",
    "configure_from_environment",
    "configure_process",
    "event",
    "extract",
    "inject",
    "operation",
    "setup_logging",
    "step",
]

SCOPE = "gymckpt"
PREFIX = "nemo.gym.checkpoint."
CHECKPOINT_ID = PREFIX + "id"
KIND = PREFIX + "participant_kind"
INSTANCE = PREFIX + "instance"
PHASE = PREFIX + "phase"
RECORDS = PREFIX + "records"
BYTES = PREFIX + "bytes"
BLOCKERS = PREFIX + "blockers"
EPISODES = PREFIX + "episodes"
ROLLOUTS = PREFIX + "rollouts"
PARTICIPANTS = PREFIX + "participants"
OPERATION = PREFIX + "operation"
EVENT = PREFIX + "event"
CODE = PREFIX + "code"
OUTCOME = "outcome"

logger = logging.getLogger("gymckpt.telemetry")
_INSTRUMENTS: dict[str, Any] = {}


def bind(
    tracer_provider: trace.TracerProvider | None = None, meter_provider: metrics.MeterProvider | None = None
) -> None:
    """Record through these providers (default: the global ones, no-ops until an SDK is set).

    For a process that manages its own providers (a trainer, a test with in-memory
    exporters); the module binds the global ones when imported.
    """
    global _tracer  # noqa: PLW0603 (the module's one tracer, rebound as a whole)
    _tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(SCOPE, __version__)
    meter = (meter_provider or metrics.get_meter_provider()).get_meter(SCOPE, __version__)
    _INSTRUMENTS.update(
        duration=meter.create_histogram(
            "gym.checkpoint.operation.duration", unit="ms", description="How long a checkpoint operation took"
        ),
        records=meter.create_counter(
            "gym.checkpoint.records", unit="{record}", description="Records written (commit) and read (restore)"
        ),
        bytes=meter.create_counter("gym.checkpoint.bytes", unit="By", description="Record bytes written and read"),
        blockers=meter.create_histogram(
            "gym.checkpoint.prepare.blockers", unit="{blocker}", description="Work a prepare waited for"
        ),
        in_flight=meter.create_gauge(
            "gym.checkpoint.episodes.in_flight", unit="{episode}", description="Episodes live when a checkpoint opened"
        ),
        events=meter.create_counter(
            "gym.checkpoint.events", unit="{event}", description="Refusals, lease expiries, prepares not ready, cuts"
        ),
    )


_tracer: trace.Tracer = trace.get_tracer(SCOPE, __version__)
bind()

#: the operation whose block is running (its steps add their seconds to its INFO line)
_current_operation: contextvars.ContextVar[Operation | None] = contextvars.ContextVar("gymckpt_operation", default=None)

#: operation attribute names whose values the INFO line reports, by their short name
_LOGGED = {"records": RECORDS, "bytes": BYTES, "blockers": BLOCKERS, "episodes": EPISODES, "phase": PHASE}


class Operation:
    """The span of one operation: set attributes by short name (``records=3``), recorded once at the end."""

    def __init__(self, span: trace.Span, name: str, attributes: dict[str, Any]) -> None:
        self.span = span
        self.name = name
        self.attributes = attributes
        self.outcome = "ok"
        #: seconds of each of its steps (:func:`step`) by name, summed: the INFO line reports them
        self.step_seconds: dict[str, float] = {}

    def set(self, **values: Any) -> None:
        """``nemo.gym.checkpoint.<name>`` for each keyword (None skipped)."""
        for name, value in values.items():
            if value is None:
                continue
            key = PREFIX + name
            self.attributes[key] = value
            if self.span.is_recording():
                self.span.set_attribute(key, value)


@contextmanager
def operation(
    name: str,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str | None = None,
    span_kind: SpanKind = SpanKind.INTERNAL,
    **values: Any,
) -> Iterator[Operation]:
    """A ``gym.checkpoint.<name>`` span, its duration metric and its INFO line.

    An exception leaving the block marks the span ERROR (a gymckpt error adds a
    ``refused`` event with its code) and the outcome ``error``; it propagates unchanged.
    """
    attributes: dict[str, Any] = {KIND: kind, INSTANCE: instance}
    if checkpoint_id:
        attributes[CHECKPOINT_ID] = checkpoint_id
    began = time.perf_counter()
    with _tracer.start_as_current_span(
        f"gym.checkpoint.{name}",
        kind=span_kind,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        op = Operation(span, name, dict(attributes))
        op.set(**values)
        current = _current_operation.set(op)
        try:
            yield op
        except BaseException as exc:
            op.outcome = "error"
            code = getattr(exc, "code", None)
            if span.is_recording():
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                span.record_exception(exc)
            if isinstance(code, str) and span.is_recording():
                span.add_event("refused", {EVENT: "refused", CODE: code})  # counted where it is answered
            raise
        finally:
            _current_operation.reset(current)
            seconds = time.perf_counter() - began
            _INSTRUMENTS["duration"].record(seconds * 1000, {OPERATION: name, KIND: kind, OUTCOME: op.outcome})
            _log(op, checkpoint_id, kind, instance, seconds)


def _log(op: Operation, checkpoint_id: str | None, kind: str, instance: str, seconds: float) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    counts = " ".join(
        [
            *(f"{short}={op.attributes[key]}" for short, key in _LOGGED.items() if key in op.attributes),
            *(f"{step}={spent:.3f}s" for step, spent in op.step_seconds.items()),
        ]
    )
    logger.info(
        "%s %s %s/%s: %s in %.3f s%s",
        op.name,
        checkpoint_id or "-",
        kind,
        instance,
        op.outcome,
        seconds,
        f" ({counts})" if counts else "",
    )


@contextmanager
def step(name: str, *, span_kind: SpanKind = SpanKind.INTERNAL, **values: Any) -> Iterator[Operation]:
    """A child span ``gym.checkpoint.<name>`` of the current one (no metric, no log line of its own).

    A step named without a dot (``read``, ``install``, ``write``) adds its seconds to the
    enclosing :func:`operation`'s INFO line (``read=0.301s``), summed over steps of one name.
    """
    parent = _current_operation.get()
    began = time.perf_counter()
    try:
        with _tracer.start_as_current_span(f"gym.checkpoint.{name}", kind=span_kind) as span:
            op = Operation(span, name, {})
            op.set(**values)
            yield op
    finally:
        if parent is not None and "." not in name:
            parent.step_seconds[name] = parent.step_seconds.get(name, 0.0) + time.perf_counter() - began


@contextmanager
def collected_steps() -> Iterator[dict[str, float]]:
    """The seconds of the steps run in the block, by name, for an operation whose line another
    process logs (a server's coordinator runs the control call a worker's route logs)."""
    op = Operation(trace.get_current_span(), "collected", {})
    token = _current_operation.set(op)
    try:
        yield op.step_seconds
    finally:
        _current_operation.reset(token)


def add_steps(step_seconds: object) -> None:
    """Add steps timed elsewhere (:func:`collected_steps`) to the current operation's INFO line."""
    parent = _current_operation.get()
    if parent is None or not isinstance(step_seconds, dict):
        return
    for name, spent in step_seconds.items():
        if isinstance(name, str) and isinstance(spent, (int, float)):
            parent.step_seconds[name] = parent.step_seconds.get(name, 0.0) + float(spent)


def volume(operation_name: str, *, kind: str, records: int, size_bytes: int | None) -> None:
    """Records and bytes written (commit) or read (restore)."""
    attributes = {OPERATION: operation_name, KIND: kind}
    _INSTRUMENTS["records"].add(max(0, records), attributes)
    if size_bytes:
        _INSTRUMENTS["bytes"].add(max(0, size_bytes), attributes)


def prepared(*, kind: str, blockers: int, in_flight: int) -> None:
    """What a prepare found: the work it waited for, the episodes live."""
    _INSTRUMENTS["blockers"].record(blockers, {KIND: kind})
    _INSTRUMENTS["in_flight"].set(in_flight, {KIND: kind})


def event(name: str, count: int = 1, **values: Any) -> None:
    """An event on the current span and in ``gym.checkpoint.events`` (``code``, ``disposition``, … as attributes)."""
    attributes = {EVENT: name, **{PREFIX + key: value for key, value in values.items() if value is not None}}
    _INSTRUMENTS["events"].add(count, attributes)
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)


def refused(code: str) -> None:
    """A refusal answered on the wire (``gym.checkpoint.events``, ``event=refused``, its ``code``)."""
    _INSTRUMENTS["events"].add(1, {EVENT: "refused", CODE: code})


def recording() -> bool:
    """Whether the current span records (an SDK is configured and samples it)."""
    return trace.get_current_span().is_recording()


# --- trace context over HTTP


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current trace context (``traceparent``) to outgoing headers; returns them."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str]) -> otel_context.Context:
    """The trace context incoming headers carry."""
    return propagate.extract(headers)


@contextmanager
def continued(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block in the trace ``carrier`` (headers or a message field from :func:`inject`) names, if any."""
    if not carrier or not isinstance(carrier, dict) or "traceparent" not in carrier:
        yield
        return
    token = otel_context.attach(extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)


class TraceContextMiddleware:
    """ASGI: continue the caller's trace (its ``traceparent``) for the whole request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        if "traceparent" not in headers:
            await self.app(scope, receive, send)
            return
        token = otel_context.attach(extract(headers))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


# --- configuration


#: whether this process configured the SDK already
_state = {"configured": False}


def _exporters(variable: str) -> list[str]:
    return [name.strip() for name in os.environ.get(variable, "").split(",") if name.strip()]


#: the exporter names gymckpt's SDK setup knows (``OTEL_TRACES_EXPORTER``, ``OTEL_METRICS_EXPORTER``)
KNOWN_EXPORTERS = ("otlp", "console", "none")


def check_environment() -> None:
    """Raise a ValueError naming the variable when an ``OTEL_*_EXPORTER`` names an exporter gymckpt does not know.

    Nothing is configured: for a launcher that checks the variables before the server's own
    code (which configures telemetry itself, :func:`configure_process`) runs.
    """
    for variable in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):
        for name in _exporters(variable):
            if name not in KNOWN_EXPORTERS:
                raise ValueError(f"{variable} {name!r}: gymckpt knows otlp, console and none")


def configure_from_environment(service_name: str) -> bool:
    """Configure the OpenTelemetry SDK from the ``OTEL_*`` variables; whether it did (once per process).

    Off unless ``OTEL_TRACES_EXPORTER``/``OTEL_METRICS_EXPORTER`` name an exporter
    (``otlp`` or ``console``) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, and never with
    ``OTEL_SDK_DISABLED=true``. ``OTEL_SERVICE_NAME`` overrides ``service_name``. The
    OTLP exporter (HTTP/protobuf) reads its own variables (endpoint, headers, timeout).
    Without the SDK installed (``pip install -e '.[otel]'`` in the gymckpt clone) it logs a warning and
    returns False.
    """
    if _state["configured"] or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return _state["configured"]
    endpoint = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    traces = _exporters("OTEL_TRACES_EXPORTER") or (["otlp"] if endpoint else [])
    wanted_metrics = _exporters("OTEL_METRICS_EXPORTER") or (["otlp"] if endpoint else [])
    traces, wanted_metrics = [n for n in traces if n != "none"], [n for n in wanted_metrics if n != "none"]
    if not traces and not wanted_metrics:
        return False
    try:
        from gymckpt._otel_sdk import install
    except ImportError as exc:
        logger.warning(
            "OTEL_* asks for telemetry but the SDK is not installed (pip install -e '.[otel]' in the gymckpt clone): %s",
            exc,
        )
        return False
    install(os.environ.get("OTEL_SERVICE_NAME") or service_name, traces, wanted_metrics)
    _state["configured"] = True
    logger.info("telemetry: traces to %s, metrics to %s", traces or "nowhere", wanted_metrics or "nowhere")
    return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: the variable a parent sets for the server processes it starts (``--log-level``)
LOG_LEVEL_ENV = "GYMCKPT_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")


def _numeric_level(chosen: str | int) -> int:
    numeric = logging.getLevelName(chosen.upper()) if isinstance(chosen, str) else chosen
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {chosen!r}: one of debug, info, warning, error")
    return numeric


def _add_handler(root: logging.Logger) -> None:
    """gymckpt's stderr handler (timestamp, level, logger name) on the root logger, once."""
    if not any(getattr(handler, "_gymckpt", False) for handler in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler._gymckpt = True  # type: ignore[attr-defined]
        root.addHandler(handler)


def setup_logging(level: str | int | None = None) -> None:
    """Lines with timestamp, level and logger name on stderr; level from ``level`` or ``GYMCKPT_LOG_LEVEL`` (info)."""
    numeric = _numeric_level(level if level is not None else os.environ.get(LOG_LEVEL_ENV, "info"))
    root = logging.getLogger()
    _add_handler(root)
    logging.getLogger("gymckpt").setLevel(numeric)  # other libraries stay at the root's level (warning)
    if root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)


#: whether :func:`configure_process` ran in this process
_process = {"configured": False}


def configure_process(service_name: str) -> None:
    """Logging and telemetry of a server process from its environment, once per process (later calls do nothing).

    ``install_checkpointing`` calls it, so a server of your own logs and traces as the
    reference servers do. It never overrides a logging setup already made:

    - gymckpt's handler (stderr, timestamp, level, logger name) is added only when the root
      logger has no handler yet (nobody set logging up: not the app, not its launcher; uvicorn
      sets up only its own loggers). Otherwise gymckpt's lines go to the handlers there are;
    - the ``gymckpt`` logger's level is set only when it has none of its own: to
      ``GYMCKPT_LOG_LEVEL`` when that is set, else to info when gymckpt added its handler
      (else it follows the root logger's level, as the app set it);
    - telemetry: :func:`configure_from_environment` (``OTEL_*``; ``OTEL_SERVICE_NAME``, else
      ``service_name``), itself once per process: a launcher that configured it first wins.

    A ``GYMCKPT_LOG_LEVEL`` or ``OTEL_*`` value that is not valid raises a ValueError naming
    the variable (the server does not start); the process counts as configured only once this
    returned.
    """
    if _process["configured"]:
        return
    raw = os.environ.get(LOG_LEVEL_ENV, "").strip()
    try:
        level = _numeric_level(raw) if raw else None
    except ValueError as exc:
        raise ValueError(f"{LOG_LEVEL_ENV}: {exc}") from None
    check_environment()
    root, own = logging.getLogger(), logging.getLogger("gymckpt")
    adds_handler = not root.handlers and not own.handlers
    if own.level == logging.NOTSET and (level is not None or adds_handler):
        own.setLevel(level if level is not None else logging.INFO)
    if adds_handler:
        _add_handler(root)
    configure_from_environment(service_name)
    _process["configured"] = True
