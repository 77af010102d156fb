"""A store's barrier: once `catch_up` returns, every event the log held when it was
called is folded, whoever appended it (another instance of the same service)."""

from __future__ import annotations

import nats
import pytest
from sandhold.bus.follow import Follower
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb

from tests.twins.support import append, running_sandbox


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


async def test_sync_expecting_news_folds_every_new_event_in_order(nc: nats.NATS, names: Names):
    """A host's read before it acts on an instruction (`news_expected`): the first
    new event is read alongside the last sequence, the rest after it, none twice
    and none skipped, so the state is the log's and the next append's fence right."""
    reader = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="host", follow=False)
    sandbox_id = await running_sandbox(nc, names, "news", "h1")
    state, seq = await reader.sync(sandbox_id, from_leader=True, news_expected=True)
    whole, last = await reader.read_whole(sandbox_id)
    assert (state, seq) == (whole, last) and state is not None and state.phase == "running"
    # More by another writer, as before a run instruction: each folded once, in order.
    queued = sb.decide(state, rq.RunCommand(key="run-1", sandbox_id=sandbox_id, argv=["true"]))
    (command_id,) = [e.command_id for e in queued if isinstance(e, ev.CommandQueued)]
    await append(nc, names, "sandbox", sandbox_id, queued)
    dispatched = ev.CommandDispatched(command_id=command_id, host="h1", generation=1)
    await append(nc, names, "sandbox", sandbox_id, [dispatched])
    state, seq = await reader.sync(sandbox_id, from_leader=True, news_expected=True)
    whole, last = await reader.read_whole(sandbox_id)
    assert (state, seq) == (whole, last) and state is not None
    assert state.commands[command_id].state == "dispatched"
    assert reader.folded == 0  # nothing follows here: every event came through sync


async def test_sync_expecting_news_when_there_is_none_changes_nothing(nc: nats.NATS, names: Names):
    reader = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="host", follow=False)
    sandbox_id = await running_sandbox(nc, names, "no-news", "h1")
    before = await reader.sync(sandbox_id)
    assert await reader.sync(sandbox_id, from_leader=True, news_expected=True) == before
    # Nor for a subject that has no event at all.
    assert await reader.sync("sb-none", news_expected=True) == (None, 0)
