"""Waiting for a sandbox's commands to report their ends (`HostAgent._settle`,
before a stop or a destroy) never ends those reports itself."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from sandhold.hostagent.service import HostAgent


async def test_a_cancelled_wait_for_the_ends_leaves_the_agents_watchers_running() -> None:
    """The watchers are the agent's: cancelled (its stop handler was), the wait
    must not cancel them, or those commands' ends go unreported until a restart."""
    reported = asyncio.Event()
    watcher = asyncio.create_task(reported.wait())
    agent = SimpleNamespace(_watchers={"c1": watcher}, _watcher_sandbox={"c1": "sb1"})
    settling = asyncio.create_task(HostAgent._settle(agent, "sb1"))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    settling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert not watcher.done()
    reported.set()
    await asyncio.wait_for(watcher, 10)
