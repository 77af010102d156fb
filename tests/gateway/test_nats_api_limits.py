"""The gateway's NATS API under a flood: calls beyond what it holds are told
to retry at once (503, retryable) instead of piling up without bound; those
it holds are answered. A real nats-server; the app is a stand-in that holds
every call until released, so the calls in flight are known exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import nats
from sandhold.bus.names import Names
from sandhold.gateway.natsapi import NatsApi

from tests.support.waiting import wait_until

CALL = b'{"method": "GET", "path": "/api/v1/sandboxes"}'


async def test_calls_beyond_the_limit_are_refused_busy_and_the_rest_answered(
    nc: nats.NATS, names: Names
):
    release = asyncio.Event()
    entered = 0

    async def held_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal entered
        entered += 1
        await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})

    api = NatsApi(nc, names, held_app, max_calls=1, max_waiting=2)
    await api.start()
    try:
        subject = names.api("acme")
        held = [asyncio.ensure_future(nc.request(subject, CALL, timeout=30)) for _ in range(2)]
        # One runs, the other waits for its slot (a subscription's messages are
        # handled in order: both are held before the third arrives).
        await wait_until(lambda: entered == 1, timeout=10, what="the first call running")
        busy = msgspec.json.decode((await nc.request(subject, CALL, timeout=10)).data)
        assert busy["status"] == 503 and busy["body"]["code"] == "unavailable"
        assert busy["body"]["retryable"] is True
        assert entered == 1  # the second still waits for the one slot
        release.set()
        answers = [msgspec.json.decode(m.data) for m in await asyncio.gather(*held)]
        assert [a["status"] for a in answers] == [200, 200]
        assert entered == 2
    finally:
        release.set()
        await api.close()
