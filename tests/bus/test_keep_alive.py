"""A work queue keeps the messages in hand alive, on a real server: a handler
slower than the consumer's ack_wait, and a message waiting behind it in its
lane, are delivered once; a message taken and never answered (lost on its way)
is delivered again after ack_wait. So ack_wait can be short (a host's run
instruction lost as a node died is not left for a minute) without a slow
restore being delivered twice."""

from __future__ import annotations

import asyncio
import uuid

import nats
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus.names import Names
from sandhold.bus.reconciler import delivery
from sandhold.bus.service import Shell

ACK_WAIT_S = 1.0


def _config(names: Names, host: str) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=f"keep-{uuid.uuid4().hex[:6]}",
        filter_subject=names.work(host),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT_S,
        max_deliver=5,
    )


async def test_a_message_held_longer_than_ack_wait_is_delivered_once(
    nc: nats.NATS, nats_url: str, names: Names
) -> None:
    js = nc.jetstream()
    for body in (b"a:slow", b"a:next", b"b:quick"):
        await js.publish(names.work("h1"), body, stream=names.hostwork_stream)
    handled: list[tuple[bytes, int]] = []
    done = asyncio.Event()

    async def handle(msg) -> None:
        if msg.data == b"a:slow":
            # A restore: three times the ack_wait, while a:next waits in its lane.
            await asyncio.sleep(3 * ACK_WAIT_S)
        handled.append((msg.data, delivery(msg)[0]))
        await msg.ack()
        if len(handled) >= 3:
            done.set()

    async with Shell("test", nats_url, names) as shell:
        await shell.work_queue(
            names.hostwork_stream,
            config := _config(names, "h1"),
            handle,
            what="keep-alive test",
            lane=lambda m: m.data[:1].decode(),
            concurrency=4,
        )
        await asyncio.wait_for(done.wait(), 30)
        # The server's own count: a message it gave up waiting for is delivered
        # again (to wait in its lane here), whether or not handled yet.
        info = await js.consumer_info(names.hostwork_stream, config.durable_name)
    assert info.num_redelivered == 0 and info.delivered.consumer_seq == 3
    assert sorted(handled) == [(b"a:next", 1), (b"a:slow", 1), (b"b:quick", 1)]
    assert [body for body, _ in handled if body.startswith(b"a:")] == [b"a:slow", b"a:next"]


async def test_a_message_taken_and_never_answered_is_delivered_again(
    nc: nats.NATS, nats_url: str, names: Names
) -> None:
    js = nc.jetstream()
    config = _config(names, "h2")
    await js.add_consumer(names.hostwork_stream, config.evolve(name=config.durable_name))
    await js.publish(names.work("h2"), b"x:run", stream=names.hostwork_stream)
    # Taken by a pull whose answer never comes: as if its node died delivering it.
    lost = await js.pull_subscribe_bind(config.durable_name, names.hostwork_stream)
    [taken] = await lost.fetch(1, timeout=10)
    assert taken.data == b"x:run"
    got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def handle(msg) -> None:
        await msg.ack()
        if not got.done():
            got.set_result(delivery(msg)[0])

    async with Shell("test", nats_url, names) as shell:
        await shell.work_queue(names.hostwork_stream, config, handle, what="keep-alive test")
        assert await asyncio.wait_for(got, 30) == 2
