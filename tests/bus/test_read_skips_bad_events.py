"""A log read ends even when the last event cannot be decoded (it is skipped)."""

from __future__ import annotations

import nats
from sandhold.bus.codec import FENCE_HEADER
from sandhold.bus.names import Names
from sandhold.bus.ownership import tenant_of
from sandhold.bus.read import read_subject


async def test_a_read_whose_last_event_is_undecodable_still_ends(nc: nats.NATS, names: Names):
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000001")
    good = (
        b'{"id":"x:0","aggregate_id":"sb-0000000000000001","time":1.0,"actor":"t",'
        b'"causation_id":"c","correlation_id":"c","event":{"type":"request.noted",'
        b'"request_key":"k","request_digest":"d"}}'
    )
    await js.publish(subject, good, headers={FENCE_HEADER: "0"})
    await js.publish(subject, b"not an envelope", headers={FENCE_HEADER: "1"})
    records = await read_subject(js, names.events_stream, subject, timeout=5)
    assert [r.envelope.type for r in records] == ["request.noted"]


async def test_a_forged_event_without_the_fence_header_is_not_read(nc: nats.NATS, names: Names):
    """A writer with the right to the subject who skips the fence (a raw publish
    of a well-formed `sandbox.deleted`) is stored by the stream, never folded."""
    js = nc.jetstream()
    subject = names.events("sandbox", "sb-0000000000000002")
    forged = (
        b'{"id":"f:0","aggregate_id":"sb-0000000000000002","time":1.0,"actor":"forger",'
        b'"causation_id":"c","correlation_id":"c","event":{"type":"sandbox.deleted",'
        b'"host":null,"generation":1}}'
    )
    await js.publish(subject, forged)
    assert await read_subject(js, names.events_stream, subject, timeout=5) == []
    await js.publish(subject, forged.replace(b"f:0", b"f:1"), headers={FENCE_HEADER: "1"})
    assert [r.envelope.type for r in await read_subject(js, names.events_stream, subject)] == [
        "sandbox.deleted"
    ]


async def test_whose_a_sandbox_is_is_read_from_its_first_fenced_event(nc: nats.NATS, names: Names):
    js = nc.jetstream()
    sandbox_id = "sb-0000000000000003"
    subject = names.events("sandbox", sandbox_id)

    def created(tenant: str, id_: str) -> bytes:
        return (
            f'{{"id":"{id_}","aggregate_id":"{sandbox_id}","time":1.0,"actor":"a",'
            f'"causation_id":"c","correlation_id":"c","event":{{"type":"sandbox.created",'
            f'"sandbox_id":"{sandbox_id}","request_key":"k","request_digest":"d",'
            f'"tenant":"{tenant}"}}}}'
        ).encode()

    await js.publish(subject, created("mallory", "x:0"))  # first on the subject, no fence
    assert await tenant_of(js, names, "sandbox", sandbox_id) is None
    await js.publish(subject, created("acme", "x:1"), headers={FENCE_HEADER: "1"})
    assert await tenant_of(js, names, "sandbox", sandbox_id) == "acme"
