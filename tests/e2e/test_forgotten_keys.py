"""A retry is known as one however late it comes (decision 085): after thousands
of later requests, a compacted sandbox holds the first request's key only in a
fingerprint, and the scheduler decides the retry on the sandbox read back whole."""

from __future__ import annotations

import asyncio
import secrets

import msgspec
from nats.js.errors import NotFoundError
from sandhold.bus.names import Names
from sandhold.client import Client, connect
from sandhold.domain import fingerprints
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb

from tests.e2e.conftest import running_sandbox
from tests.e2e.harness import Up
from tests.e2e.test_connections import _read


async def _two_blocks_later(client: Client, sandbox_id: str, key: str) -> None:
    """Two blocks of later requests, each with a key of its own: as every
    service compacts the sandbox, `key` is then kept as a fingerprint only."""
    room = asyncio.Semaphore(32)

    async def touch(i: int) -> None:
        async with room:
            await client.touch_sandbox(sandbox_id, key=f"touch-{i}")

    await asyncio.gather(*(touch(i) for i in range(2 * fingerprints.BLOCK)))
    state = None
    for record in await client.sandbox_records(sandbox_id):
        state = sb.compact(sb.evolve(state, record.envelope))
    assert state is not None and state.forgotten_keys
    assert sb.remembers(state, key) is None, "not held exactly: only the log can say"


async def test_a_run_retried_after_two_blocks_of_requests_is_the_same_command(
    up: Up, client: Client
):
    sandbox_id = await running_sandbox(client)
    value = secrets.token_hex(16)
    argv = ["sh", "-c", 'test -n "$T" && echo x >> count']
    first = await client.exec(sandbox_id, argv, key="first", secrets={"T": value})
    assert first.command.state == "exited" and first.command.exit_code == 0

    await _two_blocks_later(client, sandbox_id, "first")

    again = await client.exec(sandbox_id, argv, key="first", secrets={"T": value})
    assert again.command.id == first.command.id
    assert again.command.state == "exited" and again.command.exit_code == 0
    assert (await client.exec(sandbox_id, ["cat", "count"])).stdout == b"x\n", "ran once"
    async with await connect(up.admin_url) as admin:  # only the admin may read them
        names = Names("sh")
        try:
            await admin.js.get_last_msg(names.secrets_stream, names.secret(first.command.id))
        except NotFoundError:
            pass
        else:
            raise AssertionError("the retry's secrets were kept again, for a command that ran")
    # A new key is decided on what is kept, as before: a new command.
    new = await client.exec(sandbox_id, ["true"], key="second")
    assert new.command.id != first.command.id and new.command.exit_code == 0


async def test_a_connection_set_again_late_under_its_key_keeps_the_first_value(
    up: Up, client: Client
):
    """A retry with another value is the same request (its digest covers the
    name): answered as the first, and the value kept for the sandbox is still
    the first one's, not overwritten by the retry's."""
    sandbox_id = await running_sandbox(client)
    await client.set_connection(sandbox_id, "k", "v1", key="set-k")
    await _two_blocks_later(client, sandbox_id, "set-k")
    again = await client.set_connection(sandbox_id, "k", "v2", key="set-k")
    assert again.connections == ["k"]
    sets = [
        r for r in await client.sandbox_records(sandbox_id) if r.envelope.type == "connection.set"
    ]
    assert len(sets) == 1, "the retry appended nothing"
    names = Names("sh")
    subject = names.connection(sandbox_id, rq.connection_value_id(sandbox_id, "set-k"))
    async with await connect(up.admin_url) as admin:  # only the admin may read them
        kept = await admin.js.get_last_msg(names.connections_stream, subject)
    assert msgspec.json.decode(kept.data) == {"value": "v1"}
    assert await _read(client, sandbox_id, "k") == b"v1"
