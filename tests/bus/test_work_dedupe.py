"""Two schedulers (or savers) send the same instruction: the host gets it once.
Work messages carry deterministic ids, which JetStream de-duplicates within its
window, even after the host took and acked the first copy off its work queue."""

from __future__ import annotations

import nats
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from sandhold.bus.names import Names
from sandhold.bus.reconciler import send_work
from sandhold.domain import work as wk


async def test_an_instruction_sent_by_two_instances_reaches_the_host_once(
    nc: nats.NATS, nats_url: str, names: Names
):
    js = nc.jetstream()
    host = await _queue(js, names, "h1", saves=True)
    twin = await nats.connect(nats_url)
    try:
        save = wk.SaveSandboxWork(sandbox_id="sb-1", generation=1, save_id="sv-1")
        assert await send_work(js, names, "h1", save)  # stored
        (msg,) = await host.fetch(1, timeout=5)
        await msg.ack_sync()  # taken and gone from the work queue...
        # ...then the twin sends it: dropped, and the twin is told so.
        assert not await send_work(twin.jetstream(), names, "h1", save)
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


async def test_a_hosts_saves_come_in_a_queue_apart_from_its_other_work(nc: nats.NATS, names: Names):
    """Saves come in bursts (every changed sandbox each interval): a command sent
    after a burst is taken first all the same (decision 064)."""
    js = nc.jetstream()
    commands = await _queue(js, names, "h1")
    saves = await _queue(js, names, "h1", saves=True)
    for i in range(20):
        burst = wk.SaveSandboxWork(sandbox_id=f"sb-{i}", generation=1, save_id=f"sv-{i}")
        await send_work(js, names, "h1", burst)
    run = wk.RunCommandWork(sandbox_id="sb-0", generation=1, command_id="cmd-1", argv=["true"])
    await send_work(js, names, "h1", run)
    (first,) = await commands.fetch(1, timeout=5)
    assert b'"run_command"' in first.data
    info = await saves.consumer_info()
    assert info.num_pending == 20  # every save, in their own queue
    (save,) = await saves.fetch(1, timeout=5)
    assert b'"sv-0"' in save.data


async def _queue(
    js: JetStreamContext, names: Names, host: str, *, saves: bool = False
) -> JetStreamContext.PullSubscription:
    """A host's queue of work (or of saves), taken as its agent takes it."""
    durable = names.work_consumer(host, saves=saves)
    await js.add_consumer(
        names.hostwork_stream,
        ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=names.work(host, saves=saves),
        ),
    )
    return await js.pull_subscribe_bind(durable, names.hostwork_stream)
