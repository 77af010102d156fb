"""A store's barrier: once `catch_up` returns, every event the log held when it was
called is folded, whoever appended it (another instance of the same service)."""

from __future__ import annotations

import nats
import pytest
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import sandbox as sb

from tests.twins.support import running_sandbox


async def test_catch_up_folds_what_another_instance_appended_a_moment_ago(
    nc: nats.NATS, nats_url: str, names: Names
):
    twin = await nats.connect(nats_url)
    try:
        store = AggregateStore(twin.jetstream(), names, "sandbox", sb.evolve, actor="saver")
        await store.start()
        ids = [await running_sandbox(nc, names, f"sb-{i}", "h1") for i in range(5)]
        await store.catch_up()  # no waiting after it: it is all there
        for sandbox_id in ids:
            state, seq = store.get(sandbox_id)
            assert state is not None and state.phase == "running"
            _, last = await AggregateStore(
                nc.jetstream(), names, "sandbox", sb.evolve, actor="test", follow=False
            ).sync(sandbox_id)
            assert seq == last
        await store.stop()
    finally:
        await twin.close()


async def test_a_follower_reaching_past_the_log_end_times_out(nc: nats.NATS, names: Names):
    follower = Follower(
        nc.jetstream(), names.events_stream, f"{names.prefix}.ev.>", bytes, lambda *_: None
    )
    await follower.start()
    try:
        await follower.reach(0, timeout=0.1)  # nothing to wait for
        with pytest.raises(TimeoutError):
            await follower.reach(1, timeout=0.2)
    finally:
        await follower.stop()
