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

import base64
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.js import JetStreamContext
from sandhold.bus.append import last_sequence
from sandhold.bus.codec import OFFSET_HEADER, STREAM_HEADER
from sandhold.bus.follow import pull_batches
from sandhold.bus.records import EventRecord, record_of

log = logging.getLogger("sandhold.gateway.sse")

BATCH = 64  # events per pull at most...
BATCH_BYTES = 256 * 1024  # ...and about this many bytes: big events come fewer at a time


_encoder = msgspec.json.Encoder()

OUTPUT_CHECK_S = 1.0  # how often a live output stream asks whether its command ended
PAGE_BATCH = 16  # events per JSON page at most (a page is one NATS reply: ≤ 1 MB)


class EventPage(msgspec.Struct, kw_only=True):
    """The events after a point, as one JSON answer (long polling): ask again
    with `after=last_event_id` for the next ones."""

    events: list[EventRecord]
    last_event_id: int  # the last event's id, or the `after` asked for when none came


def frame(record: EventRecord, *, named: bool = True) -> bytes:
    """One SSE frame; `named`: with the event's type as the SSE event name (else
    a plain message, for a page that takes every type alike)."""
    name = f"event: {record.type}\n" if named else ""
    return f"id: {record.seq}\n{name}data: ".encode() + _encoder.encode(record) + b"\n\n"


async def event_frames(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    after: int,
    keepalive_s: float,
    retry_ms: int = 1000,
    named: bool = True,
) -> AsyncIterator[bytes]:
    """SSE frames for every event on `subject` after sequence `after`, then live
    ones, with a keep-alive comment whenever nothing came for `keepalive_s`
    (a quiet log, or NATS away: the stream waits and resumes, it does not end)."""
    yield f"retry: {retry_ms}\n: resuming after {after}\n\n".encode()
    batches = pull_batches(
        js, stream, subject, after=after, batch=BATCH, batch_bytes=BATCH_BYTES,
        idle_s=keepalive_s, what="an event stream",
    )  # fmt: skip
    try:
        async for batch in batches:
            if not batch:
                yield b": keep-alive\n\n"
            for seq, msg in batch:
                try:
                    record = record_of(seq, msg.subject, msg.data)
                except msgspec.DecodeError:
                    log.error("undecodable event at %s seq %d: skipped", msg.subject, seq)
                    continue
                yield frame(record, named=named)
    finally:
        await batches.aclose()


async def event_page(
    js: JetStreamContext, stream: str, subject: str, *, after: int, wait_s: float
) -> EventPage:
    """The events on `subject` after `after` that are there now, or, when there
    are none, the first that come within `wait_s` (none when none came)."""
    batches = pull_batches(
        js, stream, subject, after=after, batch=PAGE_BATCH, batch_bytes=BATCH_BYTES,
        idle_s=max(wait_s, 0.05), what="an event page",
    )  # fmt: skip
    try:
        batch = await anext(batches)
    finally:
        await batches.aclose()
    records = []
    for seq, msg in batch:
        try:
            records.append(record_of(seq, msg.subject, msg.data))
        except msgspec.DecodeError:
            log.error("undecodable event at %s seq %d: skipped", msg.subject, seq)
    return EventPage(events=records, last_event_id=batch[-1][0] if batch else after)


class OutputChunk(msgspec.Struct, kw_only=True):
    """One piece of a command's output as an SSE `output` frame: `data` is
    base64 (a chunk may end inside a UTF-8 character); `offset` is where it
    starts in its stream's bytes, so a client can tell a gap from a repeat."""

    stream: str
    offset: int
    data: str


async def output_frames(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    after: int,
    ended: Callable[[], Awaitable[object | None]],
    keepalive_s: float,
    retry_ms: int = 1000,
) -> AsyncIterator[bytes]:
    """SSE frames for a command's output chunks after OUTPUT sequence `after`,
    live, then one `end` frame (the command as `ended()` returns it) once it
    has ended and every chunk it kept was sent; the stream then closes.

    The host-agent stores every chunk before it reports the end, so once
    `ended()` answers, the chunks still to send are those up to the subject's
    last sequence now."""
    yield f"retry: {retry_ms}\n: resuming after {after}\n\n".encode()
    batches = pull_batches(
        js, stream, subject, after=after, batch=BATCH, batch_bytes=BATCH_BYTES,
        idle_s=min(keepalive_s, OUTPUT_CHECK_S), what="an output stream",
    )  # fmt: skip
    position, last_check, final, end_seq = after, 0.0, None, 0
    try:
        async for batch in batches:
            if not batch:
                yield b": keep-alive\n\n"
            for seq, msg in batch:
                position = seq
                headers = msg.headers or {}  # every chunk has both (the host-agent sets them)
                chunk = OutputChunk(
                    stream=headers[STREAM_HEADER],
                    offset=int(headers[OFFSET_HEADER]),
                    data=base64.b64encode(msg.data).decode(),
                )
                yield (
                    f"id: {seq}\nevent: output\ndata: ".encode() + _encoder.encode(chunk) + b"\n\n"
                )
            if final is None and time.monotonic() - last_check >= OUTPUT_CHECK_S:
                last_check = time.monotonic()
                final = await ended()
                if final is not None:
                    # From the leader: a replica a moment behind would end the stream
                    # before its last chunks.
                    end_seq = await last_sequence(js, stream, subject, from_leader=True)
            if final is not None and position >= end_seq:
                yield b"event: end\ndata: " + _encoder.encode(final) + b"\n\n"
                return
    finally:
        await batches.aclose()
