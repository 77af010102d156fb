"""The host-agent's own lease clock, against a real nats-server paused mid-put:
the lease counts from when a renewal is offered, as its `renewed_at` and
recovery count it, never from when a slow acknowledgement arrived."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
from sandhold.bus import leases
from sandhold.bus.names import Names
from sandhold.bus.server import NatsServer
from sandhold.hostagent.service import HostAgent

from tests.support.bus import make_streams
from tests.support.waiting import wait_until

_PAUSE_S = 1.5
_TTL_S = 1.0


@contextlib.asynccontextmanager
async def agent_on_a_server(
    tmp_path: Path, **settings: float
) -> AsyncIterator[tuple[NatsServer, HostAgent]]:
    """A real server with its streams, and a host-agent (epoch 1) holding only
    its lease bucket: the lease clock without the rest of the agent."""
    names = Names()
    server = NatsServer(tmp_path / "nats", names=names)
    server.start()
    try:
        await make_streams(server, names)
        nc = await nats.connect(server.admin_url)
        try:
            agent = HostAgent(server.url, names, host_id="h1", root=tmp_path / "root", **settings)
            agent._kv = await leases.lease_bucket(nc.jetstream(), names)
            agent.epoch = 1
            yield server, agent
        finally:
            await nc.close()
    finally:
        server.stop()


async def test_a_renewal_acknowledged_after_its_ttl_leaves_the_agent_expired(tmp_path: Path):
    async with agent_on_a_server(tmp_path, lease_ttl=_TTL_S) as (server, agent):
        await agent._put_lease()
        assert not agent._lease_expired()

        assert server.pid is not None
        offered = time.monotonic()
        os.kill(server.pid, signal.SIGSTOP)  # the put is offered, its ack held back
        try:
            renewal = asyncio.create_task(agent._put_lease())
            await asyncio.sleep(_PAUSE_S)  # the pause under test, not a wait for an event
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await asyncio.wait_for(renewal, 10)
    # Acknowledged only after the TTL: the lease it wrote is already older than
    # the TTL by its own `renewed_at`, so the agent must count itself expired.
    assert agent._last_renewed is not None and agent._last_renewed <= offered + 0.5
    assert time.time() - agent._last_renewed_at > _TTL_S
    assert agent._lease_expired()
    # and it looks again at that deadline, not a whole interval later
    assert agent._until_next_check() <= 0.02


async def test_a_stray_cancellation_in_a_renewal_does_not_end_the_renewing(tmp_path: Path):
    """A cancellation that escapes a renewal (one meant for an await inside it)
    is not the agent stopping: the loop renews on; a real cancel still ends it."""
    async with agent_on_a_server(tmp_path, lease_ttl=10.0, lease_interval=0.05) as (_, agent):
        real, puts = agent._put_lease, []

        async def first_one_cancelled() -> None:
            puts.append(time.monotonic())
            if len(puts) == 1:
                raise asyncio.CancelledError
            await real()

        agent._put_lease = first_one_cancelled  # type: ignore[method-assign]
        renewing = asyncio.create_task(agent._renew_lease())
        try:
            await wait_until(lambda: len(puts) >= 3, timeout=10, what="renewals after it")
            assert not renewing.done() and agent._last_renewed is not None
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(renewing, 10)
        assert renewing.cancelled()
