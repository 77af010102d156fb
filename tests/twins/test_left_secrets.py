"""A scheduler that starts removes the secrets a stopped one left behind: kept
for a command that is not waiting to start any more (its store keeps no ended
command to find them by, decision 057), once they are older than its grace."""

from __future__ import annotations

import nats
from sandhold.bus import secret_store
from sandhold.bus.names import Names
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.scheduler.service import Scheduler

from tests.domain.history import apply
from tests.support.waiting import wait_until
from tests.twins.support import Running, append


async def _queued_with_secrets(nc: nats.NATS, names: Names) -> str:
    """A pending sandbox with a command queued that names secrets; its id."""
    create = rq.CreateSandbox(key="waits", tenant="default")
    sandbox_id = rq.sandbox_id_for("default", create.key)
    run = rq.RunCommand(
        key="run-1", tenant="default", sandbox_id=sandbox_id, argv=["true"],
        secrets={"TOKEN": "t0p"},
    )  # fmt: skip
    created = sb.decide(None, create)
    await append(
        nc, names, "sandbox", sandbox_id, [*created, *sb.decide(apply(None, created), run)]
    )
    return rq.command_id_for(sandbox_id, run.key)


async def _kept(nc: nats.NATS, names: Names) -> set[str]:
    held = await secret_store.held(nc.jetstream(), names, names.secret("*"))
    return {subject.rsplit(".", 1)[1] for subject in held}


async def _started(nats_url: str, names: Names, running: Running, grace_s: float) -> Scheduler:
    scheduler = running.start(Scheduler(nats_url, names, left_secrets_grace_s=grace_s))
    await wait_until(
        lambda: scheduler.left_secrets_removed is not None,
        timeout=30,
        what="the scheduler looked for secrets left over",
    )
    return scheduler


async def test_secrets_left_for_no_waiting_command_are_removed_and_a_waiting_ones_kept(
    nc: nats.NATS, nats_url: str, names: Names
):
    js = nc.jetstream()
    waiting = await _queued_with_secrets(nc, names)
    for command_id in (waiting, "cmd-ended-long-ago"):
        await secret_store.keep(js, names, names.secret(command_id), {"TOKEN": "t0p"})
    running = Running()
    try:
        young = await _started(nats_url, names, running, grace_s=3600)
        assert young.left_secrets_removed == 0, "kept a moment ago: maybe one on its way"
        assert await _kept(nc, names) == {waiting, "cmd-ended-long-ago"}
        await running.stop(young)

        scheduler = await _started(nats_url, names, running, grace_s=0)
        assert scheduler.left_secrets_removed == 1
        assert await _kept(nc, names) == {waiting}, "the queued command's stay for its launch"
    finally:
        await running.close()
