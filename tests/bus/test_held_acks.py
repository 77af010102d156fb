"""A work queue's handled messages are acknowledged by its loop, on a real
server, and each ack waits for the next fetch (decision 092): while another
message follows, the one handled before it is acked with that one in the queue,
so an ack never empties the work-queue stream; with nothing more to fetch, the
fetch's empty return acks it; a stop acks what was handled. A handler that
answers a message itself (a nak) is not overruled."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus.cancelling import cancel_and_wait
from sandhold.bus.names import Names
from sandhold.bus.reconciler import consume, delivery

from tests.support.waiting import wait_until

LANES: dict[str, Callable[[Msg], str] | None] = {
    "one at a time": None,
    "in lanes": lambda msg: msg.data[:1].decode(),
}


async def _consumer(nc, names: Names, host: str):
    js = nc.jetstream()
    durable = f"acks-{uuid.uuid4().hex[:6]}"
    sub = await js.pull_subscribe(
        names.work(host),
        durable=durable,
        stream=names.hostwork_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60, max_deliver=5),
    )
    return durable, sub


async def _publish(nc, names: Names, host: str, body: bytes) -> int:
    ack = await nc.jetstream().publish(names.work(host), body, stream=names.hostwork_stream)
    return ack.seq


async def _in_queue(nc, names: Names, host: str) -> int:
    """How many messages of `host`'s subject the stream still holds."""
    info = await nc.jetstream().stream_info(names.hostwork_stream, subjects_filter=names.work(host))
    return (info.state.subjects or {}).get(names.work(host), 0)


async def _stopped(consuming: asyncio.Task[None]) -> None:
    consuming.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consuming


@pytest.mark.parametrize("lanes", LANES, ids=list(LANES))
async def test_a_handled_message_is_acked_once_the_next_is_fetched(
    nc, names: Names, lanes: str
) -> None:
    js = nc.jetstream()
    durable, sub = await _consumer(nc, names, "h1")
    handled: list[bytes] = []

    async def handle(msg) -> None:
        handled.append(msg.data)  # and returns: handled, never acked here

    first = await _publish(nc, names, "h1", b"a:1")
    # A fetch that would wait half a minute for the next message: only that
    # message, or the stop, can end it.
    consuming = asyncio.create_task(
        consume(sub, handle, what=durable, lane=LANES[lanes], concurrency=2, fetch_s=30)
    )
    try:
        await wait_until(lambda: handled == [b"a:1"], timeout=30, what="a:1 handled")
        info = await js.consumer_info(names.hostwork_stream, durable)
        assert info.num_ack_pending == 1, "acked with nothing after it in the queue"
        assert await _in_queue(nc, names, "h1") == 1

        second = await _publish(nc, names, "h1", b"b:1")

        async def first_acked() -> bool:
            info = await js.consumer_info(names.hostwork_stream, durable)
            return info.ack_floor.stream_seq == first

        await wait_until(first_acked, timeout=30, what="a:1 acked once b:1 came")
        assert handled == [b"a:1", b"b:1"]
        # ...with b:1 in the queue all along: it is acked only at the next fetch.
        info = await js.consumer_info(names.hostwork_stream, durable)
        assert info.num_ack_pending == 1 and info.ack_floor.stream_seq < second
        assert await _in_queue(nc, names, "h1") == 1
    finally:
        await _stopped(consuming)

    # Stopping acks what was handled: nothing is delivered again.
    async def all_acked() -> bool:
        info = await js.consumer_info(names.hostwork_stream, durable)
        return info.num_ack_pending == 0 and await _in_queue(nc, names, "h1") == 0

    await wait_until(all_acked, timeout=30, what="b:1 acked at the stop")
    info = await js.consumer_info(names.hostwork_stream, durable)
    assert info.num_redelivered == 0 and info.ack_floor.stream_seq == second


@pytest.mark.parametrize("lanes", LANES, ids=list(LANES))
async def test_with_nothing_more_to_fetch_the_empty_fetch_acks_it(
    nc, names: Names, lanes: str
) -> None:
    js = nc.jetstream()
    durable, sub = await _consumer(nc, names, "h2")
    handled = asyncio.Event()

    async def handle(msg) -> None:
        handled.set()

    await _publish(nc, names, "h2", b"a:1")
    consuming = asyncio.create_task(
        consume(sub, handle, what=durable, lane=LANES[lanes], concurrency=2, fetch_s=0.3)
    )
    try:
        await asyncio.wait_for(handled.wait(), 30)

        async def acked() -> bool:
            info = await js.consumer_info(names.hostwork_stream, durable)
            return info.num_ack_pending == 0 and await _in_queue(nc, names, "h2") == 0

        # Still consuming: the fetch that came back empty acked it.
        await wait_until(acked, timeout=30, what="a:1 acked after an empty fetch")
        assert not consuming.done()
    finally:
        await _stopped(consuming)


async def test_a_message_the_handler_nakd_is_not_acked_by_the_loop(nc, names: Names) -> None:
    durable, sub = await _consumer(nc, names, "h3")
    deliveries: list[int] = []
    again = asyncio.Event()

    async def handle(msg) -> None:
        deliveries.append(delivery(msg)[0])
        if len(deliveries) == 1:
            await msg.nak(delay=0.1)  # not now: an infrastructure error, say
        else:
            again.set()

    await _publish(nc, names, "h3", b"a:1")
    consuming = asyncio.create_task(consume(sub, handle, what=durable, fetch_s=0.3))
    try:
        await asyncio.wait_for(again.wait(), 30)
    finally:
        await _stopped(consuming)
    assert deliveries == [1, 2]


async def test_a_stop_acks_what_was_handled_while_a_lane_takes_its_time_to_end(
    nc, names: Names
) -> None:
    """As a host-agent stops (cancelled again and again, `cancel_and_wait`)
    while a lane still winds down, a final save's thaw say: what was handled
    before is acked all the same."""
    js = nc.jetstream()
    durable, sub = await _consumer(nc, names, "h4")
    handled = asyncio.Event()
    winding = asyncio.Event()

    async def handle(msg) -> None:
        if msg.data == b"a:1":
            handled.set()
            return
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            winding.set()
            # Its clean-up outlasts several of the stop's cancellations.
            deadline = asyncio.get_running_loop().time() + 0.5
            while asyncio.get_running_loop().time() < deadline:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0.05)
            raise

    await _publish(nc, names, "h4", b"b:1")  # its lane never ends by itself
    await _publish(nc, names, "h4", b"a:1")
    consuming = asyncio.create_task(
        consume(sub, handle, what=durable, lane=LANES["in lanes"], concurrency=2, fetch_s=30)
    )
    await asyncio.wait_for(handled.wait(), 30)
    info = await js.consumer_info(names.hostwork_stream, durable)
    assert info.num_ack_pending == 2, "a:1 is held: nothing came after it"
    assert await cancel_and_wait([consuming], timeout=30)
    assert winding.is_set()

    async def first_acked() -> bool:
        info = await js.consumer_info(names.hostwork_stream, durable)
        return info.num_ack_pending == 1 and await _in_queue(nc, names, "h4") == 1

    await wait_until(first_acked, timeout=30, what="a:1 acked at the stop, b:1 not")
