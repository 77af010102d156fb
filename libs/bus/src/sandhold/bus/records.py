"""An event as it is shown outside: its envelope, its subject and stream sequence,
and the event itself untyped — so the SSE API and `sandhold audit export` show
events of types this version does not know yet, as they are."""

from __future__ import annotations

import msgspec


class EventRecord(msgspec.Struct, kw_only=True):
    """One event with its envelope and stream sequence (the SSE `data:`; also a
    line of `sandhold audit export`)."""

    seq: int
    subject: str
    id: str
    type: str
    aggregate_id: str
    time: float
    actor: str
    causation_id: str
    correlation_id: str
    trace_id: str | None = None
    event: dict[str, object]


class _RawEnvelope(msgspec.Struct, kw_only=True):
    # Untyped event: the gateway forwards events it may not know yet.
    id: str
    aggregate_id: str
    time: float
    actor: str
    causation_id: str
    correlation_id: str
    event: dict[str, object]
    trace_id: str | None = None


_raw_decoder = msgspec.json.Decoder(_RawEnvelope)


def record_of(seq: int, subject: str, data: bytes) -> EventRecord:
    e = _raw_decoder.decode(data)
    return EventRecord(
        seq=seq,
        subject=subject,
        id=e.id,
        type=str(e.event.get("type", "")),
        aggregate_id=e.aggregate_id,
        time=e.time,
        actor=e.actor,
        causation_id=e.causation_id,
        correlation_id=e.correlation_id,
        trace_id=e.trace_id,
        event=e.event,
    )
