"""A command dispatched to this host in the log, and a host agent to do its
work, for tests that drive `HostAgent._do` with a real server, driver and
supervisor (the `dispatch` fixture in conftest)."""

from __future__ import annotations

from pathlib import Path

import nats
from sandhold.bus import leases
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import read_range
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.envelope import Envelope
from sandhold.hostagent.driver import ProcessDriver
from sandhold.hostagent.service import HostAgent

from tests.support.waiting import wait_until
from tests.twins.support import append, running_sandbox


class Dispatched:
    """A command dispatched to this host in the log, and an agent to run it."""

    def __init__(
        self, nc: nats.NATS, names: Names, agent: HostAgent, sandbox_id: str, argv: list[str]
    ) -> None:
        self.nc, self.names, self.agent, self.sandbox_id = nc, names, agent, sandbox_id
        self.request = rq.RunCommand(key="run-1", sandbox_id=sandbox_id, argv=argv)
        self.command_id = rq.command_id_for(sandbox_id, self.request.key)
        self.work = wk.RunCommandWork(
            sandbox_id=sandbox_id, generation=1, command_id=self.command_id, argv=argv,
            request_key=self.request.key,
        )  # fmt: skip

    async def events(self) -> list[Envelope]:
        records = await read_range(
            self.nc.jetstream(),
            self.names.events_stream,
            self.names.events("sandbox", self.sandbox_id),
            decode_envelope,
        )
        return [envelope for _, _, envelope in records]

    async def last_types(self, count: int) -> list[str]:
        return [envelope.type for envelope in await self.events()][-count:]

    async def decided(self, request: rq.AnyRequest) -> None:
        """A client's request on the sandbox, decided and appended as the
        scheduler would."""
        log = AggregateStore(
            self.nc.jetstream(), self.names, "sandbox", sb.evolve, actor="t", follow=False
        )
        state, _ = await log.sync(self.sandbox_id)
        await append(self.nc, self.names, "sandbox", self.sandbox_id, sb.decide(state, request))

    async def ended(self) -> None:
        await wait_until(lambda: not self.agent._watchers, timeout=30, what="the end reported")


async def dispatched(
    nc: nats.NATS,
    nats_url: str,
    names: Names,
    driver: ProcessDriver,
    host_id: str,
    root: Path,
    argv: list[str],
) -> Dispatched:
    """A sandbox running here, a command run on it (queued and dispatched by
    one event, decision 098), and an agent that has not seen its work yet."""
    sandbox_id = await running_sandbox(nc, names, "start-first", host_id)
    agent = HostAgent(nats_url, names, host_id=host_id, root=root)
    command = Dispatched(nc, names, agent, sandbox_id, argv)
    await command.decided(command.request)
    await driver.create_sandbox(sandbox_id, None)
    agent.driver = driver
    agent._nc, agent._js = nc, nc.jetstream()
    agent.sandboxes = AggregateStore(
        nc.jetstream(), names, "sandbox", sb.evolve, actor=f"host-agent:{host_id}",
        follow=False, compact=sb.compact,
    )  # fmt: skip
    agent._kv = await leases.lease_bucket(nc.jetstream(), names)
    agent.epoch = 1
    await agent._put_lease()
    return command
