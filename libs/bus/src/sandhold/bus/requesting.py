"""Asking: a request stored in the REQUESTS stream, its answer to come to the
asker's inbox (`answering.py` is the other side). Apart from the answering
side so a client imports no service machinery."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from sandhold.bus.codec import REPLY_HEADER
from sandhold.bus.electing import attempt_timeouts, patiently
from sandhold.bus.names import Names
from sandhold.telemetry import context


async def publish_request(
    js: JetStreamContext, names: Names, subject: str, payload: bytes, *, msg_id: str, reply_to: str
) -> PubAck:
    """Store a request in the REQUESTS stream, its answer to go to `reply_to`
    (the one way a client or a service asks: the trace continues with it)."""
    headers = {Header.MSG_ID: msg_id, REPLY_HEADER: reply_to}
    traceparent = context.traceparent()
    if traceparent:
        headers[context.TRACEPARENT] = traceparent
    # A cluster whose node that led the stream just died answers "no responders"
    # (or nothing) until it elects another: offered again, in short attempts at
    # first, with the same message id, so a request stored by an attempt whose
    # ack was lost is stored once. Only then is the caller told it could not be sent.
    timeouts = attempt_timeouts(1.0)
    return await patiently(
        lambda: js.publish(
            subject,
            payload,
            stream=names.requests_stream,
            headers=dict(headers),
            timeout=next(timeouts),
        )
    )
