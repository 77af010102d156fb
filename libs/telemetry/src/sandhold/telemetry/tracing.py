"""OpenTelemetry tracing, switched on by the environment.

`SANDHOLD_TRACES` chooses the exporter: `off` (the default), `otlp` (OTLP over
HTTP to `OTEL_EXPORTER_OTLP_ENDPOINT` or `..._TRACES_ENDPOINT`; chosen by
itself when one of those is set), `console` (JSON on stderr) or `file:PATH`
(one JSON span per line, appended; every service may share one file).
OpenTelemetry is imported only when tracing is on: off costs nothing but the
contextvar the carrier in `context` sets.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sandhold.telemetry import context

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

# Spans leave a service within this long (the SDK's default is 5 s).
_EXPORT_DELAY_MS = "500"


def exporter_setting() -> str:
    chosen = os.environ.get("SANDHOLD_TRACES", "").strip()
    if chosen:
        return chosen
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    ):
        return "otlp"
    return "off"


def configure(service: str) -> TracerProvider | None:
    """Trace this process as `sandhold-<service>` if the environment asks for it."""
    exporter = _exporter(exporter_setting())
    if exporter is None:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", _EXPORT_DELAY_MS)
    provider = TracerProvider(resource=Resource.create({"service.name": f"sandhold-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    context.install(OtelTracer(provider))
    atexit.register(provider.shutdown)  # what is still batched leaves on exit
    return provider


def _exporter(setting: str) -> SpanExporter | None:
    if setting in ("", "off", "none"):
        return None
    if setting == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if setting == "console":
        return ConsoleSpanExporter(out=sys.stderr)
    if setting.startswith("file:"):
        out = open(setting[len("file:") :], "a", buffering=1)  # noqa: SIM115 - lives as long as we do
        return ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
    raise SystemExit(f"SANDHOLD_TRACES={setting!r}: use off, otlp, console or file:PATH")


class OtelTracer:
    """`context.Tracer` backed by an OpenTelemetry tracer provider."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = provider.get_tracer("sandhold")
        self._trace = trace
        self._otel_context = otel_context
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {
            "internal": trace.SpanKind.INTERNAL,
            "producer": trace.SpanKind.PRODUCER,
            "consumer": trace.SpanKind.CONSUMER,
            "client": trace.SpanKind.CLIENT,
            "server": trace.SpanKind.SERVER,
        }

    def _extract(self, parent: str) -> Context:
        return self._propagator.extract({context.TRACEPARENT: parent})

    @contextlib.contextmanager
    def span(
        self, name: str, parent: str | None, kind: context.Kind, attributes: dict[str, str]
    ) -> Iterator[object]:
        with self._tracer.start_as_current_span(
            name,
            context=self._extract(parent) if parent else None,
            kind=self._kinds[kind],
            attributes={f"sandhold.{k}": v for k, v in attributes.items()},
        ) as current:
            yield current

    @contextlib.contextmanager
    def carry(self, parent: str) -> Iterator[None]:
        token = self._otel_context.attach(self._extract(parent))
        try:
            yield
        finally:
            self._otel_context.detach(token)

    def traceparent(self) -> str | None:
        found = self._trace.get_current_span().get_span_context()
        if not found.is_valid:
            return None
        return f"00-{found.trace_id:032x}-{found.span_id:016x}-{found.trace_flags:02x}"
