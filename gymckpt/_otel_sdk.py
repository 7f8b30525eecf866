"""The OpenTelemetry SDK and OTLP exporter setup (the ``gymckpt[otel]`` extra); imported only when asked for."""

from __future__ import annotations

import atexit

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from gymckpt._version import __version__

__all__ = ["install"]


def _span_exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER {name!r}: gymckpt knows otlp, console and none")


def _metric_reader(name: str) -> MetricReader:
    if name == "console":
        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return PeriodicExportingMetricReader(OTLPMetricExporter())
    raise ValueError(f"OTEL_METRICS_EXPORTER {name!r}: gymckpt knows otlp, console and none")


def install(service_name: str, span_exporters: list[str], metric_exporters: list[str]) -> None:
    """Global tracer and meter providers with these exporters; flushed at exit."""
    resource = Resource.create({"service.name": service_name, "service.version": __version__})
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)
        for name in span_exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(name)))
        trace.set_tracer_provider(tracer_provider)
        atexit.register(tracer_provider.shutdown)
    if metric_exporters:
        meter_provider = MeterProvider(resource=resource, metric_readers=[_metric_reader(n) for n in metric_exporters])
        metrics.set_meter_provider(meter_provider)
        atexit.register(meter_provider.shutdown)
