"""Two pieces every deciding service shares: a loop that reconciles aggregates
marked dirty, and sending an instruction to a host's work queue."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.api import Header
from sandhold.bus.names import Names
from sandhold.domain.work import AnyWork

log = logging.getLogger(__name__)

_work_encoder = msgspec.json.Encoder()


class DirtyLoop:
    """Calls `handle(aggregate_id)` for every id marked since the last pass.

    Marking twice before a pass handles it once; a handler that raises is
    logged and the id is tried again half a second later.
    """

    def __init__(self, handle: Callable[[str], Awaitable[None]], *, what: str) -> None:
        self._handle = handle
        self._what = what
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()

    def mark(self, aggregate_id: str) -> None:
        self._dirty.add(aggregate_id)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                aggregate_id = self._dirty.pop()
                try:
                    await self._handle(aggregate_id)
                except Exception:
                    log.exception("%s of %s failed; will retry", self._what, aggregate_id)
                    await asyncio.sleep(0.5)
                    self.mark(aggregate_id)


async def send_work(js: JetStreamContext, names: Names, host: str, work: AnyWork) -> None:
    """Publish to `<prefix>.work.<host>`; the deterministic id makes a resend harmless."""
    await js.publish(
        names.work(host),
        _work_encoder.encode(work),
        stream=names.hostwork_stream,
        headers={Header.MSG_ID: work.msg_id},
    )
