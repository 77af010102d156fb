from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sandhold.telemetry import context
from sandhold.telemetry.tracing import OtelTracer

from tests.e2e.harness import Up


@pytest.fixture
def client_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this (the client's) process, spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    context.install(OtelTracer(provider))
    try:
        yield exporter
    finally:
        context.install(None)
        provider.shutdown()


@pytest.fixture(scope="module")
def plain_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`sandhold up` as shipped (tracing off), with log levels set per logger."""
    running = Up(
        tmp_path_factory.mktemp("up") / "data",
        env={"SANDHOLD_LOG": "warning,sandhold.scheduler=info"},
    ).start()
    try:
        yield running
    finally:
        running.stop()
