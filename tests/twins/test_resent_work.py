"""A pass sends a host only the work it has not just had stored (decision 097):
commands dispatched side by side in one sandbox get their run instruction once,
not once more with every event of that sandbox. A real server and scheduler;
no host-agent takes the work, so the commands stay `dispatched`."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import nats
from nats.aio.msg import Msg
from sandhold.bus.names import Names
from sandhold.bus.reconciler import SentWork
from sandhold.bus.store import AggregateStore
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.scheduler.service import Scheduler

from tests.support.waiting import wait_until
from tests.twins.support import Running, append, keep_renewing, register_host, running_sandbox


async def test_commands_dispatched_side_by_side_get_their_run_instruction_once(
    nc: nats.NATS, nats_url: str, names: Names
):
    await register_host(nc, names, "h1", capacity=4)
    renewal = asyncio.create_task(keep_renewing(nc, names, "h1"))
    sandbox_id = await running_sandbox(nc, names, "side-by-side", "h1")
    sent: Counter[str] = Counter()

    async def seen(msg: Msg) -> None:
        sent[(msg.headers or {}).get("Nats-Msg-Id", "")] += 1

    # (Every copy published, the ones JetStream then drops as duplicates too.)
    sub = await nc.subscribe(names.work("h1"), cb=seen)
    await nc.flush()
    running = Running()
    log = AggregateStore(nc.jetstream(), names, "sandbox", sb.evolve, actor="t", follow=False)
    try:
        running.start(Scheduler(nats_url, names))
        ids = []
        for i in range(4):  # each queued after the one before is dispatched
            request = rq.RunCommand(key=f"run-{i}", sandbox_id=sandbox_id, argv=["sleep", "60"])
            state, _ = await log.sync(sandbox_id)
            await append(nc, names, "sandbox", sandbox_id, sb.decide(state, request))
            ids.append(rq.command_id_for(sandbox_id, request.key))
            run_id = f"run_command:{ids[-1]}:1"
            await wait_until(lambda r=run_id: sent[r] > 0, timeout=20, what=f"{run_id} sent")
        # The passes of the later commands' events (queued, dispatched) have all
        # run: the last one's instruction went out after them.
        await nc.flush()
        state, _ = await log.sync(sandbox_id)
        assert state is not None
        assert [state.commands[c].state for c in ids] == ["dispatched"] * 4
        assert {f"run_command:{c}:1": sent[f"run_command:{c}:1"] for c in ids} == {
            f"run_command:{c}:1": 1 for c in ids
        }
    finally:
        await sub.unsubscribe()
        await running.close()
        renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewal


def test_work_stored_is_quiet_for_its_time_then_sent_again():
    now = [100.0]
    sent = SentWork(30.0, clock=lambda: now[0])
    assert not sent.recent("a")
    sent.stored("a")
    now[0] += 10
    sent.stored("b")
    assert sent.recent("a") and sent.recent("b")
    now[0] += 20  # a: 30 s since it was stored
    assert not sent.recent("a") and sent.recent("b")
    sent.stored("c")  # (a is let go of as it is passed over)
    assert list(sent._stored_at) == ["b", "c"]
    now[0] += 10
    assert not sent.recent("b") and sent.recent("c")
