"""Services forget a deleted sandbox nothing is left of (decision 061), and
what they kept beside it goes too: a scheduler removes its Connections'
values, at once or at its next start; the orchestrator's wait for it still
ends, on the state the log has."""

from __future__ import annotations

import asyncio

import nats
from sandhold.bus import secret_store
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.client import connect
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.orchestrator.sandboxes import Sandboxes
from sandhold.scheduler.service import Scheduler

from tests.support.waiting import wait_until
from tests.twins.support import Running, append, running_sandbox


async def _connections(nc: nats.NATS, names: Names, sandbox_id: str) -> list[str]:
    return await secret_store.held(
        nc.jetstream(), names, names.connections_of(sandbox_id), stream=names.connections_stream
    )


async def test_a_deleted_sandbox_the_scheduler_forgets_takes_its_connections_with_it(
    nc: nats.NATS, nats_url: str, names: Names
):
    running = Running()
    client = await connect(nats_url, prefix=names.prefix)
    try:
        scheduler = running.start(Scheduler(nats_url, names))
        # No host: it stays pending, and a delete deletes it at once (no save).
        view = await client.create_sandbox(key="short-lived")
        sandbox_id = view.id
        await client.set_connection(sandbox_id, "github", "ghp_value", key="conn-1")
        assert len(await _connections(nc, names, sandbox_id)) == 1
        await client.delete_sandbox(sandbox_id, key="delete-1")
        await wait_until(
            lambda: scheduler.sandboxes.forgotten == 1,
            timeout=30,
            what="the scheduler to forget the deleted sandbox",
        )
        assert scheduler.sandboxes.get(sandbox_id) == (None, 0)
        assert sandbox_id not in scheduler.sandboxes.ids()

        async def purged() -> bool:
            return await _connections(nc, names, sandbox_id) == []

        await wait_until(purged, timeout=30, what="its Connection's value removed")
        await wait_until(
            lambda: not scheduler._leftovers, timeout=10, what="nothing left to remove"
        )
        assert sandbox_id not in scheduler._secrets_held
        assert sandbox_id not in scheduler._connections_forgotten
        # Requests to it are still answered from its log: a retry as a retry,
        # anything else refused as for a deleted sandbox (not "no such sandbox").
        again = await client.delete_sandbox(sandbox_id, key="delete-1")
        assert again.phase == "deleted"
        try:
            await client.set_connection(sandbox_id, "github", "other", key="conn-2")
        except Exception as err:  # noqa: BLE001 - its code is what is checked
            assert getattr(err, "code", "") == "sandbox_deleted", err
        else:
            raise AssertionError("a deleted sandbox takes no Connection")
        assert await _connections(nc, names, sandbox_id) == []
    finally:
        await client.close()
        await running.close()


async def test_connections_a_forgotten_sandbox_left_are_removed_at_the_next_start(
    nc: nats.NATS, nats_url: str, names: Names
):
    """A scheduler that stopped between forgetting a sandbox and removing its
    values (nothing of it in its checkpoint, and the values never expire)."""
    js = nc.jetstream()
    alive = await running_sandbox(nc, names, "alive", "h1")
    gone = await running_sandbox(nc, names, "gone", "h1")
    await append(
        nc, names, "sandbox", gone,
        [
            ev.SandboxDeleteRequested(request_key="gone-delete", request_digest="d"),
            ev.SandboxDeleted(host="h1", generation=1),
        ],
    )  # fmt: skip
    stream = names.connections_stream
    for sandbox_id in (alive, gone):
        await secret_store.keep(
            js, names, names.connection(sandbox_id, "v1"), {"github": "x"}, stream=stream
        )
    running = Running()
    try:
        scheduler = running.start(Scheduler(nats_url, names))

        async def removed() -> bool:
            return await _connections(nc, names, gone) == []

        await wait_until(removed, timeout=30, what="the forgotten sandbox's values removed")
        assert scheduler.sandboxes.get(gone) == (None, 0)
        assert len(await _connections(nc, names, alive)) == 1, "a live sandbox's stay"
    finally:
        await running.close()


async def test_a_wait_for_a_sandbox_that_is_forgotten_ends_on_what_the_log_has(
    nc: nats.NATS, names: Names
):
    store: AggregateStore[sb.Sandbox] = AggregateStore(
        nc.jetstream(), names, "sandbox", sb.evolve, actor="test",
        compact=sb.compact, forget=sb.forgettable,
    )  # fmt: skip
    sandbox_id = await running_sandbox(nc, names, "waited-on", "h1")
    await store.start()
    try:
        sandboxes = Sandboxes(nc, names, store)
        waiting = asyncio.ensure_future(
            sandboxes.wait(sandbox_id, lambda s: s if s.phase == "deleted" else None, timeout=30)
        )
        await asyncio.sleep(0)  # (it looks once: running)
        assert not waiting.done()
        await append(
            nc, names, "sandbox", sandbox_id,
            [
                ev.SandboxDeleteRequested(request_key="d-1", request_digest="d"),
                ev.SandboxDeleted(host="h1", generation=1),
            ],
        )  # fmt: skip
        deleted = await waiting
        assert deleted.phase == "deleted" and store.get(sandbox_id) == (None, 0)
        assert sandboxes._changed == {}, "nothing kept once no one waits"
        # A wait begun after it was forgotten ends too.
        late = await sandboxes.wait(sandbox_id, lambda s: s.id, timeout=30)
        assert late == sandbox_id and rq.sandbox_id_for("default", "waited-on") == late
    finally:
        await store.stop()


async def test_a_retried_create_from_a_seed_is_answered_once_its_sandbox_is_forgotten(
    nc: nats.NATS, nats_url: str, names: Names
):
    """The seed's manifest went with the sandbox's other saves (decision 060):
    the retry is known by its sandbox's log, not refused `seed_not_found`."""
    create = rq.CreateSandbox(key="from-seed", tenant="default", seed="sv-5eed000000000000")
    sandbox_id = rq.sandbox_id_for("default", create.key)
    await append(
        nc, names, "sandbox", sandbox_id,
        [
            *sb.decide(None, create),
            ev.SandboxDeleteRequested(request_key="seed-delete", request_digest="d"),
            ev.SandboxDeleted(host=None, generation=0),
        ],
    )  # fmt: skip
    running = Running()
    client = await connect(nats_url, prefix=names.prefix)
    try:
        scheduler = running.start(Scheduler(nats_url, names))
        reply = await client.send(create)
        assert reply.ok and reply.sandbox is not None, reply
        assert reply.sandbox.id == sandbox_id and reply.sandbox.phase == "deleted"
        assert scheduler.sandboxes.get(sandbox_id) == (None, 0)
    finally:
        await client.close()
        await running.close()
