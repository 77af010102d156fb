"""Messages a work queue gave up on: answered, counted, removed.

A message delivered `max_deliver` times without an ack (its handler kept
failing, or kept dying with its process) is never delivered again, yet a
work-queue stream keeps it forever and its sender is never answered.
JetStream announces it on `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`;
the consumer's owner takes it from there: the sender of a request gets an
error reply (the `Sh-Reply` inbox is in the message), the failure is logged
and counted, and the message is deleted from the stream.

Every instance of a service watches its consumer's advisories in one queue
group, so each advisory is handled (answered, counted) once, however many
instances share the consumer.
"""

from __future__ import annotations

import contextlib
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError
from sandhold.bus.codec import reply_inbox
from sandhold.telemetry import metrics

log = logging.getLogger(__name__)


class Advisory(msgspec.Struct, frozen=True):
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


_decoder = msgspec.json.Decoder(Advisory)
_encoder = msgspec.json.Encoder()


def advisory_subject(stream: str, consumer: str) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


async def watch(nc: NATS, stream: str, consumer: str, *, what: str) -> Subscription:
    """Handle the advisories of one durable consumer; returns the subscription."""
    js = nc.jetstream()

    async def on_advisory(msg: Msg) -> None:
        try:
            advisory = _decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        try:
            dead = await js.get_msg(stream, seq=advisory.stream_seq)
        except NotFoundError:
            return  # acked or removed at the last moment
        metrics.dead_lettered(what)
        log.error(
            "%s: %s (stream seq %d) failed %d deliveries; dropped",
            what,
            dead.subject,
            advisory.stream_seq,
            advisory.deliveries,
        )
        reply_to = reply_inbox(dead.headers)
        if reply_to:
            error = {
                "code": "not_handled",
                "message": f"the request failed {advisory.deliveries} attempts at being "
                "handled and was dropped; send it again (same key) once the cause is fixed",
            }
            await nc.publish(reply_to, _encoder.encode({"ok": False, "error": error}))
        with contextlib.suppress(NotFoundError):
            await js.delete_msg(stream, advisory.stream_seq)

    return await nc.subscribe(advisory_subject(stream, consumer), queue=consumer, cb=on_advisory)
