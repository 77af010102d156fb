"""A NATS connection as every sandhold process makes one: as its own user,
with its own inbox, reconnecting for ever and saying so quietly. Kept apart
from the service shell so the CLI and the client library connect without
importing what only services need."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import nats
from nats.aio.client import Client as NATS
from sandhold.bus import credentials as creds
from sandhold.bus.credentials import Credentials
from sandhold.bus.permissions import inbox_prefix

log = logging.getLogger("sandhold.bus.service")


async def connect(
    url: str | list[str], *, name: str, credentials: Credentials | None = None
) -> NATS:
    """A connection that keeps trying (a server that is not up yet, or gone for a
    while), saying so once every few seconds rather than twice a second.

    It connects as `credentials`, else as the user in the URL, else as the one
    in `SANDHOLD_NATS_CREDENTIALS` (`--credentials`); its inbox is that user's
    own (`_INBOX.<user>.…`), the only one its permissions let it read."""
    servers = url if isinstance(url, list) else url.split(",")
    credentials = credentials or creds.from_environment()
    user = credentials.user if credentials else creds.user_in_url(servers[0])
    login: dict[str, Any] = {}
    if credentials is not None:
        login = {"user": credentials.user, "password": credentials.password}
    elif user is not None:
        # Given in the URL: also for the nodes a cluster announces, whose URLs
        # carry none (else each reconnection tries them without, and is refused).
        login = {"user": user, "password": creds.password_in_url(servers[0])}
    if user is not None:
        login["inbox_prefix"] = inbox_prefix(user)
    quiet = _QuietErrors(name)
    quiet.user = user
    quiet.nc = await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        # Several servers are a cluster's nodes, in the order this process
        # prefers them (`sandhold up --nodes 3` spreads instances over nodes).
        dont_randomize=True,
        error_cb=quiet.error,
        disconnected_cb=quiet.disconnected,
        reconnected_cb=quiet.reconnected,
        **login,
    )
    return quiet.nc


class _QuietErrors:
    """nats-py's callbacks, logged in one line each, a repeated error every 10 s."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._last: tuple[str, float] = ("", 0.0)
        self.nc: NATS | None = None
        self.user: str | None = None

    async def error(self, err: Exception) -> None:
        said, at = self._last
        now = asyncio.get_running_loop().time()
        text = f"{type(err).__name__}: {err}"
        if text != said or now - at > 10.0:
            self._last = (text, now)
            hint = ""
            if "authorization violation" in text.lower():
                hint = (
                    f" (connecting as {self.user or 'no user'}: give this process its own "
                    f"credential, --credentials FILE or ${creds.ENV}; docs/security.md)"
                )
            log.warning("%s: NATS: %s%s", self._name, text, hint)

    async def disconnected(self) -> None:
        if self.nc is not None and self.nc.is_closed:
            return  # closed on purpose: nothing to reconnect
        log.warning("%s: disconnected from NATS; reconnecting", self._name)

    async def reconnected(self) -> None:
        self._last = ("", 0.0)
        log.warning("%s: reconnected to NATS", self._name)


async def close_quickly(nc: NATS, *stores: object) -> None:
    """Unsubscribe the stores' consumers, flush what we published, then close.

    Not `drain()`: draining an ordered consumer can make nats-py try to recreate
    it against a connection that no longer takes requests, which stalls shutdown.
    """
    for store in stores:
        stop = getattr(store, "stop", None)
        if stop is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(stop(), 2)
    with contextlib.suppress(Exception):
        await nc.flush(timeout=2)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5)
