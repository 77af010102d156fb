"""Tracing off: only a well-formed W3C `traceparent` is carried on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sandhold.telemetry import context

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def carrier_only() -> Iterator[None]:
    before = context._tracer  # noqa: SLF001
    context.install(None)
    yield
    context.install(before)


def test_a_valid_traceparent_is_carried():
    with context.span("handle", parent=VALID, kind="consumer"):
        assert context.traceparent() == VALID
        assert context.trace_id() == "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(
    "parent",
    [
        "x",
        "garbage-that-is-long-enough-to-slice-into-a-32-character-trace-id",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id: invalid
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        VALID + "x" * 8000,
    ],
)
def test_a_malformed_traceparent_is_dropped_like_opentelemetry_does(parent: str):
    # An HTTP client or a NATS publisher chooses this header: what envelopes record
    # as `trace_id` and every later message carries must be a real trace context.
    with context.span("handle", parent=parent, kind="server"):
        assert context.traceparent() is None
        assert context.trace_id() is None
    with context.carry(parent):
        assert context.traceparent() is None
