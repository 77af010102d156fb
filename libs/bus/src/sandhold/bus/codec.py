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
