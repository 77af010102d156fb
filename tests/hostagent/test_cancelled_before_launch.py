"""A command dispatched to this host whose run instruction had not come when
its cancel or its sandbox's stop was decided never runs, and the host says so:
`not_launched`, not left `dispatched` (decision 098 dispatches a command as it
is queued; the instruction follows a moment later). A real server, driver and
supervisor."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sandhold.domain import events as ev
from sandhold.domain import requests as rq
from sandhold.domain import sandbox as sb
from sandhold.domain import work as wk
from sandhold.domain.fold import fold
from sandhold.hostagent import service
from sandhold.hostagent.driver import ProcessDriver

from tests.hostagent.dispatching import Dispatched
from tests.support.waiting import wait_until


async def _end_of(command: Dispatched) -> sb.Command:
    state = fold(sb.evolve, await command.events(), None)
    assert state is not None
    return state.commands[command.command_id]


async def _cancelled(command: Dispatched) -> None:
    cancel = rq.CancelCommand(
        key="cancel-1", sandbox_id=command.sandbox_id, command_id=command.command_id
    )
    await command.decided(cancel)


async def test_a_cancel_that_comes_before_the_run_ends_the_command_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["sh", "-c", "touch ran"])
    marker = driver.workspace(command.sandbox_id) / "ran"
    await _cancelled(command)
    cancel = wk.CancelCommandWork(
        sandbox_id=command.sandbox_id, generation=1, command_id=command.command_id
    )
    await command.agent._do(cancel)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == ("not_launched", "cancelled before it started")
    # The run instruction, coming after all, finds it ended: nothing runs.
    await command.agent._do(command.work)
    assert not driver.launched(command.sandbox_id, command.command_id)
    assert not marker.exists()
    assert await command.last_types(2) == ["command.cancel_requested", "command.ended"]


async def test_a_run_whose_cancel_was_decided_first_is_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["sh", "-c", "touch ran"])
    marker = driver.workspace(command.sandbox_id) / "ran"
    await _cancelled(command)
    await command.agent._do(command.work)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == ("not_launched", "cancelled before it started")
    assert not driver.launched(command.sandbox_id, command.command_id)
    assert not marker.exists()


async def test_a_cancel_of_a_launched_command_interrupts_it_and_its_run_again_launches_nothing(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # (Its start unreported for the test's length: the log has it `dispatched`,
    # as a command launched a moment ago. Its marker is where the tests above
    # look for one: a command that ran leaves it.)
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 60.0)
    command = await dispatch(["sh", "-c", "touch ran; exec sleep 30"])
    await command.agent._do(command.work)
    marker = driver.workspace(command.sandbox_id) / "ran"
    await wait_until(marker.exists, timeout=30, what="the command's marker")
    await _cancelled(command)
    # Its run instruction again (redelivered): launched here, so it is not
    # "cancelled before it started".
    await command.agent._do(command.work)
    assert await command.last_types(1) == ["command.cancel_requested"]
    cancel = wk.CancelCommandWork(
        sandbox_id=command.sandbox_id, generation=1, command_id=command.command_id
    )
    await command.agent._do(cancel)
    await command.ended()
    assert (await _end_of(command)).state == "interrupted"


async def test_a_cancel_of_a_command_that_ended_before_its_end_was_reported_changes_nothing(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # A `true` ends at once, its end alone reported (095): until that report is
    # stored the log has it `dispatched`. A cancel then finds it ended, not unlaunched.
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 30.0)
    command = await dispatch(["true"])
    agent, report, release = command.agent, command.agent._report, asyncio.Event()

    async def end_held(sandbox: str, event: Any, cause: str) -> None:
        if isinstance(event, ev.CommandEnded) and event.state == "exited":
            await release.wait()
        await report(sandbox, event, cause)

    agent._report = end_held  # type: ignore[method-assign]
    await agent._do(command.work)
    await asyncio.wait_for(driver.handle(command.sandbox_id, command.command_id).wait(), 30)
    await _cancelled(command)
    cancel = wk.CancelCommandWork(
        sandbox_id=command.sandbox_id, generation=1, command_id=command.command_id
    )
    await agent._do(cancel)
    assert await command.last_types(1) == ["command.cancel_requested"]
    release.set()
    await command.ended()
    assert (await _end_of(command)).state == "exited"


async def test_a_stop_ends_the_commands_whose_run_never_came_not_launched(
    dispatch, driver: ProcessDriver
):
    command = await dispatch(["true"])
    await command.decided(rq.StopSandbox(key="stop-1", sandbox_id=command.sandbox_id))
    # (No final save here: what the stop does with commands is what is looked at.)
    stop = wk.StopSandboxWork(sandbox_id=command.sandbox_id, generation=1)
    await command.agent._do(stop)
    ended = await _end_of(command)
    assert (ended.state, ended.reason) == (
        "not_launched",
        "the sandbox was stopping before it started",
    )
    assert await command.last_types(2) == ["command.ended", "sandbox.stopped"]
    assert not driver.launched(command.sandbox_id, command.command_id)


async def test_a_stop_leaves_a_launched_commands_end_to_the_command(
    dispatch, driver: ProcessDriver, monkeypatch: pytest.MonkeyPatch
):
    # Launched, its start not reported yet: the log has it `dispatched` when the
    # stop reads the sandbox. The stop must not call it unlaunched.
    monkeypatch.setattr(service, "START_REPORT_DELAY_S", 60.0)
    command = await dispatch(["sleep", "30"])
    agent = command.agent
    await agent._do(command.work)
    assert isinstance(await driver.handle(command.sandbox_id, command.command_id).started(), int)
    await command.decided(rq.StopSandbox(key="stop-1", sandbox_id=command.sandbox_id))
    state, _ = await agent.sandboxes.sync(command.sandbox_id, from_leader=True)
    assert state is not None and state.commands[command.command_id].state == "dispatched"
    stop = wk.StopSandboxWork(sandbox_id=command.sandbox_id, generation=1)
    # What the stop does with the state it read, once the processes are stopped:
    # (called here while the command still runs, so its own end cannot hide it).
    await agent._end_unlaunched(state, stop)
    assert await command.last_types(1) == ["sandbox.stop_requested"]
    await agent._do(stop)
    ended = await _end_of(command)
    assert ended.state not in ("not_launched", "dispatched"), ended
