"""Reading a slice of the log back: every message on a subject (filter), in order."""

from __future__ import annotations

from typing import Literal, overload

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import read_range
from sandhold.domain.envelope import Recorded


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
    bulk: bool = False,
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
    bulk: bool = False,
) -> list[Msg]: ...
async def read_subjects(
    js: JetStreamContext,
    stream: str,
    subject_filter: str,
    *,
    raw: bool = False,
    start_seq: int = 1,
    until_seq: int | None = None,
    timeout: float = 60.0,
    bulk: bool = False,
) -> list[Recorded] | list[Msg]:
    """Every message matching `subject_filter` from `start_seq` up to the last one
    present when the read began (or `until_seq`), decoded unless `raw`; an
    event that does not decode is skipped (and counted) as the live folds skip it.
    `bulk`: a read of much of the log (`bulk_read`, decision 100)."""
    if raw:
        msgs = await read_range(
            js, stream, subject_filter, _as_is, start_seq=start_seq, until_seq=until_seq,
            timeout=timeout, what="messages", bulk=bulk,
        )  # fmt: skip
        return [msg for _, msg, _ in msgs]
    records = await read_range(
        js, stream, subject_filter, decode_envelope, start_seq=start_seq, until_seq=until_seq,
        timeout=timeout, bulk=bulk,
    )  # fmt: skip
    return [Recorded(seq, envelope) for seq, _, envelope in records]


def _as_is(data: bytes) -> bytes:
    return data


read_subject = read_subjects
