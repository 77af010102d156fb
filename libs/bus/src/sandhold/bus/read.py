"""Reading a slice of the log back: every message on a subject (filter), in order."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal, overload

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from sandhold.bus.append import last_sequence
from sandhold.bus.codec import decode_envelope
from sandhold.bus.store import stream_sequence
from sandhold.domain.envelope import Recorded

log = logging.getLogger(__name__)


@overload
async def read_subjects(
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    *,
    raw: Literal[False] = False,
    start_seq: int = 1,
    until_seq: int | None = None,
    timeout: float = 60.0,
) -> list[Recorded]: ...
@overload
async def read_subjects(
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    *,
    raw: Literal[True],
    start_seq: int = 1,
    until_seq: int | None = None,
    timeout: float = 60.0,
) -> list[Msg]: ...
async def read_subjects(
    js, stream, subject_filter, *, raw=False, start_seq=1, until_seq=None, timeout=60.0
):
    """Every message matching `subject_filter` from `start_seq` up to the last one
    present when the read began (or `until_seq`), decoded unless `raw`."""
    last = await last_sequence(js, stream, subject_filter)
    if until_seq is not None:
        last = min(last, until_seq)
    if last < start_seq:
        return []
    out: list = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        seq = stream_sequence(msg)
        try:
            if seq <= last:
                out.append(msg if raw else Recorded(seq, decode_envelope(msg.data)))
        except msgspec.DecodeError:
            # Skipped like the live projections skip it; the read must still end.
            log.error("undecodable event at %s seq %d: skipped", msg.subject, seq)
        finally:
            if seq >= last:
                done.set()

    sub = await js.subscribe(
        subject_filter,
        stream=stream,
        ordered_consumer=True,
        cb=on_msg,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        config=ConsumerConfig(opt_start_seq=start_seq),
        pending_msgs_limit=-1,
        pending_bytes_limit=-1,
    )
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return out


read_subject = read_subjects
