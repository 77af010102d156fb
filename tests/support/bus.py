"""A nats-server for tests that run services on it directly (not through
`sandhold up`): the streams made by the admin, a credential per service."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any
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

from tests.support.procs import stopped
from tests.support.waiting import wait_until


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


@contextlib.asynccontextmanager
async def own_server(directory: Path, names: Names) -> AsyncIterator[tuple[NatsServer, nats.NATS]]:
    """A server of the test's own (one it may stop), its streams made, and an
    admin's connection to it; both ended with the block."""
    server = NatsServer(directory, names=names)
    server.start()
    conn = None
    try:
        await make_streams(server, names)
        conn = await nats.connect(server.admin_url)
        yield server, conn
    finally:
        if conn is not None:
            await conn.close()
        server.stop()


@contextlib.asynccontextmanager
async def not_answering(server: NatsServer) -> AsyncIterator[None]:
    """The server stopped (SIGSTOP) for the block, every thread of it: `kill()`
    returns before a multi-threaded process has stopped, and a request made at
    once was answered now and then."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        await wait_until(lambda: stopped(server.pid), timeout=30, what="the server stopped")
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


async def waiting_unanswered(
    start: Coroutine[Any, Any, None], caplog: Any, logger: str, what: str
) -> asyncio.Task[None]:
    """`start` begun, once it logged (on `logger`) that it has "no answer" and
    goes on asking; it fails saying what was logged if it ended instead."""
    with caplog.at_level(logging.WARNING, logger=logger):
        starting = asyncio.create_task(start)
        try:
            await wait_until(
                lambda: "no answer" in caplog.text or starting.done(), timeout=30, what=what
            )
        except AssertionError as err:
            raise AssertionError(f"{err}; logged: {caplog.text!r}") from None
        if starting.done():
            starting.result()  # (raises what ended it)
            raise AssertionError(f"started with the server stopped: {caplog.text!r}")
    return starting


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
