"""A log read ends even when the last event cannot be decoded (it is skipped)."""

from __future__ import annotations

import nats
from sandhold.bus.names import Names
from sandhold.bus.read import read_subject


async def test_a_read_whose_last_event_is_undecodable_still_ends(nc: nats.NATS, names: Names):
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000001")
    good = (
        b'{"id":"x:0","aggregate_id":"sb-0000000000000001","time":1.0,"actor":"t",'
        b'"causation_id":"c","correlation_id":"c","event":{"type":"request.noted",'
        b'"request_key":"k","request_digest":"d"}}'
    )
    await js.publish(subject, good)
    await js.publish(subject, b"not an envelope")
    records = await read_subject(js, names.events_stream, subject, timeout=5)
    assert [r.envelope.type for r in records] == ["request.noted"]
