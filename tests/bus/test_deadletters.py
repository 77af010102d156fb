"""A request a work queue gives up on is answered, removed and counted."""

from __future__ import annotations

import msgspec
import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus import deadletters
from sandhold.bus.codec import REPLY_HEADER
from sandhold.bus.names import Names

from tests.support.waiting import wait_until


async def test_a_request_that_exhausts_its_deliveries_is_answered_and_removed(
    nc: nats.NATS, names: Names
):
    js = nc.jetstream()
    await js.add_consumer(
        names.requests_stream,
        ConsumerConfig(
            durable_name="doomed",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            max_deliver=2,
            filter_subject=names.requests("sandbox"),
        ),
    )
    sub = await js.pull_subscribe_bind("doomed", names.requests_stream)
    watcher = await deadletters.watch(nc, names.requests_stream, "doomed", what="test")
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox, max_msgs=1)
    await js.publish(
        names.request("sandbox.create", "default"), b"{}", headers={REPLY_HEADER: inbox}
    )
    for _ in range(2):  # a handler that fails every time
        (msg,) = await sub.fetch(1, timeout=5)
        assert msg.subject == names.request("sandbox.create", "default")
        await msg.nak()
    # The consumer asks for more (as the services' loops always do): the server
    # would deliver it a third time, gives up instead and says so.
    with pytest.raises(NatsTimeoutError):
        await sub.fetch(1, timeout=2)
    reply = msgspec.json.decode((await replies.next_msg(timeout=10)).data)
    kept = await js.publish(names.request("sandbox.start", "default"), b"{}")
    assert reply["ok"] is False and reply["error"]["code"] == "not_handled"

    async def only_the_other_is_left() -> bool:
        info = await js.stream_info(names.requests_stream)
        return info.state.messages == 1 and info.state.first_seq == kept.seq

    await wait_until(only_the_other_is_left, timeout=10, what="the dead request removed")
    (other,) = await sub.fetch(1, timeout=5)  # the queue goes on
    assert other.subject == names.request("sandbox.start", "default")
    await other.ack()
    await watcher.unsubscribe()


async def test_two_instances_watching_one_consumer_answer_and_count_a_dead_letter_once(
    nc: nats.NATS, nats_url: str, names: Names
):
    # Two schedulers share the durable consumer and both watch its advisories:
    # one of them handles each (a queue group), so the sender gets one answer
    # and the dead letter is counted once.
    js = nc.jetstream()
    await js.add_consumer(
        names.requests_stream,
        ConsumerConfig(
            durable_name="shared",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            max_deliver=1,
            filter_subject=names.requests("sandbox"),
        ),
    )
    twin = await nats.connect(nats_url)
    try:
        watchers = [
            await deadletters.watch(conn, names.requests_stream, "shared", what="twins")
            for conn in (nc, twin)
        ]
        await twin.flush()
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        await js.publish(
            names.request("sandbox.create", "default"), b"{}", headers={REPLY_HEADER: inbox}
        )
        sub = await js.pull_subscribe_bind("shared", names.requests_stream)
        (msg,) = await sub.fetch(1, timeout=5)
        await msg.nak()  # its one delivery failed
        with pytest.raises(NatsTimeoutError):
            await sub.fetch(1, timeout=2)  # asked for again: given up, advisory sent
        await replies.next_msg(timeout=10)

        async def removed() -> bool:
            return (await js.stream_info(names.requests_stream)).state.messages == 0

        await wait_until(removed, timeout=10, what="the dead request removed")
        # Whatever the server sent either watcher has arrived once both flushed.
        await nc.flush()
        await twin.flush()
        assert sum(w.delivered for w in watchers) == 1
        assert replies.delivered == 1
    finally:
        await twin.close()
