"""JSON on the wire: one encoder and one decoder for envelopes, reused."""

from __future__ import annotations

import msgspec
from sandhold.domain.envelope import Envelope

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Envelope)

encode_envelope = _encoder.encode
decode_envelope = _decoder.decode

# Headers sandhold sets besides the JetStream ones.
TYPE_HEADER = "Sh-Type"
REPLY_HEADER = "Sh-Reply"
STREAM_HEADER = "Sh-Stream"
OFFSET_HEADER = "Sh-Offset"


# What nats-server adds to a stored message it answers a direct get with. The
# answer goes to whatever reply subject the asker named, past the asker's
# publish permissions: a user that may read a stream it also writes could have
# its own bytes published anywhere (decision 034). None of our publishers sets
# it, so a message carrying it is a stored one bounced, and never taken in.
REFLECTED_HEADER = "Nats-Stream"


def reflected(headers: dict[str, str] | None) -> bool:
    """Whether the message is a stored message the server answered a read with."""
    return headers is not None and REFLECTED_HEADER in headers


def reply_inbox(headers: dict[str, str] | None) -> str | None:
    """Where to answer a request: its `Sh-Reply` when that is an inbox. Anything
    else is not answered, so a request cannot make a service publish, with the
    service's own rights, to an event subject or the JetStream API."""
    reply_to = (headers or {}).get(REPLY_HEADER)
    return reply_to if reply_to and reply_to.startswith("_INBOX.") else None


# The header of a fenced append (`append.py`: the expected last subject
# sequence, `Nats-Expected-Last-Subject-Sequence`): JetStream stored the
# message only because that sequence was right at the time.
FENCE_HEADER = "Nats-Expected-Last-Subject-Sequence"


def has_fence(headers: dict[str, str] | None) -> bool:
    """Whether a message is an event: appended behind the fence (its headers as
    stored). A stored message bounced onto an event subject (`reflected`) is not one."""
    return headers is not None and FENCE_HEADER in headers and not reflected(headers)
