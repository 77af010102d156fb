"""A work queue consumed in lanes, on a real server: one lane's slow message
holds up no other lane, each lane keeps its order, and no more messages are
in hand at once than the limit."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus.names import Names
from sandhold.bus.reconciler import consume


async def _queued(nc, names: Names, host: str, bodies: list[bytes]):
    """Work messages on `host`'s queue, and a new durable pull consumer of it."""
    js = nc.jetstream()
    for body in bodies:
        await js.publish(names.work(host), body, stream=names.hostwork_stream)
    consumer = f"lanes-{uuid.uuid4().hex[:6]}"
    sub = await js.pull_subscribe(
        names.work(host),
        durable=consumer,
        stream=names.hostwork_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
    )
    return consumer, sub


async def test_a_slow_lane_holds_up_no_other_and_each_lane_keeps_its_order(
    nc, names: Names
) -> None:
    sent = [b"a:1", b"a:2", b"b:1", b"a:3", b"b:2", b"c:1"]
    consumer, sub = await _queued(nc, names, "h1", sent)
    release_a1 = asyncio.Event()
    handled: list[bytes] = []
    in_hand = most_in_hand = 0
    all_done = asyncio.Event()

    async def handle(msg) -> None:
        nonlocal in_hand, most_in_hand
        in_hand += 1
        most_in_hand = max(most_in_hand, in_hand)
        try:
            if msg.data == b"a:1":
                await release_a1.wait()  # a restore, a final save: slow
            else:
                await asyncio.sleep(0)
            handled.append(msg.data)
            await msg.ack()
            if len(handled) == len(sent):
                all_done.set()
        finally:
            in_hand -= 1

    def lane(msg) -> str:
        return msg.data.split(b":")[0].decode()

    consuming = asyncio.create_task(consume(sub, handle, what=consumer, lane=lane, concurrency=3))
    try:
        # The other lanes finish while a:1 still waits, and a's later messages wait for it.
        async with asyncio.timeout(30):
            while sorted(handled) != [b"b:1", b"b:2", b"c:1"]:
                await asyncio.sleep(0.01)
        assert handled.index(b"b:1") < handled.index(b"b:2")
        assert not any(h.startswith(b"a:") for h in handled)
        release_a1.set()
        await asyncio.wait_for(all_done.wait(), 30)
    finally:
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consuming
    assert [h for h in handled if h.startswith(b"a:")] == [b"a:1", b"a:2", b"a:3"]
    assert most_in_hand <= 3


async def test_a_cancelled_consumer_leaves_no_handler_running(nc, names: Names) -> None:
    consumer, sub = await _queued(nc, names, "h2", [b"x:1", b"y:1"])
    started: set[bytes] = set()
    cancelled: set[bytes] = set()

    async def handle(msg) -> None:
        started.add(msg.data)
        try:
            await asyncio.Event().wait()  # never ends by itself
        except asyncio.CancelledError:
            cancelled.add(msg.data)
            raise

    consuming = asyncio.create_task(
        consume(sub, handle, what=consumer, lane=lambda m: m.data[:1].decode(), concurrency=4)
    )
    async with asyncio.timeout(30):
        while len(started) < 2:
            await asyncio.sleep(0.01)
    consuming.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consuming
    assert cancelled == {b"x:1", b"y:1"}
