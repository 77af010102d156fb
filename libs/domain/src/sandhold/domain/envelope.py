"""The envelope every event travels in, and the record a reader gets back."""

from __future__ import annotations

import hashlib

import msgspec
from sandhold.domain.events import AnyEvent


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """One event on the wire (JSON). `id` is also the message's `Nats-Msg-Id`.

    `causation_id` is the request key or event id that caused this event;
    `correlation_id` ties together everything one client request set off.
    """

    id: str
    aggregate_id: str
    time: float
    actor: str
    causation_id: str
    correlation_id: str
    event: AnyEvent
    trace_id: str | None = None

    @property
    def type(self) -> str:
        # (the ignore: our tags are all str; msgspec's may be int)
        return type(self.event).__struct_config__.tag  # type: ignore[return-value]


class Recorded(msgspec.Struct, frozen=True):
    """An envelope as read back from the log, with its stream sequence."""

    seq: int
    envelope: Envelope


def wrap(
    events: list[AnyEvent],
    *,
    aggregate_id: str,
    id_base: str,
    actor: str,
    causation_id: str,
    correlation_id: str,
    time: float,
    trace_id: str | None = None,
) -> list[Envelope]:
    """Envelopes with deterministic ids: deciding the same thing twice gives the
    same ids, so JetStream's de-duplication drops the second append. The id ends
    with a digest of the event itself, so a *different* decision made at the same
    point (say, two schedulers choosing different hosts) never passes for ours."""
    return [
        Envelope(
            id=f"{aggregate_id}:{id_base}:{i}:{_digest(event)}",
            aggregate_id=aggregate_id,
            time=time,
            actor=actor,
            causation_id=causation_id,
            correlation_id=correlation_id,
            event=event,
            trace_id=trace_id,
        )
        for i, event in enumerate(events)
    ]


_event_encoder = msgspec.json.Encoder()


def _digest(event: AnyEvent) -> str:
    return hashlib.sha256(_event_encoder.encode(event)).hexdigest()[:12]
