"""A nats-server for tests that run services on it directly (not through
`sandhold up`): the streams made by the admin, a credential per service."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from urllib.parse import urlparse

import msgspec
import nats
from sandhold.bus import credentials
from sandhold.bus.names import Names
from sandhold.bus.permissions import inbox_prefix
from sandhold.bus.server import NatsServer
from sandhold.bus.store import AggregateStore
from sandhold.bus.streams import ensure_streams
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb


def credential_file(server: NatsServer, role: str, host: str | None = None) -> Path:
    """`role`'s credential for `server` (issue it before the server starts, or
    `server.reload()` after)."""
    made = credentials.issue(server.credentials_dir, role, host=host)
    return credentials.path_of(server.credentials_dir, made.user)


async def make_streams(server: NatsServer, names: Names) -> None:
    """What `sandhold up` does first, as the admin: services only wait for them."""
    nc = await nats.connect(server.admin_url)
    try:
        await ensure_streams(nc.jetstream(), names)
    finally:
        await nc.close()


async def create_sandbox(store: AggregateStore[sb.Sandbox], key: str) -> str:
    """A sandbox created through `store` as the scheduler creates one (`decide`,
    then the fenced append); its id."""
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


async def hello(url: str, connect: dict[str, object]) -> bytes:
    """The server's answer to a CONNECT: `+OK` or `-ERR '…'` (the protocol's first
    step, by hand: a refused nats-py connect leaves its socket for the garbage
    collector). Verbose, so the answer needs nothing more sent: a second write
    could reach a server that already closed and draw a reset that discards
    its `-ERR` before it is read."""
    port = urlparse(url).port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        writer.write(b"CONNECT " + json.dumps({"verbose": True, **connect}).encode() + b"\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        await writer.wait_closed()


async def assert_refused_as_malformed(
    url: str, subject: str, base: dict, cases: list[tuple[dict, str]]
) -> None:
    """Each of `base` with a case's fields over it, published raw to `subject`
    as the operator, is answered `malformed_request` with a message naming the
    case's words."""
    nc = await nats.connect(url, inbox_prefix=inbox_prefix("operator"))
    try:
        for fields, says in cases:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox, max_msgs=1)
            body = {**base, **fields, "key": uuid.uuid4().hex}
            await nc.jetstream().publish(
                subject, msgspec.json.encode(body), headers={"Sh-Reply": inbox}
            )
            reply = msgspec.json.decode((await sub.next_msg(timeout=20)).data)
            assert reply["ok"] is False and reply["error"]["code"] == "malformed_request", fields
            assert says in reply["error"]["message"], reply
    finally:
        await nc.close()


async def ready_announcements(nc: nats.NATS, names: Names | None = None) -> list[bytes]:
    """A list that fills with each service's readiness announcement from now on."""
    ready: list[bytes] = []

    async def on_ready(msg) -> None:
        ready.append(msg.data)

    await nc.subscribe((names or Names()).ready, cb=on_ready)
    await nc.flush()
    return ready
