"""A store's selection (`AggregateStore.select`): the aggregates whose state
passes a test, kept in step with the log on a real nats-server, so periodic
passes (the scheduler's sweep, the saver's schedule, recovery's tick) look at
those and not at every aggregate the log ever held."""

from __future__ import annotations

from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb

from tests.support.waiting import wait_until


async def _create(store: AggregateStore[sb.Sandbox], key: str) -> str:
    create = rq.CreateSandbox(key=key)
    sandbox_id = sb.aggregate_of(create)
    await store.execute(
        sandbox_id,
        lambda s: sb.decide(s, create),
        id_base=key,
        causation_id=key,
        correlation_id=key,
    )
    return sandbox_id


async def _place(store: AggregateStore[sb.Sandbox], sandbox_id: str) -> None:
    placed = ev.SandboxPlaced(host="h1", generation=1)
    await store.execute(
        sandbox_id, lambda s: [placed], id_base="p", causation_id="p", correlation_id="p"
    )


async def test_a_selection_holds_what_passes_now_and_follows_every_change(nc, names: Names):
    js = nc.jetstream()
    writer = AggregateStore(js, names, "sandbox", sb.evolve, actor="writer")
    reader = AggregateStore(js, names, "sandbox", sb.evolve, actor="reader")
    await writer.start()
    early = await _create(writer, "early")  # pending: waits for room on a host
    placed = await _create(writer, "placed")
    await _place(writer, placed)
    await reader.start()
    # Made after the states are held: it starts with those that pass.
    waiting = reader.select(sb.waits_outside_its_log)
    assert waiting.ids() == [early]
    # Then it follows the log: a new pending sandbox joins, a placed one leaves.
    late = await _create(writer, "late")
    await wait_until(lambda: late in waiting.ids(), timeout=10, what="the new sandbox selected")
    await _place(writer, early)
    await wait_until(lambda: early not in waiting.ids(), timeout=10, what="the placed one left")
    assert waiting.ids() == [late] and len(waiting) == 1
    assert len(reader.ids()) == 3  # the store still holds all of them
    await reader.stop()
    await writer.stop()
