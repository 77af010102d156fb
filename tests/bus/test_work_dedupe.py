"""Two schedulers (or savers) send the same instruction: the host gets it once.
Work messages carry deterministic ids, which JetStream de-duplicates within its
window, even after the host took and acked the first copy off its work queue."""

from __future__ import annotations

import nats
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus.names import Names
from sandhold.bus.reconciler import send_work
from sandhold.domain import work as wk


async def test_an_instruction_sent_by_two_instances_reaches_the_host_once(
    nc: nats.NATS, nats_url: str, names: Names
):
    js = nc.jetstream()
    await js.add_consumer(
        names.hostwork_stream,
        ConsumerConfig(
            durable_name="host-h1", ack_policy=AckPolicy.EXPLICIT, filter_subject=names.work("h1")
        ),
    )
    host = await js.pull_subscribe_bind("host-h1", names.hostwork_stream)
    twin = await nats.connect(nats_url)
    try:
        save = wk.SaveSandboxWork(sandbox_id="sb-1", generation=1, save_id="sv-1")
        await send_work(js, names, "h1", save)
        (msg,) = await host.fetch(1, timeout=5)
        await msg.ack_sync()  # taken and gone from the work queue...
        await send_work(twin.jetstream(), names, "h1", save)  # ...then the twin sends it
        state = (await js.stream_info(names.hostwork_stream)).state
        assert state.messages == 0 and state.last_seq == 1  # not stored again
        # A different instruction is not mistaken for it.
        await send_work(twin.jetstream(), names, "h1", wk.SaveSandboxWork(
            sandbox_id="sb-1", generation=1, save_id="sv-2"
        ))  # fmt: skip
        (other,) = await host.fetch(1, timeout=5)
        assert b"sv-2" in other.data
        await other.ack()
    finally:
        await twin.close()
