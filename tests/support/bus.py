"""A nats-server for tests that run services on it directly (not through
`sandhold up`): the streams made by the admin, a credential per service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlparse

import nats
from sandhold.bus import credentials
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer
from sandhold.bus.streams import ensure_streams


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
