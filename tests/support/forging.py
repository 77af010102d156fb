"""A stale writer's append: published on an event subject, refused by the stream.

JetStream refuses an append whose expected last subject sequence is out of
date (the single-writer fence), yet the message still reaches every core
subscriber of the subject. Whatever tells a user what happened must not
take such a message for an event."""

from __future__ import annotations

import time

import pytest
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.errors import APIError
from sandhold.bus.append import WRONG_LAST_SEQUENCE
from sandhold.bus.codec import TYPE_HEADER, encode_envelope
from sandhold.domain.envelope import wrap
from sandhold.domain.events import AnyEvent


async def publish_refused(js: JetStreamContext, subject: str, aggregate_id: str, event: AnyEvent):
    """Publish `event` as a fenced writer would, and check the stream refused it."""
    (stale,) = wrap(
        [event], aggregate_id=aggregate_id, id_base="stale-writer", actor="host-agent:local",
        causation_id="stale", correlation_id="stale", time=time.time(),
    )  # fmt: skip
    headers = {
        Header.MSG_ID: stale.id,
        Header.EXPECTED_LAST_SUBJECT_SEQUENCE: "1",
        TYPE_HEADER: stale.type,
    }
    with pytest.raises(APIError) as refused:
        await js.publish(subject, encode_envelope(stale), headers=headers)
    assert refused.value.err_code == WRONG_LAST_SEQUENCE
