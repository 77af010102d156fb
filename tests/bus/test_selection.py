"""A store's selection (`AggregateStore.select`): the aggregates whose state
passes a test, kept in step with the log on a real nats-server, so periodic
passes (the scheduler's sweep, the saver's schedule, recovery's tick) look at
those and not at every aggregate the log ever held."""

from __future__ import annotations

from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import sandbox as sb

from tests.support.bus import create_sandbox
from tests.support.waiting import wait_until


async def _append(store: AggregateStore[sb.Sandbox], sandbox_id: str, event: ev.AnyEvent) -> None:
    tag = f"{event.__struct_config__.tag}:{store.get(sandbox_id)[1]}"
    await store.execute(
        sandbox_id, lambda s: [event], id_base=tag, causation_id=tag, correlation_id=tag
    )


async def _place(store: AggregateStore[sb.Sandbox], sandbox_id: str, host: str = "h1") -> None:
    state, _ = store.get(sandbox_id)
    generation = state.generation + 1 if state is not None else 1
    await _append(store, sandbox_id, ev.SandboxPlaced(host=host, generation=generation))


async def test_a_selection_holds_what_passes_now_and_follows_every_change(nc, names: Names):
    js = nc.jetstream()
    writer = AggregateStore(js, names, "sandbox", sb.evolve, actor="writer")
    reader = AggregateStore(js, names, "sandbox", sb.evolve, actor="reader")
    await writer.start()
    early = await create_sandbox(writer, "early")  # pending: waits for room on a host
    placed = await create_sandbox(writer, "placed")
    await _place(writer, placed)
    await reader.start()
    # Made after the states are held: it starts with those that pass.
    waiting = reader.select(sb.waits_outside_its_log)
    assert waiting.ids() == [early]
    # Then it follows the log: a new pending sandbox joins, a placed one leaves.
    late = await create_sandbox(writer, "late")
    await wait_until(lambda: late in waiting.ids(), timeout=10, what="the new sandbox selected")
    await _place(writer, early)
    await wait_until(lambda: early not in waiting.ids(), timeout=10, what="the placed one left")
    assert waiting.ids() == [late] and len(waiting) == 1
    assert len(reader.ids()) == 3  # the store still holds all of them
    await reader.stop()
    await writer.stop()


async def test_a_grouping_counts_the_places_on_each_host_as_sandboxes_move(nc, names: Names):
    js = nc.jetstream()
    writer = AggregateStore(js, names, "sandbox", sb.evolve, actor="writer")
    reader = AggregateStore(js, names, "sandbox", sb.evolve, actor="reader")
    await writer.start()
    a, b = await create_sandbox(writer, "a"), await create_sandbox(writer, "b")
    await _place(writer, a, "h1")
    await reader.start()
    on = reader.group(sb.placed_on)
    assert on.sizes() == {"h1": 1} and on.members("h1") == {a}
    await _place(writer, b, "h1")
    await wait_until(lambda: on.sizes() == {"h1": 2}, timeout=10, what="b placed on h1")
    # a's host is lost: it holds no place anywhere until it is placed again
    lost = ev.SandboxLost(host="h1", generation=1, last_renewal_at=0.0, fence_at=0.0)
    await _append(writer, a, lost)
    await wait_until(lambda: on.members("h1") == {b}, timeout=10, what="a's place given up")
    await _append(writer, a, ev.SandboxRecoveryRequested(cause="command"))
    await _place(writer, a, "h2")
    await wait_until(lambda: on.sizes() == {"h1": 1, "h2": 1}, timeout=10, what="a placed on h2")
    assert on.members("h2") == {a} and on.members("h3") == set()
    await reader.stop()
    await writer.stop()
