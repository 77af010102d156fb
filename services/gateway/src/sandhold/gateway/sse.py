"""Server-Sent Events straight from the log, resumable by stream sequence.

Each SSE `id:` is the event's JetStream stream sequence, so `Last-Event-ID`
names an exact point in the log: a reconnecting client gets every event after
it, then live ones, from whichever gateway answers. Events are pulled in
small batches and the next batch is fetched only once the previous one was
written to the socket (uvicorn waits while the client's buffer is full), so a
client that falls behind holds at most one batch (about 256 KiB) in the
gateway: it is served from the log at its own pace instead of queueing in
memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import msgspec
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sandhold.bus.records import EventRecord, record_of

log = logging.getLogger("sandhold.gateway.sse")

BATCH = 64  # events per pull at most...
BATCH_BYTES = 256 * 1024  # ...and about this many bytes: big events come fewer at a time


_encoder = msgspec.json.Encoder()


def frame(record: EventRecord) -> bytes:
    return (
        f"id: {record.seq}\nevent: {record.type}\ndata: ".encode()
        + _encoder.encode(record)
        + b"\n\n"
    )


async def event_frames(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    after: int,
    keepalive_s: float,
    retry_ms: int = 1000,
) -> AsyncIterator[bytes]:
    """SSE frames for every event on `subject` after sequence `after`, then live
    ones, with a keep-alive comment whenever nothing came for `keepalive_s`."""
    yield f"retry: {retry_ms}\n: resuming after {after}\n\n".encode()
    sent = after
    batch = BATCH
    delay = 0.5
    while True:
        sub = None
        try:
            # Inside the try: while NATS is away, making the consumer fails too,
            # and the stream waits and tries again rather than ending.
            sub = await _subscribe(js, stream, subject, sent + 1, keepalive_s)
            delay = 0.5
            while True:
                try:
                    msgs = await sub.fetch(batch, timeout=keepalive_s)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    await sub.consumer_info()  # raises if the consumer went away
                    continue
                size = sum(len(m.data) for m in msgs)
                batch = max(1, min(BATCH, BATCH_BYTES * len(msgs) // max(1, size)))
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq <= sent:
                        continue
                    try:
                        record = record_of(seq, msg.subject, msg.data)
                    except msgspec.DecodeError:
                        log.error("undecodable event at %s seq %d: skipped", msg.subject, seq)
                        sent = seq
                        continue
                    yield frame(record)
                    sent = seq
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a lost consumer is made again
            log.info("event stream on %s: %s; resuming after %d", subject, err, sent)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        finally:
            if sub is not None:
                # A client that went away cancels us (Litestar's cancel scope cancels
                # every await inside it): shield the clean-up, or the subscription
                # and the consumer would outlive the connection.
                cleanup = asyncio.ensure_future(_close(js, stream, sub))
                _closing.add(cleanup)
                cleanup.add_done_callback(_closing.discard)
                await asyncio.shield(cleanup)


_closing: set[asyncio.Future] = set()  # clean-ups running on after a cancellation


async def _close(js: JetStreamContext, stream: str, sub: _Pull) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(sub.sub.unsubscribe(), 5)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, sub.consumer), 5)


class _Pull:
    """A pull subscription on a consumer made here, so its name is known for the
    clean-up (nats-py keeps it in a private attribute)."""

    def __init__(self, sub: JetStreamContext.PullSubscription, consumer: str) -> None:
        self.sub = sub
        self.consumer = consumer

    async def fetch(self, batch: int, *, timeout: float):
        return await self.sub.fetch(batch, timeout=timeout)

    async def consumer_info(self):
        return await self.sub.consumer_info()


async def _subscribe(
    js: JetStreamContext, stream: str, subject: str, start_seq: int, keepalive_s: float
) -> _Pull:
    consumer = f"sse-{uuid.uuid4().hex}"
    await js.add_consumer(
        stream,
        ConsumerConfig(
            name=consumer,
            filter_subject=subject,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            ack_policy=AckPolicy.NONE,
            # The server drops the consumer of a client that vanished without a word.
            inactive_threshold=max(30.0, 4 * keepalive_s),
        ),
    )
    return _Pull(await js.pull_subscribe_bind(consumer=consumer, stream=stream), consumer)
