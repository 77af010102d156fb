"""A host's saves under way end, and are waited for, before a fence kills the
sandboxes or the agent shuts down (`HostAgent._end_jobs`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import SimpleNamespace

import pytest
from sandhold.hostagent.service import HostAgent


def _agent(*jobs: asyncio.Task[None]) -> SimpleNamespace:
    return SimpleNamespace(_jobs=set(jobs), host_id="h1")


async def test_a_save_that_carries_on_after_its_first_cancel_has_ended_when_the_jobs_have() -> None:
    """As a save whose ack came with the cancel (decision 080): it swallows the
    first cancel and goes on to its thaw; the fence must not kill before that."""
    thawed = asyncio.Event()

    async def save() -> None:
        # The cancel swallowed, as asyncio.wait_for can on 3.11.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)  # uploading
        try:
            await asyncio.sleep(3600)  # the next chunk's wait
        finally:
            thawed.set()

    job = asyncio.create_task(save())
    await asyncio.sleep(0)
    await HostAgent._end_jobs(_agent(job), timeout=10.0)  # type: ignore[arg-type]
    assert job.done()
    assert thawed.is_set()


async def test_a_save_that_will_not_end_holds_a_fence_only_as_long_as_its_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    job = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    try:
        with caplog.at_level(logging.WARNING):
            async with asyncio.timeout(10):  # (a failure, not a hang, if unbounded)
                await HostAgent._end_jobs(_agent(job), timeout=0.3)  # type: ignore[arg-type]
        assert not job.done()
        assert "1 save(s) of h1 had not ended" in caplog.text
    finally:
        release.set()
        await asyncio.wait_for(job, 10)


async def test_a_fence_kills_the_sandboxes_only_once_their_saves_have_thawed() -> None:
    """`_fence_self`: a save under way (frozen box) ends, its thaw done, before
    the fence stops any sandbox (a frozen process cannot even be killed)."""
    frozen = True
    stopped_while_frozen: list[bool] = []

    async def save() -> None:
        nonlocal frozen
        try:
            await asyncio.sleep(3600)  # capturing, the box frozen
        finally:
            await asyncio.sleep(0.05)  # the thaw's own write
            frozen = False

    async def stop_sandbox(sandbox_id: str, grace: float) -> None:
        stopped_while_frozen.append(frozen)

    async def remove_connections(sandbox_id: str) -> None:
        return None

    job = asyncio.create_task(save())
    await asyncio.sleep(0)
    agent = SimpleNamespace(
        _fenced=False,
        _jobs={job},
        host_id="h1",
        _lease_ttl=5.0,
        driver=SimpleNamespace(
            layout=SimpleNamespace(sandbox_ids=lambda: ["sb1"]),
            stop_sandbox=stop_sandbox,
            remove_connections=remove_connections,
        ),
        _local_generation=lambda sandbox_id: None,
    )
    agent._end_jobs = lambda timeout: HostAgent._end_jobs(agent, timeout=timeout)  # type: ignore[arg-type]
    async with asyncio.timeout(10):
        await HostAgent._fence_self(agent)  # type: ignore[arg-type]
    assert stopped_while_frozen == [False]
    assert job.done()
