"""What a service is working on right now: the trace it continues and the ids
every log line should carry.

The bus calls `span(...)` around each message it handles and each append, and
`traceparent()` when it publishes. With tracing off (the default) no span is
made: an incoming W3C `traceparent` is only carried along in a contextvar, so
an envelope still records the trace id of a request that came with one and the
next message carries it on, at the cost of a contextvar set. `tracing.configure`
swaps in OpenTelemetry.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal, Protocol

TRACEPARENT = "traceparent"  # the W3C header, also on NATS messages

Kind = Literal["internal", "producer", "consumer", "client", "server"]

# The ids a log line names (sandbox_id, command_id, task_id, ...), innermost wins.
_fields: ContextVar[dict[str, str]] = ContextVar("sandhold_log_fields", default={})  # noqa: B039 - never mutated
_carried: ContextVar[str | None] = ContextVar("sandhold_traceparent", default=None)


class Tracer(Protocol):
    """The port `tracing.configure` fills with OpenTelemetry."""

    def span(
        self, name: str, parent: str | None, kind: Kind, attributes: dict[str, str]
    ) -> contextlib.AbstractContextManager[object]: ...

    def carry(self, parent: str) -> contextlib.AbstractContextManager[object]: ...

    def traceparent(self) -> str | None: ...


# W3C trace context, as OpenTelemetry's propagator reads it: a later version may
# append fields (only the first four are carried on), version 00 may not.
_TRACEPARENT = re.compile(
    r"[ \t]*(?!ff)([0-9a-f]{2})-(?!0{32})([0-9a-f]{32})-(?!0{16})([0-9a-f]{16})"
    r"-([0-9a-f]{2})(-.*)?[ \t]*"
)


def well_formed(parent: str) -> str | None:
    """`parent` as a W3C `traceparent` (its first four fields), or None if it is not one.

    The header comes from whoever sent the request: left unchecked, any string
    would become the `trace_id` of every event the request causes."""
    found = _TRACEPARENT.fullmatch(parent)
    if found is None or (found[1] == "00" and found[5]):
        return None
    return "-".join(found.group(1, 2, 3, 4))


class _Carrier:
    """Tracing off: pass the caller's context through, record nothing."""

    @contextlib.contextmanager
    def carry(self, parent: str) -> Iterator[None]:
        token = _carried.set(well_formed(parent))
        try:
            yield
        finally:
            _carried.reset(token)

    def span(
        self, name: str, parent: str | None, kind: Kind, attributes: dict[str, str]
    ) -> contextlib.AbstractContextManager[object]:
        return self.carry(parent) if parent else contextlib.nullcontext()

    def traceparent(self) -> str | None:
        return _carried.get()


_tracer: Tracer = _Carrier()


def install(tracer: Tracer | None) -> None:
    """Use `tracer` from now on (None: back to carrying only)."""
    global _tracer
    _tracer = tracer if tracer is not None else _Carrier()


@contextlib.contextmanager
def span(
    name: str, *, parent: str | None = None, kind: Kind = "internal", **ids: str | None
) -> Iterator[None]:
    """Work named `name`, a child of `parent` (a traceparent from a message's
    headers) or of whatever is current. `ids` (sandbox_id=..., command_id=...)
    become span attributes and fields of every log line inside."""
    named = {k: v for k, v in ids.items() if v is not None}
    token = _fields.set({**_fields.get(), **named}) if named else None
    try:
        with _tracer.span(name, parent, kind, named):
            yield
    finally:
        if token is not None:
            _fields.reset(token)


@contextlib.contextmanager
def working_on(**ids: str | None) -> Iterator[None]:
    """Name what the code inside works on in every log line (no span: for work
    that lasts long, like a task's runner)."""
    named = {k: v for k, v in ids.items() if v is not None}
    token = _fields.set({**_fields.get(), **named})
    try:
        yield
    finally:
        _fields.reset(token)


def carry(parent: str | None) -> contextlib.AbstractContextManager[object]:
    """Continue `parent`'s trace without a span of our own (a reconcile pass that
    acts on what an event set off)."""
    return _tracer.carry(parent) if parent else contextlib.nullcontext()


def traceparent() -> str | None:
    """The current context as a W3C `traceparent` value, or None outside any trace."""
    return _tracer.traceparent()


def trace_id() -> str | None:
    """The current trace id (32 hex digits), as envelopes record it."""
    current = _tracer.traceparent()
    return current[3:35] if current else None


def log_fields() -> dict[str, str]:
    return _fields.get()
