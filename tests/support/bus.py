"""A nats-server for tests that run services on it directly (not through
`sandhold up`): the streams made by the admin, a credential per service."""

from __future__ import annotations

from pathlib import Path

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
