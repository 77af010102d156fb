"""A command is watched from its launch, while its start is being reported; its
end is reported only after its start, even when that report failed once and
the instruction had to come again (a real server, driver and supervisor)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
from sandhold.bus import leases
from sandhold.bus.codec import decode_envelope
from sandhold.bus.follow import read_range
from sandhold.bus.names import Names
from sandhold.bus.store import AggregateStore
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.errors import InfraError
from sandhold.hostagent.driver import ProcessDriver
from sandhold.hostagent.service import HostAgent

from tests.support.waiting import wait_until
from tests.twins.support import append, running_sandbox


async def test_the_end_waits_for_a_start_whose_report_failed_once(
    nc: nats.NATS, nats_url: str, names: Names, driver: ProcessDriver, host_id: str, root: Path
):
    sandbox_id = await running_sandbox(nc, names, "start-first", host_id)
    request = rq.RunCommand(key="run-1", sandbox_id=sandbox_id, argv=["true"])
    log = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="t", follow=False)
    state, _ = await log.sync(sandbox_id)
    queued = sb.decide(state, request)
    await append(nc, names, "sandbox", sandbox_id, queued)
    command_id = rq.command_id_for(sandbox_id, request.key)
    dispatched = ev.CommandDispatched(command_id=command_id, host=host_id, generation=1)
    await append(nc, names, "sandbox", sandbox_id, [dispatched])
    await driver.create_sandbox(sandbox_id, None)

    agent = HostAgent(nats_url, names, host_id=host_id, root=root)
    agent.driver = driver
    agent._nc, agent._js = nc, nc.jetstream()
    agent.sandboxes = AggregateStore(
        nc.jetstream(), names, "sandbox", sb.evolve, actor=f"host-agent:{host_id}",
        follow=False, compact=sb.compact,
    )  # fmt: skip
    agent._kv = await leases.lease_bucket(nc.jetstream(), names)
    agent.epoch = 1
    await agent._put_lease()
    reports: list[str] = []
    report = agent._report

    async def first_start_report_fails(sandbox: str, event: Any, cause: str) -> None:
        reports.append(event.__struct_config__.tag)
        if reports == ["command.started"]:
            raise InfraError("the bus did not answer", retryable=True)
        await report(sandbox, event, cause)

    agent._report = first_start_report_fails  # type: ignore[method-assign]
    work = wk.RunCommandWork(
        sandbox_id=sandbox_id, generation=1, command_id=command_id, argv=["true"],
        request_key=request.key,
    )  # fmt: skip
    try:
        try:
            await agent._do(work)
            raise AssertionError("the failed start report reaches the work queue (a retry)")
        except InfraError:
            pass
        handle = driver.handle(sandbox_id, command_id)
        await asyncio.wait_for(handle.wait(), 30)  # `true` has ended: its end is known
        assert reports == ["command.started"], "nothing reported before the start"
        await agent._do(work)  # the instruction again, as the queue redelivers it
        await wait_until(
            lambda: not agent._watchers, timeout=30, what="the end reported after the start"
        )
    finally:
        for watcher in list(agent._watchers.values()):
            watcher.cancel()
    state, _ = await log.sync(sandbox_id)
    assert state is not None and state.commands[command_id].state == "exited"
    records = await read_range(
        nc.jetstream(), names.events_stream, names.events("sandbox", sandbox_id), decode_envelope
    )
    types = [envelope.type for _, _, envelope in records]
    assert types[-3:] == ["command.dispatched", "command.started", "command.ended"]
