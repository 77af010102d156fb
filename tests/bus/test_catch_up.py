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
    new event is read alongside the subject's last, the rest after them, none
    twice and none skipped, whether one, two or several are new, or a message
    that is no event lies between: the state is the log's, the next fence right."""
    reader = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="host", follow=False)
    reads = counting_reads(reader)
    sandbox_id = await running_sandbox(nc, names, "news", "h1")

    async def synced_as_the_log_has_it() -> sb.Sandbox:
        state, seq = await reader.sync(sandbox_id, from_leader=True, news_expected=True)
        assert (state, seq) == await reader.read_whole(sandbox_id)
        assert state is not None
        return state

    state = await synced_as_the_log_has_it()  # four new, from nothing
    # Two new, as before a run instruction (queued, dispatched): one round trip,
    # the last event naming the first as the one before it.
    command_id = await queue_and_dispatch(nc, names, state, "run-1")
    reads.clear()
    state = await synced_as_the_log_has_it()
    assert state.commands[command_id].state == "dispatched"
    assert reads == [state_seq(reader, sandbox_id) - 1], "the first new one only"
    # One new: it is both the first and the last.
    started = ev.CommandStarted(command_id=command_id, host="h1", generation=1, pid=7)
    await append(nc, names, "sandbox", sandbox_id, [started])
    reads.clear()
    state = await synced_as_the_log_has_it()
    assert state.commands[command_id].state == "running" and len(reads) == 1
    # Several new, with a message that is no event among them (no fence).
    command_id = await queue_and_dispatch(nc, names, state, "run-2")
    await nc.jetstream().publish(names.events("sandbox", sandbox_id), b"not an event")
    ended = ev.CommandEnded(command_id=command_id, state="exited", exit_code=0, host="h1",
                            generation=1)  # fmt: skip
    await append(nc, names, "sandbox", sandbox_id, [ended])
    state = await synced_as_the_log_has_it()
    assert command_id not in state.commands or state.commands[command_id].ended
    assert reader.folded == 0  # nothing follows here: every event came through sync


def counting_reads(store: AggregateStore[sb.Sandbox]) -> list[int]:
    """The sequences `store` asks the subject's next message from, as asked."""
    reads: list[int] = []
    read = store._next_msg

    async def counted(subject: str, seq: int):  # type: ignore[no-untyped-def]
        reads.append(seq)
        return await read(subject, seq)

    store._next_msg = counted  # type: ignore[method-assign]
    return reads


def state_seq(store: AggregateStore[sb.Sandbox], sandbox_id: str) -> int:
    """The sequence of the last event the store folded of a sandbox."""
    return store.get(sandbox_id)[1]


async def queue_and_dispatch(nc: nats.NATS, names: Names, state: sb.Sandbox, key: str) -> str:
    queued = sb.decide(state, rq.RunCommand(key=key, sandbox_id=state.id, argv=["true"]))
    (command_id,) = [e.command_id for e in queued if isinstance(e, ev.CommandQueued)]
    await append(nc, names, "sandbox", state.id, queued)
    dispatched = ev.CommandDispatched(command_id=command_id, host="h1", generation=1)
    await append(nc, names, "sandbox", state.id, [dispatched])
    return command_id


async def test_sync_expecting_news_when_there_is_none_changes_nothing(nc: nats.NATS, names: Names):
    reader = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="host", follow=False)
    sandbox_id = await running_sandbox(nc, names, "no-news", "h1")
    before = await reader.sync(sandbox_id)
    assert await reader.sync(sandbox_id, from_leader=True, news_expected=True) == before
    # Nor for a subject that has no event at all.
    assert await reader.sync("sb-none", news_expected=True) == (None, 0)
