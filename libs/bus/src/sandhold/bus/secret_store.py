"""Secrets between their request and their use, one subject each.

A command's (`names.secret(command_id)`): the scheduler keeps them when it
accepts the command (before the `command.queued` that names them), puts them
into the run instruction for the command's host when it dispatches it, and
removes them once the command has started or ended. A task's
(`names.task_secret(task_id)`): the orchestrator keeps them when it accepts
the task and gives them to each agent step's command, until the task ends.
Only those two may read or write them (permissions.py), the events name the
secrets only, and the server's store is encrypted at rest.

The same three calls keep Connections' values (`stream=names.connections_stream`,
`names.connection(sandbox_id, value_id)`: `{"value": …}`), for the scheduler
alone, as long as the sandbox refers to them (decision 031).
"""

from __future__ import annotations

import logging

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sandhold.bus.codec import reflected
from sandhold.bus.names import Names

log = logging.getLogger(__name__)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(dict[str, str])


async def keep(
    js: JetStreamContext,
    names: Names,
    subject: str,
    values: dict[str, str],
    *,
    stream: str | None = None,
) -> None:
    await js.publish(subject, _encoder.encode(values), stream=stream or names.secrets_stream)


async def fetch(
    js: JetStreamContext, names: Names, subject: str, *, stream: str | None = None
) -> dict[str, str] | None:
    """The values kept on `subject`, or None when they are gone (expired, removed)."""
    try:
        # Not a direct get: its answer's headers would hide whether the message
        # kept here is one bounced onto this subject by someone else (decision 034).
        msg = await js.get_last_msg(stream or names.secrets_stream, subject)
    except NotFoundError:
        return None
    if reflected(msg.headers):
        log.error("%s holds a bounced stored message, not what was kept: ignored", subject)
        return None
    try:
        return _decoder.decode(msg.data) if msg.data else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not what we keep: as good as gone


async def held(
    js: JetStreamContext, names: Names, subject_filter: str, *, stream: str | None = None
) -> list[str]:
    """The subjects matching `subject_filter` something is kept on (names only:
    what a sweep for leftovers looks at)."""
    info = await js.stream_info(stream or names.secrets_stream, subjects_filter=subject_filter)
    return sorted(info.state.subjects or {})


async def kept_at(
    js: JetStreamContext, names: Names, subject: str, *, stream: str | None = None
) -> float | None:
    """When what is on `subject` was kept (server time, Unix seconds); None: nothing."""
    try:
        msg = await js.get_last_msg(stream or names.secrets_stream, subject)
    except NotFoundError:
        return None
    return msg.time.timestamp() if msg.time is not None else None


async def forget(
    js: JetStreamContext, names: Names, subject: str, *, stream: str | None = None
) -> None:
    """Remove what is kept on `subject` (a wildcard removes every match)."""
    await js.purge_stream(stream or names.secrets_stream, subject=subject)
