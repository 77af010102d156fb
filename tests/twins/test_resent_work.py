"""A pass sends a host only the work it has not just had stored (decision 097):
commands dispatched side by side in one sandbox get their run instruction once,
not once more with every event of that sandbox. A real server and scheduler;
no host-agent takes the work, so the commands stay `dispatched`."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats
import pytest
from sandhold.bus import reconciler
from sandhold.bus.names import Names
from sandhold.bus.reconciler import SentWork
from sandhold.bus.store import AggregateStore
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.scheduler import service as scheduler_service
from sandhold.scheduler.service import Scheduler

from tests.support.waiting import wait_until
from tests.twins.support import Running, append, keep_renewing, register_host, running_sandbox


async def test_commands_dispatched_side_by_side_get_their_run_instruction_once(
    nc: nats.NATS, nats_url: str, names: Names, monkeypatch: pytest.MonkeyPatch
):
    await register_host(nc, names, "h1", capacity=4)
    renewal = asyncio.create_task(keep_renewing(nc, names, "h1"))
    sandbox_id = await running_sandbox(nc, names, "side-by-side", "h1")
    # Every copy the scheduler publishes, and whether the stream stored it (one
    # that failed, a timeout on a loaded machine, is rightly sent again).
    sent: dict[str, list[bool | None]] = {}

    async def send_work(js: Any, names: Names, host: str, work: wk.AnyWork) -> bool:
        answers = sent.setdefault(work.msg_id, [])
        answers.append(None)
        answers[-1] = stored = await reconciler.send_work(js, names, host, work)
        return stored

    monkeypatch.setattr(scheduler_service, "send_work", send_work)
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
            await wait_until(lambda r=run_id: True in sent.get(r, ()), timeout=20, what=run_id)
        # The passes of the later commands' events (each one's queuing, which
        # dispatches it: 098) have all run: the last one's instruction went out
        # after them.
        state, _ = await log.sync(sandbox_id)
        assert state is not None
        assert [state.commands[c].state for c in ids] == ["dispatched"] * 4
        for command_id in ids:
            answers = sent[f"run_command:{command_id}:1"]
            # Sent until stored, then not again (before 097: 8, 6, 2 more copies).
            assert answers[answers.index(True) :] == [True], (command_id, answers)
    finally:
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


def test_work_stored_is_forgotten_once_the_connection_is_another():
    # (A server that restarted has forgotten the ids of what its hosts took.)
    reconnects = [0]
    sent = SentWork(30.0, connection=lambda: reconnects[0], clock=lambda: 0.0)
    sent.stored("a")
    assert sent.recent("a")
    reconnects[0] += 1
    assert not sent.recent("a")
    sent.stored("a")
    assert sent.recent("a")
